"""Timing the job's step in this process at the micro-batches a split would run.

A split of a step's samples into micro-batches runs more, smaller passes. What one pass
costs whatever its size (launches, Python, the loss) and what each sample costs are the
intercept and the slope of the step's compute time against the micro-batch, timed here on
a fresh copy of the model (one process, no collectives) with a trial rank's threads, the
micro-batches interleaved (``tunekit.api.time_steps``). The optimizer part of the same
steps is the unsharded optimizer's time.

FSDP costs compute too, beside its collectives: each unit's shards are copied into the
all-gather's buffer and out of it into parameters, gradients into the reduce-scatter's,
and every hook and DTensor adds Python. That is timed here as well: the job's step on a
one-rank process group (``single_rank_group``), sharded with and without resharding after
forward, against the plain model, in alternating rounds (:func:`fsdp_overhead`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass

import torch

from tunekit.api import (
    Layout,
    Observation,
    Session,
    effort_repeats,
    effort_seconds,
    intra_op_threads,
    single_rank_group,
    time_steps,
)

BUDGET_S = 20.0
"""Seconds the timing may take (the first micro-batches are always timed)."""


@dataclass(frozen=True)
class PassLine:
    """``compute(micro_batch) = per_pass_s + per_sample_s * micro_batch`` on one process,
    and the medians it was fitted through (a split into a timed micro-batch uses its own)."""

    per_pass_s: float
    per_sample_s: float
    optimizer_s: float
    batches: tuple[int, ...]
    """The micro-batches timed."""
    threads: int
    measured: tuple[tuple[int, float], ...] = ()
    """``(micro_batch, seconds)``: forward and backward of one pass, as timed."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PassLine:
        return cls(
            float(d["per_pass_s"]),
            float(d["per_sample_s"]),
            float(d["optimizer_s"]),
            tuple(int(b) for b in d["batches"]),
            int(d["threads"]),
            tuple((int(b), float(t)) for b, t in d.get("measured", ())),
        )


def micro_batch_sizes(samples: int, most: int = 8) -> tuple[int, ...]:
    """Sizes of the micro-batches splits of ``samples`` into 1, 2, 4 ... ``most`` run."""
    return tuple(sorted({samples // m for m in split_counts(samples, most)}))


def split_counts(samples: int, most: int = 8) -> list[int]:
    """Micro-batch counts that divide ``samples``: 1, 2, 4 ... up to ``most``."""
    out, m = [], 1
    while m <= most and m <= samples:
        if samples % m == 0:
            out.append(m)
        m *= 2
    return out


def rank_threads(obs: Observation) -> int:
    """Intra-op threads a trial rank gets: the machine's cores over the ranks."""
    here = os.cpu_count() or 1
    return max(1, min(int(obs.hardware.host.cores), here) // max(1, obs.nproc))


def pass_line(obs: Observation, samples: int) -> PassLine | None:
    """The job's pass line (cached in the study), or None when fewer than one micro-batch
    could be timed (the model's own step fails here)."""
    sizes = micro_batch_sizes(samples)
    device = torch.device("cuda" if obs.device_type == "cuda" else "cpu")
    threads = rank_threads(obs)
    key = pass_line_key(obs, samples)

    def measure() -> dict:
        with intra_op_threads(threads):
            timing = time_steps(
                obs.workload,
                sizes,
                device,
                repeats=effort_repeats(3, 2),
                max_repeats=effort_repeats(5, 3),
                budget_s=effort_seconds(BUDGET_S),
                required=sizes[:2],
            )
        compute = {b: statistics.median(v) for b, v in timing.part_samples("compute").items()}
        optimizer = [t for v in timing.part_samples("optimizer").values() for t in v]
        if not compute:
            return {}
        return fit_line(compute, statistics.median(optimizer), threads).to_dict()

    found = obs.cached(key, measure)
    return PassLine.from_dict(found) if found else None


def pass_line_key(obs: Observation, samples: int) -> str:
    """Where the study keeps the pass line of ``obs``'s job split from ``samples``."""
    return (
        f"sharding:passes:v2:{obs.workload_spec}:{obs.device_type}:"
        f"{micro_batch_sizes(samples)}:{rank_threads(obs)}t"
    )


def fit_line(compute: dict[int, float], optimizer_s: float, threads: int) -> PassLine:
    """Least squares through ``{micro_batch: seconds}``; the intercept is at least 0 and the
    slope positive (one point: a line through the origin)."""
    xs = sorted(compute)
    measured = tuple((x, compute[x]) for x in xs)
    if len(xs) == 1:
        return PassLine(0.0, compute[xs[0]] / xs[0], optimizer_s, tuple(xs), threads, measured)
    mx = statistics.fmean(xs)
    my = statistics.fmean(compute[x] for x in xs)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (compute[x] - my) for x in xs) / sxx
    intercept = my - slope * mx
    if slope <= 0 or intercept < 0:  # noise: the largest batch's time per sample, no fixed cost
        top = xs[-1]
        slope, intercept = compute[top] / top, 0.0
    return PassLine(intercept, slope, optimizer_s, tuple(xs), threads, measured)


FSDP_ROUNDS = 3
FSDP_STEPS = 3


def fsdp_overhead(obs: Observation) -> dict[str, float]:
    """Seconds FSDP adds to one forward/backward pass of the job's batch on a rank, beside its
    collectives: ``{"reshard": ..., "keep": ...}`` (resharded after forward or not), timed
    on one rank (module docstring) and cached in the study."""
    key = fsdp_overhead_key(obs)

    def measure() -> dict[str, float]:
        layouts = {
            "plain": Layout(),
            "reshard": Layout(sharding="fsdp", reshard_after_forward=True),
            "keep": Layout(sharding="fsdp", reshard_after_forward=False),
        }
        device = torch.device("cuda" if obs.device_type == "cuda" else "cpu")
        times: dict[str, list[float]] = {k: [] for k in layouts}
        with intra_op_threads(rank_threads(obs)), single_rank_group():
            for _ in range(effort_repeats(FSDP_ROUNDS, 1)):  # alternating: load touches all alike
                for name, layout in layouts.items():
                    session = Session(
                        obs.workload, rank=0, world_size=1, device=device, layout=layout
                    )
                    try:
                        session.train_step()  # warm-up: optimizer state, allocator
                        steps = effort_repeats(FSDP_STEPS, 2)
                        times[name] += [session.train_step().step_s for _ in range(steps)]
                    finally:
                        session.close()
        # The fastest step of each: neighbours only ever add time, and a difference of two
        # noisy medians is mostly their noise.
        plain = min(times["plain"])
        passes = max(1, obs.workload.accumulation)
        return {k: max(0.0, min(times[k]) - plain) / passes for k in ("reshard", "keep")}

    return obs.cached(key, measure)


def fsdp_overhead_key(obs: Observation) -> str:
    return f"sharding:fsdp-overhead:v2:{obs.workload_spec}:{obs.device_type}:{rank_threads(obs)}t"
