"""Measuring in this process: a step's memory peak, saved activations, step times, OOM errors.

Peaks come from the core's :class:`~tunekit.api.PeakMeter`, which reads the allocator that
served the step (CUDA: its own counters; CPU: the profiler's allocation events, see
:mod:`tunekit.observe.memory`). (RSS deltas would hide reuse inside glibc's arenas;
tracemalloc does not see torch's allocator at all.)

:func:`saved_activation_bytes` counts the tensors autograd keeps for backward
(the measured counterpart of the paper's feature-map term, Eq. 2).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tunekit.api import PeakMeter, StepTiming, Workload, intra_op_threads, time_steps, to_device
from tunekit.plugins.batch_ps_sizing.model import MemoryProfile


def saved_activation_bytes(model: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for backward while ``run()`` builds the graph.

    Parameters saved by layers (a linear layer keeps its weight) are left out:
    they are alive anyway. ``run`` returns the loss (it may run backward too:
    only tensors saved while the graph is built are seen).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    del loss
    return sum(seen.values())


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (momentum buffers, Adam moments ...)."""
    return sum(tensor_bytes(state.values()) for state in optimizer.state.values())


def static_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What stays allocated between steps when gradients are set to None: parameters, buffers, optimizer state."""
    return (
        tensor_bytes(model.parameters())
        + tensor_bytes(model.buffers())
        + optimizer_state_bytes(optimizer)
    )


@dataclass
class StepMemory:
    """One measured training step at one batch size."""

    batch: int
    peak_extra_bytes: float | None
    """Peak above what was allocated before the step (activations, gradients, temporaries)."""
    saved_bytes: int
    """Tensors autograd saved for backward (activations)."""


@dataclass
class LocalMeasurement:
    """The workload trained on one rank in this process: memory at two batches, step times at several."""

    memory: MemoryProfile
    steps: list[StepMemory]
    timing: StepTiming

    @property
    def step_s(self) -> dict[int, float]:
        """Median wall time of a whole training step per timed batch (not profiled)."""
        return self.timing.step_s()

    def to_dict(self) -> dict:
        return {
            "memory": self.memory.to_dict(),
            "steps": [s.__dict__ for s in self.steps],
            "timing": self.timing.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> LocalMeasurement:
        return cls(
            MemoryProfile(**d["memory"]),
            [StepMemory(**s) for s in d["steps"]],
            StepTiming.from_dict(d["timing"]),
        )


def measure_locally(
    workload: Workload,
    batches: tuple[int, ...],
    device: torch.device | None = None,
    timed_steps: int = 3,
    *,
    timing_batches: tuple[int, ...] | None = None,
    threads: int | None = None,
    budget_s: float = math.inf,
    required: tuple[int, ...] = (),
    max_repeats: int | None = None,
) -> LocalMeasurement:
    """Train a fresh copy of the workload's model: its memory line and its step times.

    Memory is measured at ``batches``; steps are timed at ``timing_batches``
    (default: the same) with ``threads`` intra-op threads (default: as set),
    ``timed_steps`` repeats each (up to ``max_repeats`` within ``budget_s``;
    see :func:`time_steps`).

    The first step (at the smallest batch) is a warm-up that creates the
    optimizer state, so ``static_bytes`` includes it. Gradients are set to
    None between steps, as the runtime does, so they count in the step's peak.
    The per-sample slope is at least the saved activations' slope: a peak that
    a batch-independent temporary (an optimizer step, a large gradient)
    dominates at small batches would otherwise extrapolate flat.
    """
    if len(set(batches)) < 2:
        raise ValueError("measure at two or more distinct batch sizes")
    device = device or torch.device("cpu")
    with intra_op_threads(threads):
        model = workload.model().to(device)
        optimizer = workload.optimizer(model.parameters(), workload.lr)

        def step(b: int, meter: PeakMeter | None = None) -> StepMemory:
            if meter is None:
                inputs, targets = workload.example_batch(b)
                _train(
                    model,
                    optimizer,
                    workload,
                    to_device(inputs, device),
                    to_device(targets, device),
                )
                return StepMemory(b, None, 0)
            with meter:  # the batch counts: a real step holds its input too
                inputs, targets = workload.example_batch(b)
                run = functools.partial(
                    _train,
                    model,
                    optimizer,
                    workload,
                    to_device(inputs, device),
                    to_device(targets, device),
                )
                saved = saved_activation_bytes(model, run)
                del run, inputs, targets
            return StepMemory(b, meter.peak_bytes, saved)

        step(min(batches))  # warm-up: optimizer state, allocator pools, lazy modules
        rows, method = [], ""
        for b in sorted(set(batches)):
            meter = PeakMeter(device)
            rows.append(step(b, meter))
            method = meter.method
        timing = time_steps(
            workload,
            timing_batches or batches,
            device,
            repeats=timed_steps,
            budget_s=budget_s,
            required=required,
            max_repeats=max_repeats,
            model=model,
            optimizer=optimizer,
        )
    peaks = {r.batch: r.peak_extra_bytes for r in rows if r.peak_extra_bytes is not None}
    if len(peaks) < 2:
        # No allocator view (a profiler was already running): saved activations only.
        peaks, method = {r.batch: float(r.saved_bytes) for r in rows}, "saved-tensors"
    b1, s1, b2, s2 = rows[0].batch, rows[0].saved_bytes, rows[-1].batch, rows[-1].saved_bytes
    profile = MemoryProfile.fit(
        static_bytes(model, optimizer), peaks, method, min_per_sample=(s2 - s1) / (b2 - b1)
    )
    return LocalMeasurement(profile, rows, timing)


def _train(model, optimizer, workload: Workload, inputs, targets) -> torch.Tensor:
    loss = workload.loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
