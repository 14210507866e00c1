"""batch_ps_sizing's analysis of one observed job: what diagnose and plan both read.

The memory line and the step times measured here, the step-time model
calibrated on the measured baseline, the prediction of every batch of the
ladder, the accumulation trades, Eq. 5's memory bound and both lemmas
(:class:`Analysis`, built once per observation by :func:`analyse_job`).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from tunekit.api import LAYOUT_FEATURES, Breakdown, Observation, StepTruth
from tunekit.errors import HardwareError, WorkloadError
from tunekit.plugins.batch_ps_sizing import model as zou
from tunekit.plugins.batch_ps_sizing.measure import LocalMeasurement, measure_locally
from tunekit.plugins.batch_ps_sizing.predict import BatchStepModel
from tunekit.plugins.batch_ps_sizing.search import (
    SweepSettings,
    batch_ladder,
    choose_knee,
    conv_algorithm_tables,
    plan_batch_by_algorithms,
)

MAX_BATCH = 1 << 20
MAX_ACCUMULATION = 1 << 10
MIN_TRADE_GAIN = 0.01
"""A trade of micro-batches keeps the samples per step (the training's mathematics):
proposed when predicted this much faster."""
MiB = 2**20
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Analysis:
    """What diagnose and plan share: the models evaluated on one observation (plain data)."""

    batch: int
    batch_range: tuple[int, int] | None
    device_memory_bytes: float
    local: LocalMeasurement
    largest_fitting: int
    """Largest per-rank batch the memory line fits into the smallest device."""
    steps: BatchStepModel
    """Step time against the batch, calibrated on the measured baseline."""
    truth_measured: bool
    """Whether ``steps`` was calibrated on a measured baseline (else on the model's own step)."""
    overhead_s: float
    """T_O per step: overhead not hidden behind computation (batch-independent)."""
    compute_s: float
    """T_C per step at the current batch."""
    overhead_ratio: float | None
    overhead_source: str
    predictions: dict[int, dict[str, Any]] = field(default_factory=dict)
    unpredicted: dict[int, str] = field(default_factory=dict)
    """Batches of the ladder with no prediction, and why (too far beyond the timed ones)."""
    knee: int | None = None
    """The batch the settings' rule picks from the predictions (the best, or the knee)."""
    trades: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Fewer, larger micro-batches at the same samples per step, by accumulation (see
    :func:`_accumulation_trades`)."""
    eq5: dict[str, Any] | None = None
    lemma31: dict[str, Any] = field(default_factory=dict)
    lemma32: dict[str, Any] = field(default_factory=dict)
    memory: zou.MemoryProfile | None = None
    """The memory line per rank: measured here (``local.memory``), or for a sharded or
    checkpointed job the core memory model's (see :func:`job_memory_line`)."""
    memory_source: str = "measured here on the bare model"

    def predicted_step_s(self, batch: int) -> float:
        return self.steps.step_s(batch)


def _local_device(obs: Observation) -> torch.device:
    return (
        torch.device("cuda", 0)
        if obs.device_type == "cuda" and torch.cuda.is_available()
        else torch.device("cpu")
    )


@dataclass(frozen=True)
class MeasureSettings:
    budget_s: float
    repeats: int
    max_repeats: int


def _rank_threads(obs: Observation) -> int:
    """Intra-op threads a trial rank gets (the launcher's rule), on no more cores than this machine has."""
    here = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return max(1, min(int(obs.hardware.host.cores), here) // max(1, obs.nproc))


def _timing_batches(b0: int, ladder: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(batches to time, batches that must be timed): every batch of the ladder above b0, two below.

    The fit needs b0 and a neighbour whatever the budget; larger batches are
    timed while the measuring budget lasts.
    """
    below = sorted((b for b in ladder if b < b0), reverse=True)[:2]
    above = [b for b in ladder if b > b0]
    if not below and not above:  # no range to move in: a neighbour for the fit only
        below = [b0 // 2] if b0 > 1 else []
        above = [] if below else [2 * b0]
    neighbour = below[0] if below else above[0]
    return tuple(sorted({*below, b0, *above})), (b0, neighbour)


def _measure(
    obs: Observation, ladder: list[int], threads: int, settings: MeasureSettings
) -> LocalMeasurement:
    b0 = obs.workload.batch_size
    small = max(1, b0 // 4)
    memory = (small, b0 if b0 > small else small * 4)
    timing, required = _timing_batches(b0, ladder)
    device = _local_device(obs)
    key = (
        f"batch_ps_sizing/local/v2/{obs.workload_spec}/{device.type}/{memory}/{timing}/"
        f"{threads}t/{settings.repeats}-{settings.max_repeats}x{settings.budget_s:g}s"
    )

    def measure() -> LocalMeasurement:
        try:
            return measure_locally(
                obs.workload,
                memory,
                device,
                settings.repeats,
                timing_batches=timing,
                threads=threads,
                budget_s=settings.budget_s,
                required=required,
                max_repeats=settings.max_repeats,
            )
        except Exception as exc:
            raise WorkloadError(
                f"{obs.workload.name}: could not train a step in-process "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    return obs.cached(
        key, measure, encode=LocalMeasurement.to_dict, decode=LocalMeasurement.from_dict
    )


def analyse_job(
    obs: Observation,
    settings: SweepSettings,
    target_eff: float,
    target_speedup: float | None,
    measuring: MeasureSettings,
) -> Analysis:
    w = obs.workload
    b0 = w.batch_size
    devices = obs.hardware.devices[: max(1, obs.nproc)]
    device_mem = min(d.memory_bytes for d in devices)
    ladder = batch_ladder(b0, w.batch_range) if w.batch_range is not None else [b0]
    local = _measure(obs, ladder, _rank_threads(obs), measuring)
    memory, memory_source = job_memory_line(obs, local)
    largest = memory.largest_batch(device_mem, settings.memory_margin)
    truth = obs.truth
    measured = truth is not None
    if truth is None:
        truth = _model_truth(obs, local)
    spread = obs.baseline.spread_s if obs.baseline is not None else 0.0
    steps = BatchStepModel.build(b0, local.timing, truth, spread, measured, w.accumulation)
    overhead, compute, ratio, source = _overhead(obs, local.step_s[b0])
    analysis = Analysis(
        b0,
        w.batch_range,
        device_mem,
        local,
        min(largest, MAX_BATCH),
        steps,
        measured,
        overhead,
        compute,
        ratio,
        source,
        memory=memory,
        memory_source=memory_source,
    )

    batches = [b0]
    if w.batch_range is not None:
        hi = min(w.batch_range[1], max(largest, w.batch_range[0]))
        batches = [b for b in ladder if b <= hi or b == b0]
    for b in batches:
        if not steps.predictable(b):
            analysis.unpredicted[b] = (
                f"{steps.extrapolation(b):.0f}x beyond the largest timed batch "
                f"({steps.fits['compute'].measured_range[1]})"
            )
            continue
        step = steps.step_s(b)
        analysis.predictions[b] = {
            "step_s": step,
            "range_s": list(steps.range_s(b)),
            "samples_per_s": global_batch_at(obs, b) / step,
            "parts_s": steps.parts_s(b),
            "extrapolation": steps.extrapolation(b),
            "peak_bytes": memory.peak_bytes(b),
            "fits": float(b <= largest),
        }
    fitting = [
        (b, p["samples_per_s"]) for b, p in analysis.predictions.items() if p["fits"] or b == b0
    ]
    analysis.knee = choose_knee(fitting, settings.knee_tolerance)
    analysis.trades = _accumulation_trades(obs, steps, largest, memory)
    analysis.eq5 = _eq5(obs, device_mem, settings.memory_margin, batches)
    analysis.lemma31 = _lemma31(ratio, target_eff, target_speedup)
    analysis.lemma32 = _lemma32(obs, compute)
    return analysis


def job_memory_line(obs: Observation, local: LocalMeasurement) -> tuple[zou.MemoryProfile, str]:
    """The job's memory per rank as a line in the batch, and where it comes from.

    The line measured here trains the bare model: no FSDP shards, no checkpointed block. For
    a sharded or checkpointed job that over-states what a rank holds, so the core memory
    model's line is taken instead (its layout, calibrated on the measured baseline), through
    its predictions at the job's batch and half of it."""
    if not (obs.workload.features() & LAYOUT_FEATURES) or obs.memory is None:
        return local.memory, "measured here on the bare model"
    b0 = obs.workload.batch_size
    b1 = max(1, b0 // 2) if b0 > 1 else 2
    p0, p1 = obs.predict_memory(batch=b0), obs.predict_memory(batch=b1)
    assert p0 is not None and p1 is not None  # obs.memory is there
    slope = max((p0.peak_bytes - p1.peak_bytes) / (b0 - b1), 1.0)
    static = p0.parts.get("parameters", 0.0) + p0.parts.get("optimizer", 0.0)
    transient = max(0.0, p0.peak_bytes - static - slope * b0)
    profile = zou.MemoryProfile(static, transient, slope, "core memory model")
    return profile, f"the core memory model ({obs.workload.layout().describe()})"


def global_batch_at(obs: Observation, batch: int) -> int:
    """Samples per step over all ranks at per-rank ``batch``, counted as the observation counts
    the baseline's (``obs.global_batch``: ranks, and micro-batches where it counts them), so
    that candidates and baseline are ranked per sample on one scale."""
    return obs.global_batch * batch // obs.workload.batch_size


def _model_truth(obs: Observation, local: LocalMeasurement) -> StepTruth:
    """Without a measured baseline (``tunekit plan``): the step as timed here, plus the
    hardware model's all-reduce of the gradients on several ranks."""
    b0 = obs.workload.batch_size
    rows = local.timing.samples[b0]
    parts = {p: statistics.median(r[p] for r in rows) for p in ("data", "compute", "optimizer")}
    for p in ("data", "compute"):  # timed per micro-batch; the job runs `accumulation` of them
        parts[p] *= obs.workload.accumulation
    comm = 0.0
    if obs.nproc > 1:
        try:
            comm = obs.hardware.allreduce_time(obs.model.param_bytes, obs.nproc, obs.backend)
        except HardwareError:
            comm = 0.0
    parts.update(comm_exposed=comm, idle=0.0)
    return StepTruth(
        sum(parts.values()),
        parts,
        source="model: no measured baseline; steps timed in this process, all-reduce from the hardware model",
    )


def _overhead(obs: Observation, t_local: float) -> tuple[float, float, float | None, str]:
    """(T_O, T_C, R_O, where R_O came from) for one step at the current batch."""
    truth = obs.truth
    if truth is not None and truth.profiled and truth.parts_s["compute"] > 0:
        compute = truth.parts_s["compute"]
        over = max(0.0, truth.step_s - compute)
        return over, compute, over / compute, "measured: the step less its compute"
    summary = _breakdown_summary(obs.breakdown)
    if summary is not None:
        compute, total = summary["compute_s"], summary["total_s"]
        over = max(0.0, total - compute)
        return over, compute, over / compute, "step breakdown (time not hidden behind compute)"
    base = obs.baseline.median_s if obs.baseline is not None else None
    if base is not None and obs.nproc > 1:
        over = max(0.0, base - t_local)
        return (
            over,
            base - over,
            over / (base - over),
            (f"{obs.nproc}-rank baseline step vs a 1-rank step in this process"),
        )
    grad_bytes = obs.model.param_bytes
    compute = base if base is not None else t_local
    g = obs.nproc if obs.nproc > 1 else max(2, len(obs.hardware.devices))
    try:
        over = obs.hardware.allreduce_time(grad_bytes, g, obs.backend)
    except HardwareError:
        return 0.0, compute, None, "unknown: needs a step breakdown or a multi-rank baseline"
    # One rank has nothing to all-reduce now; R_O is what G devices of this hardware would add.
    return (
        0.0 if obs.nproc <= 1 else over,
        compute,
        over / compute,
        (f"hardware model: all-reduce of {grad_bytes / MiB:,.0f} MiB over {g} devices"),
    )


def _breakdown_summary(breakdown: Breakdown | None) -> dict[str, float] | None:
    if breakdown is None:
        return None
    summary = breakdown.summary()
    compute, total = summary.get("compute_s"), summary.get("total_s")
    if not compute or not total or compute <= 0:
        return None
    return {"compute_s": float(compute), "total_s": float(total)}


def _eq5(
    obs: Observation, device_mem: float, margin: float, batches: list[int]
) -> dict[str, Any] | None:
    spec = _cnn_spec(obs)
    if spec is None:
        return None
    out: dict[str, Any] = {
        "largest_batch": zou.largest_batch_eq5(spec, device_mem, margin),
        "feature_map_bits_per_sample": zou.feature_map_bits(spec, 1),
        "conv_parameter_bits": zou.conv_parameter_bits(spec),
        "classifier_bits_at_batch": zou.classifier_bits(spec, obs.workload.batch_size),
    }
    peak = min(d.peak_flops for d in obs.hardware.devices[: max(1, obs.nproc)])
    best, rows = plan_batch_by_algorithms(
        batches,
        lambda b: conv_algorithm_tables(spec, b, peak),
        lambda b: zou.memory_bound_bits(device_mem * 8 * (1 - margin), spec, b) / 8,
    )
    out["algorithm_plan"] = {"best_batch": best, "rows": [r.__dict__ for r in rows]}
    return out


def _cnn_spec(obs: Observation) -> zou.CnnSpec | None:
    graph = obs.graph
    if graph is None:
        try:
            from tunekit.api import trace_model

            graph = trace_model(obs.workload.model(), obs.workload.example_batch(2)[0])
        except Exception:
            return None  # no graph, no Eq. 1-5: the measured form still holds
    return zou.cnn_spec_from_graph(graph)


def _lemma31(
    ratio: float | None, target_eff: float, target_speedup: float | None
) -> dict[str, Any]:
    if ratio is None:
        return {}
    out: dict[str, Any] = {
        "overhead_ratio": ratio,
        "curve": zou.speedup_curve(ratio, GPU_COUNTS),
        "speedup_asymptote": _finite(zou.speedup_asymptote(ratio)),
        "target_efficiency": target_eff,
        "gpus_for_efficiency": zou.gpus_for_efficiency(target_eff, ratio),
    }
    if target_speedup is not None:
        out["target_speedup"] = target_speedup
        out["gpus_for_speedup"] = zou.gpus_for_speedup(target_speedup, ratio)
    return out


def _lemma32(obs: Observation, compute_s: float) -> dict[str, Any]:
    links = [lk.bandwidth for lk in obs.hardware.links]
    if not links or compute_s <= 0:
        return {}
    bandwidth = zou.Bandwidth.of_bytes_per_s(min(links))
    params = zou.DataSize.of_bytes(obs.model.param_bytes)
    workers = max(1, obs.nproc)
    return {
        "parameter_servers": zou.parameter_servers(params, workers, bandwidth, compute_s),
        "param_megabytes": params.bytes / 1e6,
        "workers": workers,
        "bandwidth_gbps": bandwidth.bits_per_s / 1e9,
        "compute_s": compute_s,
    }


def _finite(x: float) -> float | None:
    """JSON has no infinity: None stands for "unbounded"."""
    return None if math.isinf(x) else x


def lemma31_line(a: Analysis) -> str:
    if a.overhead_ratio is None:
        return f"GPU count: R_O {a.overhead_source}"
    lem = a.lemma31
    g = lem["gpus_for_efficiency"]
    most = (
        "any number of GPUs keep"
        if g is None
        else f"up to {g} GPU{'s' if g > 1 else ''} keep{'' if g > 1 else 's'}"
    )
    asym = lem["speedup_asymptote"]
    cap = "no cap" if asym is None else f"speed-up capped at {asym:.1f}x"
    return (
        f"R_O = {a.overhead_ratio:.3f} ({a.overhead_source}): {most} "
        f"{lem['target_efficiency']:.0%} efficiency, {cap}"
    )


def analysis_details(a: Analysis) -> dict[str, Any]:
    return {
        "batch": a.batch,
        "batch_range": list(a.batch_range) if a.batch_range else None,
        "device_memory_bytes": a.device_memory_bytes,
        "memory_profile": (a.memory or a.local.memory).to_dict(),
        "memory_source": a.memory_source,
        "largest_fitting_batch": a.largest_fitting,
        "step_s_measured_here": {str(b): t for b, t in a.local.step_s.items()},
        "step_model": a.steps.to_dict(),
        "calibrated_on": "measured baseline"
        if a.truth_measured
        else "model (no measured baseline)",
        "overhead_s": a.overhead_s,
        "compute_s": a.compute_s,
        "overhead_source": a.overhead_source,
        "predictions": {str(b): p for b, p in a.predictions.items()},
        "unpredicted": {str(b): why for b, why in a.unpredicted.items()},
        "knee": a.knee,
        "trades": {str(acc): t for acc, t in a.trades.items()},
        "eq5": a.eq5,
        "lemma31": a.lemma31,
        "lemma32": a.lemma32,
    }


def worth_trying(a: Analysis, tolerance: float) -> list[int]:
    """Batches predicted to beat the current one by more than ``tolerance`` in samples/s:
    the rule's pick first (see ``Analysis.knee``), then by predicted throughput."""
    base = a.predictions[a.batch]["samples_per_s"]
    worth = [
        b
        for b, p in a.predictions.items()
        if b != a.batch and p["fits"] and p["samples_per_s"] > base * (1 + tolerance)
    ]
    return sorted(worth, key=lambda b: (b != a.knee, -a.predictions[b]["samples_per_s"]))


def _accumulation_trades(
    obs: Observation, steps: BatchStepModel, largest: int, memory: zou.MemoryProfile
) -> dict[int, dict[str, Any]]:
    """A job that accumulates A micro-batches of b0 per optimizer step can run A' < A
    micro-batches of b0·A/A' instead: the same samples per step, so the same update,
    in fewer and larger passes (each pass's fixed costs paid less often, larger
    kernels). Zou's memory bound decides how large a micro-batch may be: the
    measured memory line's largest fitting batch. Keyed by A'."""
    w = obs.workload
    per_step = w.batch_size * w.accumulation
    if w.accumulation <= 1 or w.batch_range is None:
        return {}
    lo, hi = w.batch_range
    out: dict[int, dict[str, Any]] = {}
    for acc in range(1, w.accumulation):
        b = per_step // acc
        if per_step % acc or not lo <= b <= hi or b > largest or not steps.predictable(b):
            continue
        step = steps.step_s(b, acc)
        out[acc] = {
            "batch": b,
            "accumulation": acc,
            "step_s": step,
            "range_s": list(steps.range_s(b, acc)),
            "samples_per_s": obs.global_batch / step,
            "parts_s": steps.parts_s(b, acc),
            "extrapolation": steps.extrapolation(b),
            "peak_bytes": memory.peak_bytes(b),
        }
    return out


def ranked_trades(a: Analysis) -> list[dict[str, Any]]:
    """Trades predicted at least MIN_TRADE_GAIN faster than the job, fastest first."""
    now = a.predictions[a.batch]["step_s"]
    fast = [t for t in a.trades.values() if t["step_s"] < now * (1 - MIN_TRADE_GAIN)]
    return sorted(fast, key=lambda t: t["step_s"])


def best_trade(a: Analysis) -> dict[str, Any] | None:
    ranked = ranked_trades(a)
    return ranked[0] if ranked else None
