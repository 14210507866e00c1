"""The facts the memory model (:mod:`tunekit.memory`) needs, measured on one process.

A fresh copy of the workload's model and optimizer trains a few steps here (no process
group, no collectives) with every allocation followed (:mod:`tunekit.observe.memory`):

* the steady state: parameters, buffers, optimizer state once it exists;
* per checkpoint policy (none, full, selective, each on every block) and at two batch
  sizes: what each block's forward leaves allocated, the level at the end of forward,
  and backward's peak twice, once with gradients created as backward goes (as training
  runs) and once with them allocated beforehand, which separates the gradients that exist
  at the peak from the activations and temporaries;
* the optimizer step's temporaries above parameters, gradients and state.

Lines in the batch are fitted through the two batches, so a prediction at another
micro-batch extrapolates what was measured. Cost: (1 + 3 policies x 2 batches x 2) steps
of the job's own size on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from tunekit.memory import POLICIES, BlockFacts, Line, MemoryFacts, PolicyFacts
from tunekit.observe.memory import AllocationTracker
from tunekit.runtime.data import to_device
from tunekit.runtime.sharding import BlockCheckpointing, model_blocks
from tunekit.workload import Workload

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def memory_batches(batch_size: int) -> tuple[int, int]:
    """The two per-rank batches the lines are measured at: the job's and half of it."""
    return (max(1, batch_size // 2), batch_size) if batch_size > 1 else (1, 2)


def measure_memory_facts(
    workload: Workload, device: torch.device | None = None, batches: tuple[int, ...] | None = None
) -> MemoryFacts:
    """Train a fresh copy of ``workload`` here and measure what the memory model needs."""
    device = torch.device(device or "cpu")
    batches = tuple(sorted(set(batches or memory_batches(workload.batch_size))))
    torch.manual_seed(workload.seed)
    model = workload.model().to(device)
    optimizer = workload.optimizer(model.parameters(), workload.lr)
    blocks = model_blocks(model)
    dtype = _DTYPES.get(workload.precision)
    params = list(model.parameters())
    param_bytes = float(sum(p.numel() * p.element_size() for p in params))
    grad_bytes = float(sum(p.numel() * p.element_size() for p in params if p.requires_grad))
    buffer_bytes = float(sum(b.numel() * b.element_size() for b in model.buffers()))
    elem = params[0].element_size() if params else 4

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    kept: dict[str, dict[str, dict[int, float]]] = {b: {p: {} for p in POLICIES} for b in blocks}
    forward_end: dict[str, dict[int, float]] = {p: {} for p in POLICIES}
    backward: dict[str, dict[int, float]] = {p: {} for p in POLICIES}
    grads_at_peak: dict[str, list[float]] = {p: [] for p in POLICIES}
    with AllocationTracker(device) as tracker:

        def step(n: int, policy: str) -> tuple[float, float]:
            """Forward and backward of a batch of ``n``; (forward end, backward peak) above
            the level before it; what each block kept goes into ``kept[block][policy]``."""
            base = tracker.current()
            inputs, targets = workload.example_batch(n, seed=n)
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            with _block_levels(model, blocks, tracker) as levels, autocast():
                loss = workload.loss(model(inputs), targets)
            end = tracker.current() - base
            window = tracker.open()
            loss.backward()
            peak = window.close() - base
            del loss, inputs, targets
            for name, value in levels.items():
                kept[name][policy][n] = value
            return end, peak

        # Warm-up: creates the optimizer state (and lazy modules, allocator pools).
        step(batches[0], "none")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_bytes = float(
            sum(
                v.numel() * v.element_size()
                for state in optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
        )
        # The optimizer step's temporaries, with its state in place.
        step(batches[0], "none")
        window = tracker.open()
        optimizer.step()
        optimizer_temp = float(window.close() - window.start_bytes)
        optimizer.zero_grad(set_to_none=True)

        for policy in POLICIES:
            wrap = BlockCheckpointing(model, blocks, policy) if policy != "none" else None
            try:
                for n in batches:
                    end, real = step(n, policy)  # gradients appear during backward
                    optimizer.zero_grad(set_to_none=False)  # now they exist (zeros) beforehand
                    _, held = step(n, policy)
                    optimizer.zero_grad(set_to_none=True)
                    forward_end[policy][n] = end
                    backward[policy][n] = held
                    grads_at_peak[policy].append(max(0.0, min(grad_bytes, real - held)))
            finally:
                if wrap is not None:
                    wrap.remove()
    block_params = {
        name: float(
            sum(p.numel() * p.element_size() for p in model.get_submodule(name).parameters())
        )
        for name in blocks
    }
    return MemoryFacts(
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        buffer_bytes=buffer_bytes,
        optimizer_bytes=optimizer_bytes,
        optimizer_temp_bytes=max(0.0, optimizer_temp),
        blocks=tuple(
            BlockFacts(name, block_params[name], {p: Line.through(kept[name][p]) for p in POLICIES})
            for name in blocks
        ),
        policies={
            p: PolicyFacts(
                Line.through(forward_end[p]),
                Line.through(backward[p]),
                max(grads_at_peak[p]) if grads_at_peak[p] else 0.0,
            )
            for p in POLICIES
        },
        batches=batches,
        compute_bytes_per_param=2.0 if dtype is not None else float(elem),
        param_elem_bytes=float(elem),
        method=tracker.method,
    )


@contextlib.contextmanager
def _block_levels(
    model: nn.Module, blocks: list[str], tracker: AllocationTracker
) -> Iterator[dict[str, float]]:
    """Per block: bytes its forward left allocated (activations it keeps and its output)."""
    levels: dict[str, float] = {}
    handles = []
    for name in blocks:
        module = model.get_submodule(name)
        start: dict[str, float] = {}

        def pre(_m, _args, name=name, start=start):
            start[name] = tracker.current()

        def post(_m, _args, _out, name=name, start=start):
            levels[name] = levels.get(name, 0.0) + tracker.current() - start.pop(name)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield levels
    finally:
        for h in handles:
            h.remove()
