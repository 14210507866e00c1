"""Measuring in this process: a step's memory peak, saved activations, step times, OOM errors.

Peaks come from the allocator that served the step:

* CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before.
* CPU: there is no allocator statistic, but ``torch.profiler`` with
  ``profile_memory=True`` records every allocation and free the CPU
  allocator makes; their running sum over the step gives its peak above the
  start. (RSS deltas would hide reuse inside glibc's arenas; tracemalloc does
  not see torch's allocator at all.)

:func:`saved_activation_bytes` counts the tensors autograd keeps for backward
(the measured counterpart of the paper's feature-map term, Eq. 2).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tunekit.plugins.batch_ps_sizing.model import MemoryProfile
from tunekit.runtime.data import to_device
from tunekit.workload import Workload

_CPU_OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device or host allocation failure (CUDA OOM, or the CPU allocator's)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CPU_OOM_MESSAGES)


def release_memory(device: torch.device) -> None:
    """Give freed blocks back after an out-of-memory, before the next attempt."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class PeakMeter:
    """Context manager: bytes allocated at the peak of the block, above its start.

    ``peak_bytes`` is None when the device offers no way to measure (another
    profiler already running on the CPU); ``method`` says which was used.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes: float | None = None
        self.start_bytes = 0.0
        """Bytes allocated when the block began (CUDA; 0 on the CPU, where it is not tracked)."""
        self.method = ""
        self._prof = None
        self._start = 0

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            self.start_bytes = float(self._start)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "cuda-allocator"
        else:
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            try:
                prof.__enter__()
            except RuntimeError:  # a profiler is already running in this thread
                return self
            self._prof = prof
            self.method = "cpu-profiler"
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = float(torch.cuda.max_memory_allocated(self.device) - self._start)
            return
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        if exc_type is None:
            self.peak_bytes = _profiled_cpu_peak(self._prof)
        self._prof = None


def _profiled_cpu_peak(prof) -> float | None:
    """Running sum of the CPU allocator's alloc (+) and free (-) records, at its maximum."""
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # a torch whose profiler keeps its results elsewhere
        return None
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    running = peak = 0
    for _, nbytes in records:
        running += nbytes
        peak = max(peak, running)
    return float(peak)


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


PARTS_TIMED = ("data", "compute", "optimizer")
"""What a timed step is split into: making the batch, forward+loss+backward, optimizer step."""


@dataclass
class StepTiming:
    """Training steps timed part by part at several per-rank batches, in this process."""

    threads: int
    """Intra-op threads the steps ran with (a trial rank's share of the cores)."""
    samples: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    """Per batch, one ``{part: seconds}`` per timed repeat (parts: :data:`PARTS_TIMED`)."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Batches not timed, and why (the time budget)."""

    def part_samples(self, part: str) -> dict[int, list[float]]:
        return {b: [r[part] for r in rows] for b, rows in self.samples.items()}

    def step_s(self) -> dict[int, float]:
        """Median whole step per batch."""
        return {b: statistics.median(sum(r.values()) for r in rows) for b, rows in self.samples.items()}

    def to_dict(self) -> dict:
        return {
            "threads": self.threads,
            "samples": {str(b): rows for b, rows in self.samples.items()},
            "skipped": {str(b): why for b, why in self.skipped.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> StepTiming:
        return cls(
            int(d["threads"]),
            {int(b): [dict(r) for r in rows] for b, rows in d["samples"].items()},
            {int(b): str(why) for b, why in d.get("skipped", {}).items()},
        )


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
    with _threads(threads):
        model = workload.model().to(device)
        optimizer = workload.optimizer(model.parameters(), workload.lr)

        def step(b: int, meter: PeakMeter | None = None) -> StepMemory:
            if meter is None:
                inputs, targets = workload.example_batch(b)
                _train(model, optimizer, workload, to_device(inputs, device), to_device(targets, device))
                return StepMemory(b, None, 0)
            with meter:  # the batch counts: a real step holds its input too
                inputs, targets = workload.example_batch(b)
                run = functools.partial(
                    _train, model, optimizer, workload, to_device(inputs, device), to_device(targets, device)
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


def time_steps(
    workload: Workload,
    batches: tuple[int, ...],
    device: torch.device | None = None,
    *,
    repeats: int = 3,
    budget_s: float = math.inf,
    required: tuple[int, ...] = (),
    max_repeats: int | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> StepTiming:
    """Time real training steps part by part at each batch, ascending, within ``budget_s``.

    The step is the job's: make the batch, forward, loss, backward, optimizer
    step, gradients set to None. A first pass runs one warm-up step per batch,
    ascending (not counted); a batch whose warm-up and repeats would overrun the
    budget (its time guessed from the last kept batch's time per sample) is
    skipped, unless it is ``required``; a batch that runs out of memory ends
    the climb. Then ``repeats`` rounds time every
    kept batch in turn, so that a change in the machine's load over the
    measurement touches every batch alike and the medians' ratios hold; more
    rounds follow, up to ``max_repeats``, while the budget lasts (on a busy
    machine a median of three is noisy).
    """
    device = device or torch.device("cpu")
    if model is None:
        model = workload.model().to(device)
    if optimizer is None:
        optimizer = workload.optimizer(model.parameters(), workload.lr)
    timing = StepTiming(torch.get_num_threads())
    start = time.perf_counter()
    kept: list[tuple[int, float]] = []
    ascending = sorted(set(batches))
    for i, b in enumerate(ascending):
        if kept and b not in required:
            last_b, last_s = kept[-1]
            guess = last_s * b / last_b
            ahead = repeats * (sum(s for _, s in kept) + guess) + guess
            if time.perf_counter() - start + ahead > budget_s:
                timing.skipped[b] = (
                    f"~{guess:.1f} s per step here, over the {budget_s:.0f} s measuring budget"
                )
                continue
        try:
            kept.append((b, sum(_timed_step(model, optimizer, workload, b, device, 0).values())))
        except Exception as exc:
            if not is_out_of_memory(exc) or not kept:
                raise
            optimizer.zero_grad(set_to_none=True)
            release_memory(device)
            for larger in ascending[i:]:  # a larger batch would not fit either
                timing.skipped[larger] = f"out of memory here (from batch {b})"
            break
    rounds, most = 0, max(repeats, max_repeats or repeats)
    while rounds < most:
        round_start = time.perf_counter()
        for b, _ in kept:
            parts = _timed_step(model, optimizer, workload, b, device, rounds + 1)
            timing.samples.setdefault(b, []).append(parts)
        rounds += 1
        now = time.perf_counter()
        if rounds >= repeats and now - start + (now - round_start) > budget_s:
            break
    return timing


def _timed_step(model, optimizer, workload: Workload, batch: int, device, seed: int) -> dict[str, float]:
    """One training step, the seconds of each of :data:`PARTS_TIMED`."""
    _sync(device)
    t0 = time.perf_counter()
    inputs, targets = workload.example_batch(batch, seed=seed)
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    _sync(device)
    t1 = time.perf_counter()
    loss = workload.loss(model(inputs), targets)
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    t3 = time.perf_counter()
    return {"data": t1 - t0, "compute": t2 - t1, "optimizer": t3 - t2}


@contextlib.contextmanager
def _threads(threads: int | None):
    """Run the block with ``threads`` intra-op threads (a trial rank's share), then restore."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(model, optimizer, workload: Workload, inputs, targets) -> torch.Tensor:
    loss = workload.loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


