"""Searches: the rank-coordinated batch sweep with its knee, and the algorithm-choice ILP.

The sweep runs inside every worker (the tuner's ``search`` hook). For each
candidate batch, in ascending order, every rank first *probes* it: forward and
backward of its next batch on the bare model, no collective, no update, so an
out-of-memory error on one rank cannot strand the others inside a gradient
all-reduce. One small all-reduce then tells every rank which ranks failed; if
any did, all of them stop climbing together. Otherwise they train a few real
steps at that batch and agree on the slowest rank's step times. Every input
to the decision is an all-reduced value, so every rank decides the same; rank
0's decision is broadcast anyway.

The ILP is the paper's Eq. 6: one convolution algorithm per layer, least total
time, workspace memory within Eq. 5's bound; solved with ``scipy.optimize.milp``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from tunekit.api import (
    ComputeRate,
    broadcast_object,
    is_out_of_memory,
    release_memory,
    training_flops,
)
from tunekit.errors import ConfigError
from tunekit.plugins.batch_ps_sizing.model import CnnSpec, feature_shapes

if TYPE_CHECKING:
    from tunekit.api import Session
    from tunekit.plugins.batch_ps_sizing.runtime import ProbeResult

DEFAULT_KNEE_TOLERANCE = 0.0
DEFAULT_MIN_GAIN = 0.05


@dataclass(frozen=True)
class SweepSettings:
    """How the in-job sweep spends its steps."""

    knee_tolerance: float = DEFAULT_KNEE_TOLERANCE
    """The chosen batch is the smallest within this fraction of the best throughput seen.
    0 (default) takes the best: the paper's least training time per sample. Above 0 gives
    up that much throughput for a smaller batch (fewer samples per update)."""
    min_gain: float = DEFAULT_MIN_GAIN
    """A larger batch pays when it beats the best before it by this fraction; also the
    plan's bar for a batch worth a trial."""
    recheck_margin: float = 0.25
    """After the climb, a runner-up within this fraction of the best is measured again
    beside the best (budget allowing), and the mean of both measurements decides:
    a few timed steps on shared cores can rank two close batches either way (on 2 shared
    cores, example:cnn's sweep has timed batch 64 below batch 32, which trials measure
    about 20% faster; and once kept batch 256, which trials measure 15% slower than 128)."""
    warmup_steps: int = 1
    """Training steps at a new batch before timing (allocator, cuDNN autotuning)."""
    measure_steps: int = 3
    """Timed training steps per candidate; the median of the slowest rank's times counts."""
    patience: int = 2
    """Stop climbing after this many candidates in a row that did not beat the best by the tolerance."""
    memory_margin: float = 0.1
    """On a GPU, a probe whose peak leaves less than this fraction of device memory free
    counts as out of memory: the real step also holds communication buffers."""
    compare_cudnn_benchmark: bool = True
    """On a GPU, time each batch with ``cudnn.benchmark`` off and on (the measurable
    form of the paper's per-layer algorithm choice)."""
    noise_scale_batches: int = 2
    """Batches whose gradients estimate the gradient noise scale before the sweep (0: skip)."""

    def __post_init__(self) -> None:
        for name in ("knee_tolerance", "min_gain", "recheck_margin"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), not {getattr(self, name)}")
        if self.warmup_steps < 0 or self.measure_steps < 1:
            raise ConfigError("warmup_steps must be >= 0 and measure_steps >= 1")
        if self.patience < 1:
            raise ConfigError(f"patience must be >= 1, not {self.patience}")
        if not 0 <= self.memory_margin < 1:
            raise ConfigError(f"memory_margin must be in [0, 1), not {self.memory_margin}")
        if self.noise_scale_batches < 0:
            raise ConfigError("noise_scale_batches must be >= 0")


# -- pure pieces ------------------------------------------------------------------------


def batch_ladder(current: int, batch_range: tuple[int, int], limit: int | None = None) -> list[int]:
    """Candidate batches: the current one times powers of two inside the range, ascending.

    With ``limit``, keep the current batch and, around it, two steps up for
    every step down (larger batches are where throughput is usually found).
    """
    lo, hi = batch_range
    if not lo <= current <= hi:
        raise ConfigError(f"current batch {current} lies outside the allowed range {batch_range}")
    up, b = [], current * 2
    while b <= hi:
        up.append(b)
        b *= 2
    down, b = [], current // 2
    while b >= lo and b >= 1:
        down.append(b)
        b //= 2
    if limit is None or limit >= 1 + len(up) + len(down):
        return sorted([current, *up, *down])
    chosen = [current]
    while len(chosen) < limit and (up or down):
        for side, n in ((up, 2), (down, 1)):
            for _ in range(n):
                if side and len(chosen) < limit:
                    chosen.append(side.pop(0))
    return sorted(chosen)


def choose_knee(points: Sequence[tuple[int, float]], tolerance: float) -> int:
    """The smallest batch whose throughput is within ``tolerance`` of the best: where more stops paying."""
    if not points:
        raise ConfigError("no measured batch to choose from")
    best = max(t for _, t in points)
    return min(b for b, t in points if t >= (1 - tolerance) * best)


def recheck_pair(points: Sequence[SweepPoint], margin: float) -> list[tuple[int, bool | None]]:
    """The runner-up and the best (batch, variant), in that order, when the runner-up's
    throughput is within ``margin`` of the best's; else nothing to measure again."""
    ranked = sorted(((t, key) for key, t in mean_per_setting(points).items()), reverse=True)
    if len(ranked) < 2 or ranked[1][0] < (1 - margin) * ranked[0][0]:
        return []
    return [ranked[1][1], ranked[0][1]]


def stopped_paying(points: Sequence[tuple[int, float]], tolerance: float, patience: int) -> bool:
    """True when the last ``patience`` points (ascending batch) each failed to beat the best before them."""
    if len(points) <= patience:
        return False
    for i in range(len(points) - patience, len(points)):
        best_before = max(t for _, t in points[:i])
        if points[i][1] > (1 + tolerance) * best_before:
            return False
    return True


# -- rank agreement --------------------------------------------------------------------


class RankAgreement:
    """Small collectives that make every rank see the same facts (identity on one rank)."""

    def __init__(self, session: Session):
        self.group = session.group
        self.rank = session.rank
        self.world = session.world_size
        active = self.world > 1 and dist.is_available() and dist.is_initialized()
        self.active = active
        # NCCL reduces device tensors only; gloo takes CPU tensors.
        self.device = (
            session.device
            if active and dist.get_backend(self.group) == "nccl"
            else torch.device("cpu")
        )

    def statuses(self, status: int) -> list[int]:
        """Every rank's status code, in rank order."""
        vec = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        vec[self.rank] = status
        if self.active:
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        return [int(v) for v in vec.cpu()]

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(v) for v in t.cpu()]

    def sum(self, values: Sequence[float]) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return [float(v) for v in t.cpu()]

    def decide(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return broadcast_object(obj, src=0, group=self.group) if self.active else obj


# -- the sweep -------------------------------------------------------------------------

OK, OOM, ERROR = 0, 1, 2


@dataclass
class SweepPoint:
    """One tried (batch, cuDNN benchmarking) setting, identical on every rank."""

    batch: int
    cudnn_benchmark: bool | None
    """None off the GPU, where cuDNN plays no part."""
    status: str
    """``ok``, ``oom`` (some rank ran out of memory) or ``budget`` (not tried: no steps left)."""
    oom_ranks: list[int] = field(default_factory=list)
    step_s: float | None = None
    """Median over timed steps of the slowest rank's step time."""
    samples_per_s: float | None = None
    """Global throughput: batch x world size / step_s."""
    peak_bytes: float | None = None
    """Largest probe peak over ranks, above what the rank held before (None: not measurable)."""
    lr: float | None = None
    """The learning rate the workload's scaling rule gave this batch."""
    recheck: bool = False
    """A second measurement of a close contender, taken after the climb."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SweepOutcome:
    points: list[SweepPoint]
    batch: int
    """The knee (or the batch the job had, when nothing could be measured)."""
    cudnn_benchmark: bool | None
    steps_used: int
    reason: str


ProbeFn = Callable[["Session", float], "ProbeResult"]


def coordinated_sweep(
    session: Session,
    candidates: Sequence[int],
    settings: SweepSettings,
    max_steps: int,
    probe: ProbeFn,
    device_memory_bytes: float | None = None,
) -> SweepOutcome:
    """Climb ``candidates`` together on every rank; return the knee every rank agrees on.

    ``probe(session, limit_bytes)`` runs one collective-free forward/backward
    at the session's batch and reports OK, OOM or an error; ``limit_bytes``
    (or inf) is the peak above which it must report OOM itself.
    """
    agree = RankAgreement(session)
    on_gpu = session.device.type == "cuda"
    variants: list[bool | None] = (
        [False, True] if on_gpu and settings.compare_cudnn_benchmark else [None]
    )
    limit = math.inf
    if device_memory_bytes:  # a GPU's memory, or the memory cap (the CPU's too)
        limit = device_memory_bytes * (1 - settings.memory_margin)
    start_batch = session.batch_size
    points: list[SweepPoint] = []
    used = 0
    reason = "every candidate measured"
    per_try = 1 + settings.warmup_steps + settings.measure_steps
    for batch in sorted(candidates):
        oom = False
        for variant in variants:
            if used + per_try > max_steps:
                points.append(SweepPoint(batch, variant, "budget"))
                reason = f"step budget of {max_steps} spent"
                break
            point = _try_setting(session, agree, batch, variant, settings, probe, limit)
            used += 1 if point.status == "oom" else per_try
            points.append(point)
            if point.status == "oom":
                oom = True
                break
        if oom:
            reason = f"out of memory at batch {batch} on rank(s) {points[-1].oom_ranks}: all ranks backed off"
            break
        if points[-1].status == "budget":
            break
        if stopped_paying(best_per_batch(points), settings.min_gain, settings.patience):
            reason = f"throughput stopped paying beyond batch {batch}"
            break
    rechecked = []
    for batch, variant in recheck_pair(points, settings.recheck_margin):
        if used + per_try > max_steps:
            break
        point = _try_setting(session, agree, batch, variant, settings, probe, limit)
        used += 1 if point.status == "oom" else per_try
        point.recheck = True
        points.append(point)
        rechecked.append(batch)
        if point.status == "oom":
            reason += f"; batch {batch} ran out of memory when measured again: not chosen"
            break
    if len(rechecked) == 2 and points[-1].status == "ok":
        reason += (
            f"; batches {rechecked[0]} and {rechecked[1]} were within "
            f"{settings.recheck_margin:.0%} and were measured again"
        )
    failed = {p.batch for p in points if p.recheck and p.status == "oom"}
    measured = [p for p in points if p.status == "ok" and p.batch not in failed]
    if measured:
        best = [(b, t) for b, t in best_per_batch(points) if b not in failed]
        batch = choose_knee(best, settings.knee_tolerance)
        means = mean_per_setting(points)
        variant = max((key for key in means if key[0] == batch), key=means.__getitem__)[1]
    else:
        batch, variant = start_batch, None
        reason += "; nothing could be measured, the batch stays"
    decision = agree.decide({"batch": batch, "cudnn_benchmark": variant})
    _set_variant(decision["cudnn_benchmark"])
    session.set_batch_size(decision["batch"])
    return SweepOutcome(points, decision["batch"], decision["cudnn_benchmark"], used, reason)


def _try_setting(
    session, agree: RankAgreement, batch, variant, settings: SweepSettings, probe, limit
) -> SweepPoint:
    _set_variant(variant)
    session.set_batch_size(batch)
    result = probe(session, limit)
    statuses = agree.statuses(OK if result.ok else (OOM if result.oom else ERROR))
    if ERROR in statuses:
        bad = statuses.index(ERROR)
        detail = result.error if session.rank == bad else "see that rank's log"
        raise RuntimeError(f"batch sweep: probe at batch {batch} failed on rank {bad}: {detail}")
    oom_ranks = [r for r, s in enumerate(statuses) if s == OOM]
    if oom_ranks:
        return SweepPoint(batch, variant, "oom", oom_ranks=oom_ranks, lr=session.lr)
    peak = agree.max([result.peak_bytes if result.peak_bytes is not None else -1.0])[0]
    try:
        for _ in range(settings.warmup_steps):
            session.train_step()
        times = [session.train_step().step_s for _ in range(settings.measure_steps)]
    except Exception as exc:
        if not is_out_of_memory(exc) or agree.active:
            # With several ranks a step that fails mid-way leaves the others inside
            # its gradient all-reduce; only the process group's timeout ends that.
            raise
        session.optimizer.zero_grad(set_to_none=True)
        release_memory(session.device)
        return SweepPoint(batch, variant, "oom", oom_ranks=[session.rank], lr=session.lr)
    slowest = agree.max(times)  # per step, the slowest rank's time
    step_s = statistics.median(slowest)
    return SweepPoint(
        batch,
        variant,
        "ok",
        step_s=step_s,
        samples_per_s=batch * session.world_size / step_s,
        peak_bytes=peak if peak >= 0 else None,
        lr=session.lr,
    )


def _set_variant(variant: bool | None) -> None:
    if variant is not None:
        torch.backends.cudnn.benchmark = variant


def mean_per_setting(points: Sequence[SweepPoint]) -> dict[tuple[int, bool | None], float]:
    """Mean throughput of each measured (batch, variant): a setting measured twice counts
    both measurements, not the luckier one."""
    seen: dict[tuple[int, bool | None], list[float]] = {}
    for p in points:
        if p.status == "ok" and p.samples_per_s is not None:
            seen.setdefault((p.batch, p.cudnn_benchmark), []).append(p.samples_per_s)
    return {key: statistics.fmean(ts) for key, ts in seen.items()}


def best_per_batch(points: Sequence[SweepPoint]) -> list[tuple[int, float]]:
    """Per batch, its best variant's mean throughput, ascending by batch."""
    best: dict[int, float] = {}
    for (batch, _), t in mean_per_setting(points).items():
        best[batch] = max(best.get(batch, 0.0), t)
    return sorted(best.items())


# -- Eq. 6: the algorithm-choice ILP ---------------------------------------------------


@dataclass(frozen=True)
class AlgorithmOption:
    """One way to compute one layer: its time and its workspace memory at some batch."""

    name: str
    time_s: float
    memory_bytes: float


def choose_algorithms(
    layers: Sequence[Sequence[AlgorithmOption]], memory_bound_bytes: float
) -> tuple[list[int], float] | None:
    """Eq. 6: min sum x_kl T_kl s.t. sum x_kl M_kl <= M_bound, one algorithm per layer.

    Returns each layer's chosen option index and the total time, or None when
    even the leanest choice exceeds the bound.
    """
    if not layers:
        return [], 0.0
    sizes = [len(opts) for opts in layers]
    if min(sizes) < 1:
        raise ConfigError("every layer needs at least one algorithm option")
    from scipy.optimize import Bounds, LinearConstraint, milp  # 0.3 s to import: only when solving

    n = sum(sizes)
    cost = np.array([o.time_s for opts in layers for o in opts], dtype=float)
    memory = np.array([[o.memory_bytes for opts in layers for o in opts]], dtype=float)
    one_per_layer = np.zeros((len(layers), n))
    col = 0
    for k, size in enumerate(sizes):
        one_per_layer[k, col : col + size] = 1
        col += size
    res = milp(
        cost,
        constraints=[
            LinearConstraint(memory, -np.inf, memory_bound_bytes),
            LinearConstraint(one_per_layer, 1, 1),
        ],
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
    )
    if not res.success:
        return None
    x = np.round(res.x).astype(int)
    choice, col = [], 0
    for size in sizes:
        choice.append(int(np.argmax(x[col : col + size])))
        col += size
    return choice, float(cost @ x)


@dataclass(frozen=True)
class BatchPlanRow:
    batch: int
    feasible: bool
    time_s: float | None
    """Summed layer time of the ILP's choice for one step at this batch."""
    time_per_sample_s: float | None
    algorithms: list[str]
    bound_bytes: float


def plan_batch_by_algorithms(
    batches: Sequence[int],
    tables: Callable[[int], Sequence[Sequence[AlgorithmOption]]],
    bound_bytes: Callable[[int], float],
) -> tuple[int | None, list[BatchPlanRow]]:
    """Solve Eq. 6 for each batch and pick the least time PER SAMPLE.

    Erratum (NOTES.md section 5): the paper picks the batch with the least
    estimated training time but compares per-step times, which favours small
    batches; a fair comparison normalises by the samples a step processes.
    """
    rows = []
    for b in batches:
        options = tables(b)
        bound = bound_bytes(b)
        solved = choose_algorithms(options, bound) if bound >= 0 else None
        if solved is None:
            rows.append(BatchPlanRow(b, False, None, None, [], bound))
            continue
        choice, total = solved
        names = [options[k][i].name for k, i in enumerate(choice)]
        rows.append(BatchPlanRow(b, True, total, total / b, names, bound))
    feasible = [r for r in rows if r.feasible]
    best = min(feasible, key=lambda r: r.time_per_sample_s).batch if feasible else None
    return best, rows


# -- analytic per-layer tables, for planning on hardware one does not have -------------

GEMM_EFFICIENCY = 0.5
"""Assumed fraction of peak FLOP/s a GEMM-lowered convolution reaches."""
IMPLICIT_EFFICIENCY = 0.3
"""Assumed fraction of peak for implicit GEMM (no lowering buffer, more index arithmetic)."""
FFT_EFFICIENCY = 0.3
"""Assumed fraction of peak for the FFT path's transforms and pointwise products."""


def conv_algorithm_tables(
    spec: CnnSpec, batch: int, peak_flops: float
) -> list[list[AlgorithmOption]]:
    """Per conv layer, three algorithms with forward+backward time and workspace bytes at ``batch``.

    Workspaces follow the algorithms' data layouts: the im2col lowering buffer
    (X B_out H_out F^2 D_in floats); the FFT path's complex64 transforms of
    input, filters and output at the padded size (Mathieu et al.); implicit
    GEMM needs none. Times are FLOPs over an assumed fraction of peak
    (the module constants); backward costs twice the forward
    (:func:`tunekit.costmodel.training_flops`). A planning model:
    measured tables replace it where they exist.
    """
    shapes = feature_shapes(spec)
    implicit = ComputeRate.assumed(peak_flops, IMPLICIT_EFFICIENCY)
    gemm = ComputeRate.assumed(peak_flops, GEMM_EFFICIENCY)
    fft = ComputeRate.assumed(peak_flops, FFT_EFFICIENCY)
    tables = []
    for i, layer in enumerate(spec.features, start=1):
        if layer.kind != "conv":
            continue
        b_in, h_in, d_in = shapes[i - 1]
        b_out, h_out, _ = shapes[i]
        k, f = layer.K, layer.F
        direct = 2.0 * batch * b_out * h_out * k * f * f * d_in  # multiply-adds x 2
        lowered = 4.0 * batch * b_out * h_out * f * f * d_in
        n_fft = (b_in + 2 * layer.P) * (h_in + 2 * layer.P)
        half = (b_in + 2 * layer.P) * ((h_in + 2 * layer.P) // 2 + 1)
        fft_ws = 8.0 * half * (batch * d_in + k * d_in + batch * k)
        fft_flops = (
            5.0 * n_fft * math.log2(max(n_fft, 2)) * (batch * d_in + k * d_in + batch * k)
            + 8.0 * half * batch * k * d_in
        )
        tables.append(
            [
                AlgorithmOption("implicit_gemm", implicit.seconds(training_flops(direct)), 0.0),
                AlgorithmOption("gemm", gemm.seconds(training_flops(direct)), lowered),
                AlgorithmOption("fft", fft.seconds(training_flops(fft_flops)), fft_ws),
            ]
        )
    return tables
