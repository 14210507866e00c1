"""Training steps timed in this process, part by part: the job's own step at a batch, alone.

Tuners that need "how long does this model's step take on one rank of this
machine, with nothing beside it" measure it here: batch_ps_sizing times steps
at several batches for its throughput line; hybrid_mp times the job's batch to
tell the model's own compute from what DDP's overlapped exchange and the other
ranks added to the measured baseline.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from tunekit.runtime.data import to_device
from tunekit.workload import Workload

__all__ = [
    "PARTS_TIMED",
    "StepTiming",
    "intra_op_threads",
    "is_out_of_memory",
    "release_memory",
    "sync_device",
    "time_steps",
]

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
        return {
            b: statistics.median(sum(r.values()) for r in rows) for b, rows in self.samples.items()
        }

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


def _timed_step(
    model, optimizer, workload: Workload, batch: int, device, seed: int
) -> dict[str, float]:
    """One training step, the seconds of each of :data:`PARTS_TIMED`."""
    sync_device(device)
    t0 = time.perf_counter()
    inputs, targets = workload.example_batch(batch, seed=seed)
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    sync_device(device)
    t1 = time.perf_counter()
    loss = workload.loss(model(inputs), targets)
    loss.backward()
    sync_device(device)
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync_device(device)
    t3 = time.perf_counter()
    return {"data": t1 - t0, "compute": t2 - t1, "optimizer": t3 - t2}


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """Run the block with ``threads`` intra-op threads (a trial rank's share; None: as set
    now), then restore."""
    check_threads(threads)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_threads(threads: int | None) -> None:
    """Refuse a thread count below one (None means: leave torch's setting alone)."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, not {threads}")


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
