"""batch_ps_sizing: mini-batch size under a memory bound, number of GPUs, parameter servers.

After Zou et al., "Distributed Training Large-Scale Deep Architectures"
(2017). The batch is the one knob it turns (within the workload's allowed
range, learning rate rescaled by the workload's rule), chosen for the least
training time per sample (or, with ``knee_tolerance``, the smallest batch
near it); an in-job sweep, coordinated across ranks, measures it for real. Lemma 3.1 (how many GPUs) and Lemma 3.2 (how many
parameter servers) are reported with the diagnosis, and the gradient noise
scale (McCandlish et al.) shows how large a batch still trains efficiently.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import psutil
import torch

from tunekit.api import Breakdown, Observation, Session, StepTruth
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.errors import HardwareError, WorkloadError
from tunekit.plugins.batch_ps_sizing import model as zou
from tunekit.plugins.batch_ps_sizing.measure import LocalMeasurement, measure_locally
from tunekit.plugins.batch_ps_sizing.predict import BatchStepModel, per_step_phrase, scaling_phrase
from tunekit.plugins.batch_ps_sizing.runtime import (
    apply_batch_knobs,
    device_memory_bytes,
    probe_batch,
    session_noise_sums,
)
from tunekit.plugins.batch_ps_sizing.search import (
    RankAgreement,
    SweepSettings,
    batch_ladder,
    choose_knee,
    conv_algorithm_tables,
    coordinated_sweep,
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
    """Largest per-rank batch the measured memory line fits into the smallest device."""
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

    def predicted_step_s(self, batch: int) -> float:
        return self.steps.step_s(batch)


class BatchPsSizing(Tuner):
    name = "batch_ps_sizing"
    title = "Mini-batch, GPU and parameter-server sizing (Zou et al.)"
    aspect = Aspect.BATCH

    def __init__(
        self,
        settings: SweepSettings | None = None,
        *,
        target_efficiency: float = 0.8,
        target_speedup: float | None = None,
        measure_budget_s: float = 45.0,
        timed_repeats: int = 3,
        max_timed_repeats: int = 9,
    ):
        self.settings = settings or SweepSettings()
        self.measure_budget_s = measure_budget_s
        """Planning: seconds this process may spend timing steps at larger batches."""
        self.timed_repeats = timed_repeats
        """Planning: timed steps per batch (rounds over all batches; the median counts)."""
        self.max_timed_repeats = max_timed_repeats
        """Planning: more rounds, up to this many, while the measuring budget lasts."""
        self.target_efficiency = target_efficiency
        """Lemma 3.1: recommend the most GPUs that keep at least this efficiency."""
        self.target_speedup = target_speedup
        """Lemma 3.1: also say how many GPUs reach this speed-up (None: skip)."""
        self._last: tuple[Observation, Analysis] | None = None  # diagnose and plan share it

    # -- declare ---------------------------------------------------------------------

    def knobs(self) -> list[Knob]:
        return [
            Knob(
                "batch_size",
                "int",
                0,
                "per-rank batch; 0 keeps the workload's own (only within its batch_range)",
                low=0,
                high=MAX_BATCH,
                changes_math=True,
            ),
            Knob(
                "accumulation",
                "int",
                0,
                "micro-batches per optimizer step; 0 keeps the workload's (with batch_size: "
                "fewer, larger micro-batches at the same samples per step)",
                low=0,
                high=MAX_ACCUMULATION,
                changes_math=True,
            ),
            Knob("cudnn_benchmark", "bool", False, "let cuDNN time its algorithms per shape (GPU)"),
            Knob(
                "knee_tolerance",
                "float",
                self.settings.knee_tolerance,
                "search: pick the smallest batch within this fraction of the best measured "
                "throughput (0: the best)",
                low=0.0,
                high=0.5,
            ),
        ]

    # -- diagnose / plan ---------------------------------------------------------------

    def analyse(self, obs: Observation) -> Analysis:
        """Evaluate the memory model, the step-time line and both lemmas on ``obs`` (cached)."""
        if self._last is None or self._last[0] is not obs:
            analysis = _analyse(
                obs,
                self.settings,
                self.target_efficiency,
                self.target_speedup,
                _MeasureSettings(self.measure_budget_s, self.timed_repeats, self.max_timed_repeats),
            )
            self._last = (obs, analysis)
        return self._last[1]

    def diagnose(self, obs: Observation) -> Diagnosis:
        a = self.analyse(obs)
        details = _details(a)
        scaling = _lemma31_line(a)
        head = _evidence(obs, a)
        if a.batch_range is None:
            return Diagnosis(
                False,
                f"{head}; the workload sets no batch_range, so its batch may not change; {scaling}",
                details=details,
            )
        if a.largest_fitting < a.batch_range[0]:
            return Diagnosis(
                False,
                f"{head}; even batch {a.batch_range[0]} is predicted not to fit "
                f"{a.device_memory_bytes / MiB:,.0f} MiB; {scaling}",
                details=details,
            )
        now = a.predictions[a.batch]["samples_per_s"]
        fit = (
            f"up to {a.largest_fitting:,} fits"
            if a.largest_fitting < MAX_BATCH
            else "memory is no limit"
        )
        worth = _worth_trying(a, self.settings.min_gain)
        trade = _best_trade(a)
        if not worth and trade is not None:
            gain = 1 - trade["step_s"] / a.predictions[a.batch]["step_s"]
            verdict = _trade_phrase(obs, a, trade)
        elif not worth:
            gain = 0.0
            verdict = (
                f"no batch is predicted to beat batch {a.batch} by more than "
                f"{self.settings.min_gain:.0%} samples/s (best predicted: batch {a.knee})"
            )
        else:
            first = a.predictions[worth[0]]
            gain = 1 - now / first["samples_per_s"]  # time per sample saved
            verdict = (
                f"batch {worth[0]}/rank should give {first['samples_per_s'] / now - 1:+.0%} "
                f"samples/s over the {_baseline_word(a)} {now:,.0f} (predicted "
                f"{_ms(first['step_s'])} per step{_extrapolated(a, worth[0])})"
            )
            if trade is not None:
                verdict += (
                    f"; or, keeping the training's mathematics, {_trade_phrase(obs, a, trade)}"
                )
        if a.unpredicted:
            verdict += f"; {_unpredicted_line(a)}"
        summary = (
            f"{head}; {verdict}; batch {a.batch}/rank peaks at "
            f"~{a.local.memory.peak_bytes(a.batch) / MiB:,.0f} MiB of "
            f"{a.device_memory_bytes / MiB:,.0f} MiB ({fit}, {self.settings.memory_margin:.0%} margin); "
            f"{scaling}"
        )
        return Diagnosis(gain > 0, summary, expected_gain=gain, details=details)

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        a = self.analyse(obs)
        if a.batch_range is None or a.knee is None:
            return []
        base = a.predictions[a.batch]["samples_per_s"]
        order = _worth_trying(a, self.settings.min_gain)
        # Trades first: they keep the samples per step, so the model converges as it did.
        out = [_trade_candidate(obs, a, t) for t in _ranked_trades(a)]
        for b in order:
            p = a.predictions[b]
            knee = (
                (", the knee" if self.settings.knee_tolerance else ", best predicted")
                if b == a.knee
                else ""
            )
            low, high = p["range_s"]
            out.append(
                Candidate(
                    knobs={"batch_size": b},
                    predicted_step_s=p["step_s"],
                    predicted_range_s=(low, high),
                    global_batch=_global_batch(obs, b),
                    rationale=(
                        f"batch {b}/rank ({_global_batch(obs, b)} global{knee}): "
                        f"{p['samples_per_s'] / base - 1:+.0%} samples/s over the {_baseline_word(a)} "
                        f"baseline, predicted {_ms(p['step_s'])} per step ({_ms(low)}-{_ms(high)})"
                        f"{_extrapolated(a, b)}; ~{p['peak_bytes'] / MiB:,.0f} MiB peak, "
                        f"lr {obs.workload.scaled_lr(b):.4g} ({obs.workload.lr_scaling})"
                    ),
                    details={**p, "lr": obs.workload.scaled_lr(b)},
                )
            )
        return out[:limit]

    # -- runtime ------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        apply_batch_knobs(session, knobs)

    def search(
        self, session: Session, knobs: Mapping[str, Any], max_steps: int
    ) -> SearchResult | None:
        """The rank-coordinated sweep: climb the batch ladder, back off together on OOM, measure
        close contenders again, take the best (or the knee, with a tolerance)."""
        rng = session.workload.batch_range
        if rng is None:
            return SearchResult(
                dict(knobs), [], "the workload sets no batch_range: the batch stays"
            )
        if session.step_fn is not None:
            return SearchResult(
                dict(knobs),
                [],
                "a placement replaced the training step; its memory cannot be probed: the batch stays",
            )
        settings = replace(
            self.settings,
            knee_tolerance=float(knobs.get("knee_tolerance", self.settings.knee_tolerance)),
        )
        agree = RankAgreement(session)
        trace: list[dict[str, Any]] = []
        noise = None
        budget = max_steps
        if settings.noise_scale_batches and budget > settings.noise_scale_batches:
            noise = _agreed_noise_scale(session, agree, settings.noise_scale_batches)
            budget -= settings.noise_scale_batches
            if noise is not None:
                trace.append(
                    {
                        "knobs": {},
                        "steps": settings.noise_scale_batches,
                        "noise_scale": noise.to_dict(),
                    }
                )
        per_try = 1 + settings.warmup_steps + settings.measure_steps
        tries = max(1, budget // per_try)
        if session.device.type == "cuda" and settings.compare_cudnn_benchmark:
            tries = max(1, tries // 2)
        candidates = batch_ladder(session.batch_size, rng, limit=tries)
        outcome = coordinated_sweep(
            session, candidates, settings, budget, probe_batch, device_memory_bytes(session.device)
        )
        for p in outcome.points:
            entry = p.to_dict()
            entry["knobs"] = {"batch_size": p.batch, "cudnn_benchmark": bool(p.cudnn_benchmark)}
            entry["steps"] = {"ok": per_try, "oom": 1}.get(p.status, 0)
            trace.append(entry)
        chosen = {
            **knobs,
            "batch_size": outcome.batch,
            "cudnn_benchmark": bool(outcome.cudnn_benchmark),
        }
        best = max(
            (p for p in outcome.points if p.status == "ok" and p.batch == outcome.batch),
            key=lambda p: p.samples_per_s,
            default=None,
        )
        rule = (
            f"knee (tolerance {settings.knee_tolerance:.0%})"
            if settings.knee_tolerance
            else "best measured throughput"
        )
        parts = [f"batch {outcome.batch}/rank: {rule}"]
        if best is not None:
            parts[0] += f", {best.samples_per_s:,.0f} samples/s"
        if noise is not None:
            limit = zou.noise_scale_batch_limit(noise, session.world_size, rng)
            parts.append(
                f"gradient noise scale B_simple ~ {noise.b_simple:,.0f} samples: "
                f"efficient up to ~{limit}/rank"
            )
        parts.append(outcome.reason)
        return SearchResult(chosen, trace, "; ".join(parts))

    # -- reporting ----------------------------------------------------------------------

    def snippet(self, knobs: Mapping[str, Any]) -> str | None:
        batch = int(knobs.get("batch_size", 0))
        acc = int(knobs.get("accumulation", 0))
        lines = []
        if batch:
            lines.append(f"batch_size = {batch}  # per rank; scale the learning rate by your rule")
        if acc:
            lines.append(
                f"accumulation = {acc}  # micro-batches per optimizer step (loss / accumulation each)"
            )
        if knobs.get("cudnn_benchmark"):
            lines.append("torch.backends.cudnn.benchmark = True")
        return "\n".join(lines) or None


# -- the analysis ---------------------------------------------------------------------------


def _local_device(obs: Observation) -> torch.device:
    return (
        torch.device("cuda", 0)
        if obs.device_type == "cuda" and torch.cuda.is_available()
        else torch.device("cpu")
    )


@dataclass(frozen=True)
class _MeasureSettings:
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
    obs: Observation, ladder: list[int], threads: int, settings: _MeasureSettings
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
    cached = obs.cache.get(key) if obs.cache is not None else None
    if cached:
        return LocalMeasurement.from_dict(cached)
    try:
        local = measure_locally(
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
            f"{obs.workload.name}: could not train a step in-process ({type(exc).__name__}: {exc})"
        ) from exc
    if obs.cache is not None:
        obs.cache.put(key, local.to_dict())
    return local


def _analyse(
    obs: Observation,
    settings: SweepSettings,
    target_eff: float,
    target_speedup: float | None,
    measuring: _MeasureSettings,
) -> Analysis:
    w = obs.workload
    b0 = w.batch_size
    devices = obs.hardware.devices[: max(1, obs.nproc)]
    device_mem = min(d.memory_bytes for d in devices)
    ladder = batch_ladder(b0, w.batch_range) if w.batch_range is not None else [b0]
    local = _measure(obs, ladder, _rank_threads(obs), measuring)
    largest = local.memory.largest_batch(device_mem, settings.memory_margin)
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
            "samples_per_s": _global_batch(obs, b) / step,
            "parts_s": steps.parts_s(b),
            "extrapolation": steps.extrapolation(b),
            "peak_bytes": local.memory.peak_bytes(b),
            "fits": float(b <= largest),
        }
    fitting = [
        (b, p["samples_per_s"]) for b, p in analysis.predictions.items() if p["fits"] or b == b0
    ]
    analysis.knee = choose_knee(fitting, settings.knee_tolerance)
    analysis.trades = _accumulation_trades(obs, steps, largest, local)
    analysis.eq5 = _eq5(obs, device_mem, settings.memory_margin, batches)
    analysis.lemma31 = _lemma31(ratio, target_eff, target_speedup)
    analysis.lemma32 = _lemma32(obs, compute)
    return analysis


def _global_batch(obs: Observation, batch: int) -> int:
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


def _lemma31_line(a: Analysis) -> str:
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


def _details(a: Analysis) -> dict[str, Any]:
    return {
        "batch": a.batch,
        "batch_range": list(a.batch_range) if a.batch_range else None,
        "device_memory_bytes": a.device_memory_bytes,
        "memory_profile": a.local.memory.to_dict(),
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


def _worth_trying(a: Analysis, tolerance: float) -> list[int]:
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
    obs: Observation, steps: BatchStepModel, largest: int, local: LocalMeasurement
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
            "peak_bytes": local.memory.peak_bytes(b),
        }
    return out


def _ranked_trades(a: Analysis) -> list[dict[str, Any]]:
    """Trades predicted at least MIN_TRADE_GAIN faster than the job, fastest first."""
    now = a.predictions[a.batch]["step_s"]
    fast = [t for t in a.trades.values() if t["step_s"] < now * (1 - MIN_TRADE_GAIN)]
    return sorted(fast, key=lambda t: t["step_s"])


def _best_trade(a: Analysis) -> dict[str, Any] | None:
    ranked = _ranked_trades(a)
    return ranked[0] if ranked else None


def _trade_phrase(obs: Observation, a: Analysis, t: dict[str, Any]) -> str:
    now = a.predictions[a.batch]["step_s"]
    return (
        f"batch {t['batch']}/rank x {t['accumulation']} micro-batch"
        f"{'es' if t['accumulation'] > 1 else ''} (now {a.batch} x {obs.workload.accumulation}, "
        f"the same {obs.global_batch} samples per step) should save ~{1 - t['step_s'] / now:.0%} "
        f"(predicted {_ms(t['step_s'])} per step; ~{t['peak_bytes'] / MiB:,.0f} MiB peak fits)"
    )


def _trade_candidate(obs: Observation, a: Analysis, t: dict[str, Any]) -> Candidate:
    low, high = t["range_s"]
    return Candidate(
        knobs={"batch_size": t["batch"], "accumulation": t["accumulation"]},
        predicted_step_s=t["step_s"],
        predicted_range_s=(low, high),
        global_batch=obs.global_batch,
        rationale=(
            f"{_trade_phrase(obs, a, t)}; {_ms(low)}-{_ms(high)}"
            f"{'; extrapolated' if t['extrapolation'] > 1 else ''}; the learning rate stays"
        ),
        details={**t, "trade": True},
    )


def _evidence(obs: Observation, a: Analysis) -> str:
    """The diagnosis's first clause: the measured truth, then the model (labelled)."""
    truth = obs.truth
    model = a.steps.describe()
    if truth is None:
        return f"no measured baseline: the step is the model's ({model})"
    if not truth.profiled:
        return (
            f"{_ms(truth.step_s)} per step (measured, not profiled: the change of a step "
            f"is taken from the steps timed here, unscaled; {model})"
        )
    return f"{per_step_phrase(truth)}; {scaling_phrase(truth)} ({model})"


def _baseline_word(a: Analysis) -> str:
    return "measured" if a.truth_measured else "model's"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def _extrapolated(a: Analysis, batch: int) -> str:
    x = a.predictions[batch]["extrapolation"]
    if x <= 1.0:
        return ""
    top = a.steps.fits["compute"].measured_range[1]
    return f"; extrapolated {x:.1f}x beyond the largest timed batch, {top}"


def _unpredicted_line(a: Analysis) -> str:
    top = a.steps.fits["compute"].measured_range[1]
    names = ", ".join(str(b) for b in sorted(a.unpredicted))
    skipped = a.steps.skipped
    first = min(skipped, default=None)
    why = (
        f"timing stopped at batch {top}, as batch {first} would take {skipped[first]}"
        if first is not None
        else f"the largest timed batch is {top}"
    )
    return f"no prediction for batch {names}: {why}, so not proposed"


def _agreed_noise_scale(
    session: Session, agree: RankAgreement, batches: int
) -> zou.NoiseScale | None:
    """Every rank's noise-scale sums added together, so all ranks hold the same estimate."""
    sums = session_noise_sums(session, batches)
    have = agree.sum([0.0 if sums is None else 1.0])[0]
    if have < session.world_size:
        return None  # a rank's batch was too small to split; no rank estimates
    sums.sq_small, sums.sq_big, count = agree.sum([sums.sq_small, sums.sq_big, sums.count])
    sums.count = int(count)
    return sums.estimate()
