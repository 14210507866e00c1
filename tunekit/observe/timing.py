"""Robust timing primitives shared by the probe and the tuners that measure links and host rates.

A figure measured on a shared machine is not a number but a distribution:
another process takes the core for a time slice, a neighbour evicts the cache,
a copy lands in L3 one run and in DRAM the next. Every measurement here is
therefore

* **warmed up**: ``warmup`` untimed rounds first (allocation, page faults,
  gloo's connection set-up, cache state);
* **repeated and interleaved**: each round times every message size once, so
  a burst of load in the middle of the measurement hits all sizes alike instead
  of one size's whole sample;
* **summarised by the median with a 95 % bootstrap interval of the median**
  (:func:`median_interval`), and a sweep over sizes is fitted to
  ``t = latency + bytes / bandwidth`` on the per-size medians, its 95 %
  intervals from refitting on bootstrap resamples (:func:`fit_samples`).

Why the bootstrap interval of the median and not the interquartile range:
decisions compare the *estimate* (this link's bandwidth) with a threshold, so
they need the uncertainty of the estimate, not the spread of single samples;
the bootstrap carries that uncertainty through the latency/bandwidth fit,
which an IQR of raw samples cannot; and it is the same kind of interval the
trials' decisions use (:mod:`tunekit.trials.stats`). The median makes the
point estimate robust: one sample 50× slower than the rest moves it by at most
one rank of the sorted sample. Percentile intervals (not BCa) because medians
of small samples have a discrete bootstrap distribution that BCa's
acceleration estimate handles badly.

The timed operations themselves, run on every rank of a process group:
:func:`ping_pong` (one-way time between ranks 0 and 1, half a round trip),
:func:`allreduce_timings` (per repeat the slowest rank's time) and, in one
process, :func:`copy_timings` (host<->device copies on a GPU, a one-thread
host memory copy on a CPU) and :func:`timed_rounds` for anything else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from tunekit.hardware import CollectiveFit

CONFIDENCE = 0.95
"""Confidence level of every interval here."""
RESAMPLES = 1000
"""Bootstrap resamples per interval (percentile ends at 2.5 % and 97.5 % are stable at this count)."""
WARMUP = 2
"""Untimed rounds before the timed ones."""
SEED = 0
"""Bootstrap seed: the same samples always give the same interval."""

K = TypeVar("K")


# -- summaries ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A measured figure: ``value`` (the median or fitted value) and its 95 % interval."""

    value: float
    low: float
    high: float

    def straddles(self, threshold: float) -> bool:
        """Whether the decision ``figure > threshold`` goes both ways within the interval.

        True when some of the interval is above ``threshold`` and some is not:
        the measurement cannot tell which side the figure is on. An interval
        entirely above (``low > threshold``) or at or below it
        (``high <= threshold``) decides.
        """
        return self.low <= threshold < self.high

    def inverse(self, numerator: float = 1.0) -> Estimate:
        """``numerator / x``: a time's estimate as a rate (its ends swap)."""
        return Estimate(numerator / self.value, numerator / self.high, numerator / self.low)

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}

    @classmethod
    def from_dict(cls, d: Mapping[str, float]) -> Estimate:
        return cls(float(d["value"]), float(d["low"]), float(d["high"]))

    @classmethod
    def exact(cls, value: float) -> Estimate:
        """A figure known without measurement noise (a profile's number): both ends are the value."""
        return cls(value, value, value)


def median_interval(
    samples: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES
) -> Estimate:
    """The median of ``samples`` with a percentile-bootstrap interval of the median."""
    from scipy.stats import bootstrap  # here: scipy costs every command a third of a second

    x = np.asarray(samples, dtype=float)
    if x.size == 0:
        raise ValueError("a median needs at least one sample")
    med = float(np.median(x))
    if x.size == 1 or np.ptp(x) == 0:
        return Estimate(med, med, med)
    res = bootstrap(
        (x,),
        np.median,
        confidence_level=confidence,
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(SEED),
    )
    ci = res.confidence_interval
    return Estimate(med, min(float(ci.low), med), max(float(ci.high), med))


def bandwidth_estimate(fit: CollectiveFit) -> Estimate:
    """A fit's bandwidth with its interval (both ends the value when the fit has none)."""
    low, high = fit.bandwidth_bounds()
    return Estimate(fit.bandwidth, low, high)


# -- fits --------------------------------------------------------------------------------------


def _fit_line(x: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """(latency, bandwidth, residual) of ``t = latency + x / bandwidth`` on relative error."""
    from scipy.optimize import nnls  # here: scipy costs every command a third of a second

    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (lat, inv_bw), _ = nnls(a, np.ones_like(t))
    pred = lat + inv_bw * x
    residual = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    # A sweep too noisy to show any slope still needs a finite bandwidth: take
    # the largest message's effective rate.
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float(x[-1] / t[-1])
    return float(lat), float(bandwidth), residual


def fit_latency_bandwidth(
    points: Sequence[tuple[float, float]], backend: str, op: str, world_size: int
) -> CollectiveFit:
    """Least-squares fit of ``t = latency + bytes / bandwidth`` to ``(bytes, seconds)`` points.

    Each point is weighted by ``1/t`` (relative error: small and large
    messages count alike) and the coefficients are non-negative
    (``scipy.optimize.nnls``). ``residual`` is the RMS relative error. No
    interval: for repeated samples use :func:`fit_samples`.
    """
    if len(points) < 2:
        raise ValueError("a fit needs at least two message sizes")
    pts = sorted(points)
    x = np.array([p[0] for p in pts], dtype=float)
    t = np.array([p[1] for p in pts], dtype=float)
    if np.any(t <= 0):
        raise ValueError("measured times must be positive")
    lat, bw, residual = _fit_line(x, t)
    return CollectiveFit(backend, op, world_size, lat, bw, residual)


def fit_samples(
    samples: Mapping[int, Sequence[float]],
    backend: str,
    op: str,
    world_size: int,
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
) -> CollectiveFit:
    """Fit repeated timings per message size: the line through the medians, with 95 % intervals.

    The point fit is :func:`fit_latency_bandwidth` on the per-size medians.
    The intervals are percentile-bootstrap intervals: every size's samples are
    resampled, the medians refitted, and the latency and bandwidth of the
    refits ranked. With a single sample at some size there is nothing to
    resample and the fit has no interval.
    """
    from scipy.stats import bootstrap  # here: scipy costs every command a third of a second

    sizes = sorted(samples)
    data = [np.asarray(samples[n], dtype=float) for n in sizes]
    if any(d.size == 0 for d in data):
        raise ValueError("every message size needs at least one timing")
    medians = [(n, float(np.median(d))) for n, d in zip(sizes, data, strict=True)]
    fit = fit_latency_bandwidth(medians, backend, op, world_size)
    if min(d.size for d in data) < 2:
        return fit
    x = np.array(sizes, dtype=float)

    def refit(*resampled: np.ndarray) -> np.ndarray:
        lat, bw, _ = _fit_line(x, np.array([np.median(r) for r in resampled]))
        return np.array([lat, bw])

    res = bootstrap(
        data,
        refit,
        vectorized=False,
        confidence_level=confidence,
        n_resamples=resamples,
        method="percentile",
        rng=np.random.default_rng(SEED),
    )
    (lat_lo, bw_lo), (lat_hi, bw_hi) = res.confidence_interval.low, res.confidence_interval.high
    # Percentile ends of a discrete distribution can miss the point fit by a hair; keep it inside.
    return CollectiveFit(
        backend,
        op,
        world_size,
        fit.latency,
        fit.bandwidth,
        fit.residual,
        latency_interval=(min(float(lat_lo), fit.latency), max(float(lat_hi), fit.latency)),
        bandwidth_interval=(min(float(bw_lo), fit.bandwidth), max(float(bw_hi), fit.bandwidth)),
    )


# -- timing ------------------------------------------------------------------------------------


def timed_rounds(
    actions: Mapping[K, Callable[[], object]],
    repeats: int,
    warmup: int = WARMUP,
    *,
    before: Callable[[], object] | None = None,
    after: Callable[[], object] | None = None,
) -> dict[K, list[float]]:
    """Seconds of each action over ``repeats`` rounds after ``warmup`` untimed ones.

    A round runs every action once, in order (interleaved: see the module
    docstring). ``before`` runs untimed ahead of each action (a barrier, a
    device sync); ``after`` runs inside the timed span (a device sync: the
    action is done when the device is).
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    out: dict[K, list[float]] = {k: [] for k in actions}
    for r in range(warmup + repeats):
        for key, action in actions.items():
            if before is not None:
                before()
            start = time.perf_counter()
            action()
            if after is not None:
                after()
            if r >= warmup:
                out[key].append(time.perf_counter() - start)
    return out


def _syncer(device: torch.device) -> Callable[[], None] | None:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def _buffers(sizes: Sequence[int], device: torch.device) -> dict[int, torch.Tensor]:
    return {n: torch.ones(max(1, n // 4), dtype=torch.float32, device=device) for n in sizes}


def _barrier_then(
    sync: Callable[[], None] | None, control: dist.ProcessGroup | None
) -> Callable[[], None]:
    def before() -> None:
        dist.barrier(group=control)
        if sync is not None:
            sync()

    return before


def ping_pong(
    rank: int,
    sizes: Sequence[int],
    repeats: int,
    warmup: int = WARMUP,
    *,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    control: dist.ProcessGroup | None = None,
) -> dict[int, list[float]]:
    """One-way seconds between ranks 0 and 1 per message size: half of rank 0's round trips.

    Call on every rank (others only join the barriers). The round trip is
    timed where it starts and ends, on rank 0; its samples are broadcast, so
    every rank returns the same. ``group`` carries the messages (an NCCL
    group on GPUs); the barriers and the broadcast of host tensors go through
    ``control`` (a gloo group; by default the default group).
    """
    device = torch.device(device)
    sync = _syncer(device)
    bufs = _buffers(sizes, device)

    def round_trip(buf: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                dist.send(buf, 1, group=group)
                dist.recv(buf, 1, group=group)
            elif rank == 1:
                dist.recv(buf, 0, group=group)
                dist.send(buf, 0, group=group)

        return run

    times = timed_rounds(
        {n: round_trip(b) for n, b in bufs.items()},
        repeats,
        warmup,
        before=_barrier_then(sync, control),
        after=sync,
    )
    table = torch.tensor([times[n] for n in sizes], dtype=torch.float64) / 2
    dist.broadcast(table, 0, group=control)
    return {n: table[i].tolist() for i, n in enumerate(sizes)}


def allreduce_timings(
    sizes: Sequence[int],
    repeats: int,
    warmup: int = WARMUP,
    *,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    control: dist.ProcessGroup | None = None,
) -> dict[int, list[float]]:
    """Seconds of ``all_reduce`` per message size and repeat: the slowest rank's (on every rank).

    A collective ends when its last rank does, so each repeat's time is the
    maximum over ranks. ``group`` runs the all-reduces; barriers and the
    maximum go through ``control``, as in :func:`ping_pong`.
    """
    device = torch.device(device)
    sync = _syncer(device)
    bufs = _buffers(sizes, device)
    # Built apart from the call: against timed_rounds' Callable[[], object] mypy cannot
    # infer a lambda that binds its buffer as a default.
    actions = {n: (lambda b=b: dist.all_reduce(b, group=group)) for n, b in bufs.items()}
    times = timed_rounds(
        actions,
        repeats,
        warmup,
        before=_barrier_then(sync, control),
        after=sync,
    )
    table = torch.tensor([times[n] for n in sizes], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=control)
    return {n: table[i].tolist() for i, n in enumerate(sizes)}


def copy_timings(
    sizes: Sequence[int],
    repeats: int,
    warmup: int = WARMUP,
    *,
    device: torch.device | str = "cpu",
    direction: str = "d2h",
) -> dict[int, list[float]]:
    """Seconds of a host<->device copy per size (``"h2d"`` or ``"d2h"``, pinned host memory).

    On a CPU device both directions are a plain memory copy on one thread: a
    copy split over threads takes as long as its slowest thread, and on a
    busy machine one of them is often descheduled for a whole time slice.
    """
    device = torch.device(device)
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', not {direction!r}")
    if device.type == "cpu":
        pairs = {n: (torch.empty(max(1, n // 4)), torch.ones(max(1, n // 4))) for n in sizes}
        before_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            actions = {n: (lambda d=d, s=s: d.copy_(s)) for n, (d, s) in pairs.items()}
            return timed_rounds(actions, repeats, warmup)
        finally:
            torch.set_num_threads(before_threads)
    sync = _syncer(device)
    actions = {}
    for n, dev in _buffers(sizes, device).items():
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        dst, src = (dev, host) if direction == "h2d" else (host, dev)
        actions[n] = lambda d=dst, s=src: d.copy_(s, non_blocking=True)
    return timed_rounds(actions, repeats, warmup, before=sync, after=sync)


def measure_link(rank: int, world: int, sizes: Sequence[int], repeats: int = 9) -> CollectiveFit:
    """A :func:`tunekit.testing.run_ranks` entry: the gloo link between ranks 0 and 1, fitted.

    Every rank returns the same fit (``op="p2p"``, ``world_size=2``) with its intervals.
    """
    return fit_samples(ping_pong(rank, sizes, repeats), "gloo", "p2p", 2)
