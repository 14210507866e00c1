"""The facts the memory model (:mod:`tunekit.memory`) needs, measured on one process.

A fresh copy of the workload's model and optimizer trains a few steps here (no process
group, no collectives) with every allocation followed (:mod:`tunekit.observe.memory`):

* the steady state: parameters, buffers, optimizer state once it exists;
* per checkpoint policy (none, full, selective, each on every block) and at two batch
  sizes: what each block's forward leaves allocated, and backward segment by segment -- the
  head's (from the loss to the last block) and each block's (from the gradient of its
  output to that of the block before it) -- at its peak. Backward runs twice: once with the
  gradients allocated beforehand, so that the segments' peaks hold activations and
  temporaries only, and once as training runs (gradients appear as backward goes), which
  says how many gradient bytes exist at the head's peak;
* the optimizer step's temporaries above parameters, gradients and state.

Lines in the batch are fitted through the two batches, so a prediction at another
micro-batch extrapolates what was measured. Cost: (2 + 3 policies x 2 batches x 2) steps
of the job's own size on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from tunekit.memory import POLICIES, BlockFacts, Line, MemoryFacts, PolicyFacts
from tunekit.observe.memory import AllocationTracker
from tunekit.runtime.data import to_device
from tunekit.runtime.sharding import BlockCheckpointing, model_blocks
from tunekit.workload import Workload

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD = ""
"""The backward segment before any block's: the loss's, the head's."""


def memory_batches(batch_size: int) -> tuple[int, int]:
    """The two per-rank batches the lines are measured at: the job's and half of it."""
    return (max(1, batch_size // 2), batch_size) if batch_size > 1 else (1, 2)


@dataclass
class _Step:
    """One measured forward and backward, in bytes above the level before it."""

    forward_end: float
    backward_peak: float
    kept: dict[str, float] = field(default_factory=dict)
    """Per block: what its forward left allocated."""
    segments: dict[str, float] = field(default_factory=dict)
    """Per backward segment (``HEAD``, then each block's): its peak."""


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
    elem = params[0].element_size() if params else 4

    def nbytes(tensors) -> float:
        return float(sum(t.numel() * t.element_size() for t in tensors))

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    runs: dict[tuple[str, int, bool], _Step] = {}
    with AllocationTracker(device) as tracker:

        def step(n: int, policy: str, grads_held: bool) -> None:
            base = tracker.current()
            inputs, targets = workload.example_batch(n, seed=n)
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            with _instrumented(model, blocks, tracker) as seen, autocast():
                loss = workload.loss(model(inputs), targets)
                end = tracker.current() - base
                seen.begin_backward()
                overall = tracker.open()
                loss.backward()
                peak = overall.close() - base
                seen.end_backward()
            del loss, inputs, targets
            runs[(policy, n, grads_held)] = _Step(
                end,
                peak,
                {k: v for k, v in seen.kept.items()},
                {k: v - base for k, v in seen.segments.items()},
            )

        # Warm-up: creates the optimizer state (and lazy modules, allocator pools).
        step(batches[0], "none", False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_bytes = nbytes(
            v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)
        )  # fmt: skip
        # The optimizer step's temporaries, with its state in place.
        step(batches[0], "none", False)
        window = tracker.open()
        optimizer.step()
        optimizer_temp = float(window.close() - window.start_bytes)
        optimizer.zero_grad(set_to_none=True)

        for policy in POLICIES:
            wrap = BlockCheckpointing(model, blocks, policy) if policy != "none" else None
            try:
                for n in batches:
                    step(n, policy, False)  # gradients appear during backward
                    optimizer.zero_grad(set_to_none=False)  # now they exist (zeros) beforehand
                    step(n, policy, True)
                    optimizer.zero_grad(set_to_none=True)
            finally:
                if wrap is not None:
                    wrap.remove()

    def line(get) -> Line:
        return Line.through({n: get(n) for n in batches})

    def held(policy: str, n: int) -> _Step:
        return runs[(policy, n, True)]

    def grads_at_peak(policy: str) -> float:
        """Gradient bytes alive at the head's peak: the real run's peak over the held run's."""
        n = batches[-1]
        real, kept = runs[(policy, n, False)], held(policy, n)
        return max(0.0, min(nbytes(params), real.segments[HEAD] - kept.segments[HEAD]))

    return MemoryFacts(
        param_bytes=nbytes(params),
        grad_bytes=nbytes(p for p in params if p.requires_grad),
        buffer_bytes=nbytes(model.buffers()),
        optimizer_bytes=optimizer_bytes,
        optimizer_temp_bytes=max(0.0, optimizer_temp),
        blocks=tuple(
            BlockFacts(
                name,
                nbytes(model.get_submodule(name).parameters()),
                {p: line(lambda n, p=p, b=name: held(p, n).kept.get(b, 0.0)) for p in POLICIES},
                {p: line(lambda n, p=p, b=name: held(p, n).segments.get(b, 0.0)) for p in POLICIES},
            )
            for name in blocks
        ),
        policies={
            p: PolicyFacts(
                line(lambda n, p=p: held(p, n).forward_end),
                line(lambda n, p=p: held(p, n).backward_peak),
                grads_at_peak(p),
                line(lambda n, p=p: held(p, n).segments[HEAD]),
            )
            for p in POLICIES
        },
        batches=batches,
        compute_bytes_per_param=2.0 if dtype is not None else float(elem),
        param_elem_bytes=float(elem),
        method=tracker.method,
    )


class _Seen:
    """What :func:`_instrumented` records: blocks' kept bytes, backward segments' peaks.

    Segments are cut by the tracker's markers, not by draining it: a drain inside backward
    (in a gradient hook) would stop the profiler in the middle of an autograd operation."""

    def __init__(self, tracker: AllocationTracker):
        self.tracker = tracker
        self.kept: dict[str, float] = {}
        self.segments: dict[str, float] = {}

    def begin_backward(self) -> None:
        self.tracker.mark(HEAD or "head")

    def enter(self, name: str) -> None:
        """The gradient of block ``name``'s output exists: its backward segment begins."""
        self.tracker.mark(name)

    def end_backward(self) -> None:
        peaks = self.tracker.end_segments()
        self.segments = {(HEAD if k == "head" else k): float(v) for k, v in peaks.items()}


@contextlib.contextmanager
def _instrumented(
    model: nn.Module, blocks: list[str], tracker: AllocationTracker
) -> Iterator[_Seen]:
    """Per block: bytes its forward left allocated (activations it keeps and its output), and
    a hook on its output's gradient that starts its backward segment."""
    seen = _Seen(tracker)
    handles = []
    for name in blocks:
        module = model.get_submodule(name)
        start: dict[str, float] = {}

        def pre(_m, _args, name=name, start=start):
            start[name] = tracker.current()

        def post(_m, _args, out, name=name, start=start):
            seen.kept[name] = seen.kept.get(name, 0.0) + tracker.current() - start.pop(name)
            first = out[0] if isinstance(out, tuple | list) else out
            if isinstance(first, torch.Tensor) and first.requires_grad:
                first.register_hook(lambda g, name=name: seen.enter(name))

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
