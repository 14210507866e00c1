"""The workload's loss tried once while observing, before any trial.

A trace runs the model's forward pass only, so a loss that cannot train —
targets of shape ``(n, 1)`` for ``cross_entropy``, a loss that is not a scalar,
an output the loss cannot read — used to pass ``tunekit plan`` with a full
table and fail ``tunekit auto`` at its baseline trial, minutes later.
:func:`try_first_step` runs one forward, loss and backward on the example
batch, as a training rank does (``loss(model(inputs), targets).backward()``),
and fails in one line naming the shapes involved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tunekit.errors import WorkloadError
from tunekit.workload import DOC, Batch, Workload

__all__ = ["try_first_step"]


def try_first_step(workload: Workload, model: nn.Module, batch: Batch) -> None:
    """One forward + loss + backward of ``model`` on ``batch``; :class:`WorkloadError` in one
    line if the loss cannot train. The model is left as it was: modes, buffers (batch-norm
    statistics), gradients, and the global RNG (dropout)."""
    inputs, targets = batch
    modes = [(m, m.training) for m in model.modules()]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    try:
        with torch.random.fork_rng(devices=[]):
            model.train()
            try:
                output = model(inputs)
            except Exception as exc:  # traced fine without gradients: train mode differs
                raise _failed(
                    workload, "its training forward pass fails", exc, None, targets
                ) from exc
            try:
                loss = workload.loss(output, targets)
            except Exception as exc:
                raise _failed(workload, "its loss fails", exc, output, targets) from exc
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise WorkloadError(
                    f"workload {workload.name!r}: the loss must be one number (a mean over the "
                    f"batch), not {got} ({_shapes(output, targets)}; see {DOC})"
                )
            if not loss.requires_grad:
                raise WorkloadError(
                    f"workload {workload.name!r}: the loss does not depend on the model's "
                    f"parameters (nothing to train: is the output detached?; see {DOC})"
                )
            try:
                loss.backward()
            except Exception as exc:
                raise _failed(workload, "its backward pass fails", exc, output, targets) from exc
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for name, p in model.named_parameters():
            p.grad = grads.get(name)
        for m, training in modes:
            m.training = training


def _failed(workload: Workload, what: str, exc: Exception, output: Any, targets: Any):
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return WorkloadError(
        f"workload {workload.name!r}: {what} on the example batch ({type(exc).__name__}: "
        f"{first}; {_shapes(output, targets)}; see {DOC})"
    )


def _shapes(output: Any, targets: Any) -> str:
    return f"model output {_shape(output)}, targets {_shape(targets)}"


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_shape(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in value.items()) + "}"
    if value is None:
        return "None"
    loss = getattr(value, "loss", None)  # a Hugging Face ModelOutput
    return f"{type(value).__name__}" + (f" with loss {_shape(loss)}" if loss is not None else "")
