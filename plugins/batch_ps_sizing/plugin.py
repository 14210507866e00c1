"""batch_ps_sizing: mini-batch size under a memory bound, number of GPUs, parameter servers.

After Zou et al., "Distributed Training Large-Scale Deep Architectures"
(2017). The batch is the one knob it turns (within the workload's allowed
range, learning rate rescaled by the workload's rule), chosen for the least
training time per sample (or, with ``knee_tolerance``, the smallest batch
near it); an in-job sweep, coordinated across ranks, measures it for real.
Lemma 3.1 (how many GPUs) and Lemma 3.2 (how many parameter servers) are
reported with the diagnosis, and the gradient noise scale (McCandlish et al.)
shows how large a batch still trains efficiently. The models evaluated on one
observation are in ``analysis.py``; this module turns them into words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from tunekit.api import Observation, Session, compose_headline, effort_repeats, effort_seconds
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.plugins.batch_ps_sizing import model as zou
from tunekit.plugins.batch_ps_sizing.analysis import (
    MAX_ACCUMULATION,
    MAX_BATCH,
    Analysis,
    MeasureSettings,
    MiB,
    analyse_job,
    analysis_details,
    best_trade,
    global_batch_at,
    lemma31_line,
    ranked_trades,
    worth_trying,
)
from tunekit.plugins.batch_ps_sizing.predict import per_step_phrase, scaling_phrase
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
    coordinated_sweep,
)


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
            analysis = analyse_job(
                obs,
                self.settings,
                self.target_efficiency,
                self.target_speedup,
                MeasureSettings(
                    effort_seconds(self.measure_budget_s),
                    effort_repeats(self.timed_repeats, 2),
                    effort_repeats(self.max_timed_repeats, 3),
                ),
            )
            self._last = (obs, analysis)
        return self._last[1]

    def diagnose(self, obs: Observation) -> Diagnosis:
        a = self.analyse(obs)
        details = analysis_details(a)
        scaling = lemma31_line(a)
        head = _evidence(obs, a)
        figure = _figure(obs)
        if a.batch_range is None:
            return Diagnosis(
                False,
                f"{head}; the workload sets no batch_range, so its batch may not change; {scaling}",
                details=details,
                headline=compose_headline("does not apply", figure="the workload fixes its batch"),
            )
        if a.largest_fitting < a.batch_range[0]:
            return Diagnosis(
                False,
                f"{head}; even batch {a.batch_range[0]} is predicted not to fit "
                f"{a.device_memory_bytes / MiB:,.0f} MiB; {scaling}",
                details=details,
                headline=compose_headline(
                    "does not apply",
                    figure=f"batch {a.batch_range[0]} would not fit "
                    f"{a.device_memory_bytes / MiB:,.0f} MiB",
                ),
            )
        now = a.predictions[a.batch]["samples_per_s"]
        fit = (
            f"up to {a.largest_fitting:,} fits"
            if a.largest_fitting < MAX_BATCH
            else "memory is no limit"
        )
        worth = worth_trying(a, self.settings.min_gain)
        trade = best_trade(a)
        if not worth and trade is not None:
            gain = 1 - trade["step_s"] / a.predictions[a.batch]["step_s"]
            shown = _gain(obs, a, trade["step_s"], trade["range_s"], a.batch)
            verdict = _trade_phrase(obs, a, trade)
        elif not worth:
            gain = 0.0
            knee = a.predictions.get(a.knee) if a.knee is not None else None
            shown = (
                _gain(obs, a, knee["step_s"], knee["range_s"], a.knee)
                if knee is not None and a.knee != a.batch
                else None
            )
            verdict = (
                f"no batch is predicted to beat batch {a.batch} by more than "
                f"{self.settings.min_gain:.0%} samples/s (best predicted: batch {a.knee})"
            )
        else:
            first = a.predictions[worth[0]]
            gain = 1 - now / first["samples_per_s"]  # time per sample saved
            shown = _gain(obs, a, first["step_s"], first["range_s"], worth[0])
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
            f"~{(a.memory or a.local.memory).peak_bytes(a.batch) / MiB:,.0f} MiB of "
            f"{a.device_memory_bytes / MiB:,.0f} MiB ({fit}, {self.settings.memory_margin:.0%} margin"
            f"{'; memory from ' + a.memory_source if a.memory is not a.local.memory else ''}); "
            f"{scaling}"
        )
        return Diagnosis(
            gain > 0,
            summary,
            expected_gain=gain,
            details=details,
            headline=compose_headline(gain > 0, *(shown or (None, None)), figure=figure),
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        a = self.analyse(obs)
        if a.batch_range is None or a.knee is None:
            return []
        base = a.predictions[a.batch]["samples_per_s"]
        order = worth_trying(a, self.settings.min_gain)
        # Trades first: they keep the samples per step, so the model converges as it did.
        out = [_trade_candidate(obs, a, t) for t in ranked_trades(a)]
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
                    global_batch=global_batch_at(obs, b),
                    predicted_peak_bytes=_core_peak(obs, b, obs.workload.accumulation),
                    rationale=(
                        f"batch {b}/rank ({global_batch_at(obs, b)} global{knee}): "
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
            session, candidates, settings, budget, probe_batch, device_memory_bytes(session)
        )
        for p in outcome.points:
            entry = p.to_dict()
            entry["knobs"] = {"batch_size": p.batch, "cudnn_benchmark": bool(p.cudnn_benchmark)}
            entry["steps"] = {"ok": per_try, "oom": 1}.get(p.status, 0)
            trace.append(entry)
        # The job's own batch, settled on, stays "0: the workload's": the search found nothing
        # to change, and the config says so.
        kept = knobs.get("batch_size", 0) == 0 and outcome.batch == session.workload.batch_size
        chosen = {
            **knobs,
            "batch_size": 0 if kept else outcome.batch,
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


def _gain(
    obs: Observation, a: Analysis, step_s: float, range_s: list[float], batch: int
) -> tuple[float, tuple[float, float]]:
    """Time per sample saved at ``batch`` against the current batch, and its range from the
    predicted step's range."""
    now = a.predictions[a.batch]["step_s"] / global_batch_at(obs, a.batch)

    def saved(step: float) -> float:
        return 1 - step / global_batch_at(obs, batch) / now

    low, high = range_s
    return saved(step_s), (saved(high), saved(low))


def _figure(obs: Observation) -> str:
    """The measured figure the batch model rests on: the share of the step that grows with it."""
    truth = obs.truth
    if truth is None or not truth.profiled:
        return "no measured breakdown of the step"
    return f"{truth.phrase('compute', short=True)} grows with the batch"


def _trade_phrase(obs: Observation, a: Analysis, t: dict[str, Any]) -> str:
    now = a.predictions[a.batch]["step_s"]
    return (
        f"batch {t['batch']}/rank x {t['accumulation']} micro-batch"
        f"{'es' if t['accumulation'] > 1 else ''} (now {a.batch} x {obs.workload.accumulation}, "
        f"the same {obs.global_batch} samples per step) should save ~{1 - t['step_s'] / now:.0%} "
        f"(predicted {_ms(t['step_s'])} per step; ~{t['peak_bytes'] / MiB:,.0f} MiB peak fits)"
    )


def _core_peak(obs: Observation, batch: int, accumulation: int) -> float | None:
    """A rank's peak at ``batch`` x ``accumulation`` from the core memory model (None without
    its facts): what ``--memory-cap`` is held against."""
    predicted = obs.predict_memory(batch=batch, accumulation=accumulation)
    return predicted.peak_bytes if predicted is not None else None


def _trade_candidate(obs: Observation, a: Analysis, t: dict[str, Any]) -> Candidate:
    low, high = t["range_s"]
    return Candidate(
        knobs={"batch_size": t["batch"], "accumulation": t["accumulation"]},
        predicted_step_s=t["step_s"],
        predicted_range_s=(low, high),
        global_batch=obs.global_batch,
        predicted_peak_bytes=_core_peak(obs, t["batch"], t["accumulation"]),
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
