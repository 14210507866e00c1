"""cgdp's model calibrated on the measured baseline: reproduce DDP's step, then predict CGDP.

The paper's model (``model.py``) compares CGDP with a baseline from per-layer
costs measured in isolation. On a real job those costs are off by a factor
(a layer timed alone runs 2-3x faster than beside a busy neighbour rank; a
gloo all-reduce during backward runs 5-20x slower than in a quiet probe), so
this module first makes the model reproduce the measured DDP baseline of this
job on this machine (``obs.truth``), and then predicts each CGDP candidate as
a change to it (:class:`tunekit.costmodel.Calibration`):

1. **Backward.** The measured compute times backward's share of forward +
   backward (measured with the layers) is the baseline's backward; each
   layer's ``t_bp`` is its measured share of it. The factor between this and
   the layers' own sum is the *contention* factor, which the host work CGDP
   adds to the backward thread is scaled by too.
2. **All-reduce during backward**: fitted to the baseline trace's own DDP
   all-reduces before its last bucket (each bucket's time from the rank
   that posted it last, so a rank waiting for its peer does not count),
   ``latency + bytes / bandwidth``; with one bucket, the probe's bandwidth
   slowed as the kernels are and the rest as latency.
3. **All-reduce after backward**: the probe's bandwidth (the cores are free
   of backward by then) and a latency fitted so that DDP's modelled exposed
   communication is the measured one less the part that is one rank waiting
   for the other (which no reduction scheme hides: it is carried over to
   every candidate).
4. **CGDP's own costs**, measured here: the hook and Python work per chunk
   on the backward thread (scaled by the contention factor), the copy back
   after each chunk's all-reduce, and the offload optimizer's host step
   against the device step (scaled as the measured optimizer part).

Every candidate is then run through the same timeline as DDP
(:func:`~tunekit.plugins.cgdp.model.cgdp_timeline`), and its parts (compute,
exposed communication, optimizer) go through the calibration.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tunekit.api import Breakdown, Calibration, StepTruth
from tunekit.plugins.cgdp.model import (
    AllReduceCost,
    ReduceCosts,
    Timeline,
    cgdp_timeline,
    ddp_buckets,
    ddp_timeline,
    fit_after_latency,
)
from tunekit.plugins.cgdp.search import Layout

# -- the baseline trace's all-reduces ----------------------------------------------------------


@dataclass(frozen=True)
class BucketTimes:
    """DDP's all-reduces in the baseline trace, one list of per-step durations per bucket."""

    durations: list[list[float]]
    """Per bucket (backward order), per profiled step: the shortest rank's time."""
    note: str = ""

    def median(self, i: int) -> float:
        return statistics.median(self.durations[i])

    def quantile(self, i: int, q: float) -> float:
        xs = sorted(self.durations[i])
        return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def bucket_times(breakdown: Breakdown | None, buckets: int) -> BucketTimes | None:
    """Per-bucket all-reduce durations of the profiled baseline steps, or None.

    Each step's all-reduces are matched to the model's buckets in order when
    their counts agree. Of the ranks' times for one bucket in one step the
    shortest is kept: the rank that posted first also waited for its peer.
    """
    if breakdown is None or buckets < 1:
        return None
    by_step: dict[int, list[list[float]]] = {}
    for rank in breakdown.ranks:
        for step in rank.steps:
            ars = [c.own_s for c in step.collectives if "all_reduce" in c.name]
            if len(ars) == buckets:
                by_step.setdefault(step.step, []).append(ars)
    if not by_step:
        return None
    durations = [[min(r[i] for r in ranks) for ranks in by_step.values()] for i in range(buckets)]
    return BucketTimes(durations, f"{len(by_step)} profiled step(s)")


def waiting_share(breakdown: Breakdown | None) -> float:
    """Share of the step that the exposed communication owes to one rank waiting for the other.

    The measured exposed communication is a mean over ranks. In each profiled
    step the busiest rank (the most time outside communication) sets the pace;
    a faster rank's extra exposed time is spent waiting for it, whatever the
    gradient reduction, so CGDP cannot hide it. Returns the median over steps
    of (mean exposed - the busiest rank's exposed) / the mean step, 0 without
    a breakdown of two or more ranks.
    """
    ranks = breakdown.ranks if breakdown is not None else []
    if len(ranks) < 2:
        return 0.0
    steps: dict[int, list[Any]] = {}
    for rank in ranks:
        for st in rank.steps:
            steps.setdefault(st.step, []).append(st)
    shares = []
    for same in steps.values():
        if len(same) < 2:
            continue
        busiest = max(same, key=lambda st: st.total_s - st.comm_exposed_s)
        mean_exposed = statistics.fmean(st.comm_exposed_s for st in same)
        mean_total = statistics.fmean(st.total_s for st in same)
        if mean_total > 0:
            shares.append(max(0.0, mean_exposed - busiest.comm_exposed_s) / mean_total)
    return statistics.median(shares) if shares else 0.0


def fit_cost(points: Sequence[tuple[float, float]], floor: AllReduceCost) -> AllReduceCost | None:
    """``latency + bytes / bandwidth`` through ``points`` (bytes, seconds) by least squares;
    None with fewer than two sizes or when the times do not grow with the size.

    The latency is at least ``floor``'s (a loaded machine is not faster than a quiet one).
    """
    if len({round(b) for b, _ in points}) < 2:
        return None
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    slope = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)
    if slope <= 0:
        return None
    latency = mt - slope * mb
    if latency < floor.latency:  # refit the slope through the floor's latency
        latency = floor.latency
        slope = sum((t - latency) * b for b, t in points) / sum(b * b for b, _ in points)
        if slope <= 0:
            return None
    return AllReduceCost(latency, 1.0 / slope)


# -- inputs and the calibrated model -----------------------------------------------------------


@dataclass(frozen=True)
class HostWork:
    """CGDP's own costs on this machine, measured in isolation (seconds)."""

    post_s: float
    """Hook and Python work on the backward thread per chunk (posting it)."""
    copy_s_per_byte: float
    """Host copy time per byte (a chunk's averaged gradient back into ``.grad``)."""
    optimizer_s: float | None = None
    """The job's optimizer step as the job runs it, timed here."""
    offload_optimizer_s: float | None = None
    """The same step under ``offload_optimizer`` (host masters, host state, copy back)."""
    chunk_costs: ReduceCosts | None = None
    """The host path's own reduction when it is not DDP's (a GPU's copies to the host
    and a gloo all-reduce there, beside NCCL); None: the same all-reduce as DDP's, as
    on CPU ranks, and so calibrated with it."""


@dataclass
class CalibratedCgdp:
    """The model fitted to the measured baseline; :meth:`predict` gives a candidate's step."""

    truth: StepTruth
    t_bp: list[float]
    nbytes: list[float]
    forward_s: float
    costs: ReduceCosts
    host: HostWork
    contention: float
    """Measured backward over the layers' own backward: how much slower the job's
    kernels run than the same layers timed here (CGDP's host work is scaled by it)."""
    calibration: Calibration
    waiting_s: float = 0.0
    """Exposed communication that is one rank waiting for the other (measured; carried over:
    no reduction scheme hides it)."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """How each input was calibrated (factors, sources), for reports."""

    def ddp(self) -> Timeline:
        return ddp_timeline(self.t_bp, self.nbytes, self.costs)

    def cgdp(self, k: int | Layout) -> Timeline:
        return cgdp_timeline(
            self.t_bp, self.nbytes, k, self.host.chunk_costs or self.costs,
            post_s=self.host.post_s * self.contention,
            copy_back_s_per_byte=self.host.copy_s_per_byte * self.contention,
        )  # fmt: skip

    @property
    def ddp_copy_back_s(self) -> float:
        """DDP's copy of its reduced buckets back into the gradients, on CPU ranks: part of
        the measured compute (the backward thread does it), which CGDP does not do there."""
        if self.host.chunk_costs is not None:
            return 0.0
        return sum(self.nbytes) * self.host.copy_s_per_byte * self.contention

    def optimizer_s(self, offload: bool) -> float:
        """The model's optimizer step (seconds): the device step as timed here, or offload's."""
        if offload and self.host.offload_optimizer_s is not None:
            return self.host.offload_optimizer_s
        return self.host.optimizer_s or 0.0

    def ddp_parts(self) -> dict[str, float]:
        t = self.ddp()
        return {
            "compute": self.forward_s + t.backward_s,
            "comm_exposed": t.exposed_s + self.waiting_s,
            "optimizer": self.optimizer_s(False),
        }

    def cgdp_parts(self, k: int | Layout, offload: bool = False) -> dict[str, float]:
        t = self.cgdp(k)
        return {
            "compute": self.forward_s + t.backward_s - self.ddp_copy_back_s,
            "comm_exposed": t.exposed_s + self.waiting_s,
            "optimizer": self.optimizer_s(offload),
        }

    def predict(self, k: int | Layout, offload: bool = False) -> float:
        """Step time of CGDP with chunks of ``k`` layers, or a layout (and offload), from the
        measured baseline."""
        return self.calibration.predict(self.cgdp_parts(k, offload))

    def reproduces_baseline(self) -> float:
        """The calibrated model's DDP step: the measured step, by construction."""
        return self.calibration.predict(self.ddp_parts())


def backward_of_truth(
    truth: StepTruth, share: float | None, layers_backward: float
) -> tuple[float, str]:
    """The baseline's backward (seconds) and where the figure comes from."""
    compute = truth.part("compute") if truth.profiled else None
    if compute and share:
        return compute * share, (
            f"measured compute {compute * 1e3:.1f} ms x backward's measured share {share:.0%}"
        )
    return layers_backward, "the layers' own backward (the baseline's compute was not profiled)"


def calibrate(
    truth: StepTruth,
    t_bp: Sequence[float],
    nbytes: Sequence[float],
    backward_share: float | None,
    probe: AllReduceCost,
    host: HostWork,
    breakdown: Any = None,
    during_end: str | None = None,
) -> CalibratedCgdp:
    """Fit the model to ``truth`` (see the module docstring).

    ``t_bp`` per layer in backward order (only the shares matter), ``probe``
    the quiet machine's all-reduce, ``breakdown`` the baseline's profiled
    steps; ``during_end`` ("slow", "fast" or None) takes the quartile of the
    trace's bucket times instead of the median, for ranges.
    """
    raw_backward = sum(t_bp)
    backward, backward_source = backward_of_truth(truth, backward_share, raw_backward)
    n = len(t_bp)
    shares = [t / raw_backward for t in t_bp] if raw_backward > 0 else [1 / n] * n
    scaled = [x * backward for x in shares]
    contention = backward / raw_backward if raw_backward > 0 else 1.0
    compute = truth.part("compute") if truth.profiled else None
    forward = compute - backward if compute is not None else backward / 2
    inputs: dict[str, Any] = {
        "backward_s": backward,
        "backward_source": backward_source,
        "layers_backward_s": raw_backward,
        "contention": contention,
        "probe": {"latency_s": probe.latency, "bandwidth": probe.bandwidth},
    }
    during, during_source = _during_cost(breakdown, nbytes, probe, contention, during_end)
    inputs["during"] = {
        "latency_s": during.latency, "bandwidth": during.bandwidth, "source": during_source,
    }  # fmt: skip
    exposed = truth.part("comm_exposed") if truth.profiled else None
    waiting = min(waiting_share(breakdown) * truth.step_s, exposed) if exposed else 0.0
    after, inputs["after_source"] = _after_cost(scaled, nbytes, during, probe, exposed, waiting)
    inputs["after"] = {"latency_s": after.latency, "bandwidth": after.bandwidth}
    inputs["waiting_s"] = waiting
    model = CalibratedCgdp(
        truth, scaled, list(nbytes), forward, ReduceCosts(during, after), host, contention,
        Calibration(truth, {}, {}), waiting, inputs,
    )  # fmt: skip
    model.calibration = Calibration.fit(truth, model.ddp_parts())
    return model


def _after_cost(
    t_bp: Sequence[float],
    nbytes: Sequence[float],
    during: AllReduceCost,
    probe: AllReduceCost,
    exposed: float | None,
    waiting: float,
) -> tuple[AllReduceCost, str]:
    """The all-reduce cost once backward is done, and where it comes from.

    Its bandwidth is the quiet probe's (the ranks' cores are free of backward
    by then; DDP's last 8 MiB bucket took 12-30 ms after backward on the loaded
    development machine, the probe says 24 ms), or the one during backward if
    that is higher; its latency is fitted so that DDP's modelled exposed
    communication is the measured one less the waiting for the other rank (on
    a loaded machine what a small message costs is mostly waiting to be scheduled).
    """
    bandwidth = max(probe.bandwidth, during.bandwidth)
    if exposed is None:
        return AllReduceCost(probe.latency, bandwidth), (
            "the probe's fit (no measured exposed communication to fit it to)"
        )
    target = max(0.0, exposed - waiting)
    latency = fit_after_latency(t_bp, nbytes, during, bandwidth, target)
    if latency is None:
        return AllReduceCost(0.0, bandwidth), (
            "the probe's bandwidth and no latency: DDP's reductions leave more exposed "
            "than was measured even so"
        )
    return AllReduceCost(latency, bandwidth), (
        f"the probe's bandwidth, latency fitted so that DDP's modelled exposed communication "
        f"is the measured {target * 1e3:.1f} ms (and {waiting * 1e3:.1f} ms of waiting for "
        "the other rank)"
    )


def _during_cost(
    breakdown: Any,
    nbytes: Sequence[float],
    probe: AllReduceCost,
    contention: float,
    end: str | None,
) -> tuple[AllReduceCost, str]:
    """The all-reduce cost while backward runs beside it, and where it comes from.

    From DDP's own all-reduces before its last bucket in the baseline trace:
    with two sizes or more, a least-squares fit; with one, the probe's
    bandwidth slowed as the job's kernels are and the rest of the time as
    latency (under load latency grows far more than bandwidth falls: 1 MiB
    took 60-80 ms where the quiet probe says 4 ms). Without any, the probe's
    fit slowed as the kernels are.
    """
    buckets = ddp_buckets(nbytes)
    times = bucket_times(breakdown, len(buckets))
    slowed = probe.scaled(max(1.0, contention))  # the job's machine is not quieter than the probe's
    if times is not None and len(buckets) >= 2:
        quantile = {None: 0.5, "fast": 0.25, "slow": 0.75}[end]
        points = [(size, times.quantile(i, quantile)) for i, (_, size) in enumerate(buckets[:-1])]
        source = f"DDP's {len(points)} all-reduce(s) during backward in the baseline trace ({times.note})"
        fitted = fit_cost(points, slowed)
        if fitted is not None:
            return fitted, source
        size = sum(b for b, _ in points) / len(points)
        seconds = sum(t for _, t in points) / len(points)
        latency = max(slowed.latency, seconds - size / slowed.bandwidth)
        return AllReduceCost(latency, slowed.bandwidth), source
    if breakdown is None:
        return slowed, f"probe fit x{max(1.0, contention):.2g} (no baseline trace)"
    return slowed, (
        f"probe fit x{max(1.0, contention):.2g} (slowed as the job's kernels are; the baseline "
        "trace shows no all-reduce during backward to fit it to)"
    )
