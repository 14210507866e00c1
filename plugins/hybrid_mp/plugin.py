"""hybrid_mp: when data × model parallelism beats data parallelism alone, and where each op runs.

After Pal et al., "Optimizing Multi-GPU Parallelization Strategies for Deep
Learning Training" (DLPlacer). For a budget of G devices the tuner scores
every factorisation G = N × M — N-way data parallelism over workers of M
model-parallel devices, global batch N × B — with SU_N^M = SU^M × SE_N × N ×
E_1/E_N (Eq. 5) against the best DP-only scale (Eq. 3, Eq. 6), where SU^M
is the per-step speed-up DLPlacer's ILP predicts for the best placement of
the model's layers on M devices.

This module is the tuner and the words it says; what it reads from the job is in
:mod:`~tunekit.plugins.hybrid_mp.inputs`, its placements in
:mod:`~tunekit.plugins.hybrid_mp.placers`, the calibrated prediction in
:mod:`~tunekit.plugins.hybrid_mp.predict`, and the options a workload may give in
``Workload.extra["hybrid_mp"]`` in :mod:`~tunekit.plugins.hybrid_mp.options`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from tunekit.api import Observation, Session, broadcast_object, compose_headline
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.calibrated import HybridPrediction
from tunekit.plugins.hybrid_mp.inputs import (
    epoch_table,
    model_graph,
    mp_degrees,
    op_graph,
    op_units,
    paper_step_1,
    scaling,
    session_graph,
    step_batch,
)
from tunekit.plugins.hybrid_mp.model import EpochTable, OpGraph, decide, eq6_threshold
from tunekit.plugins.hybrid_mp.options import OPTIONS_KEY, HybridOptions
from tunekit.plugins.hybrid_mp.placement_codec import (
    check_placement,
    decode_placement,
    encode_placement,
    placement_nodes,
)
from tunekit.plugins.hybrid_mp.placers import (
    alternatives,
    quick_placement,
    solve_placement,
    stage_placement,
    worker_plan,
)
from tunekit.plugins.hybrid_mp.predict import calibrated_su, predict_placement, step_model
from tunekit.plugins.hybrid_mp.render import (
    format_decision_table,
    format_gantt,
    format_placement_table,
    format_summary,
)
from tunekit.plugins.hybrid_mp.runtime import install_hybrid
from tunekit.plugins.hybrid_mp.schedule import Placement
from tunekit.plugins.hybrid_mp.search import speedup_bound

MIN_USEFUL_SPEEDUP = 1.02


# -- what the tuner says ---------------------------------------------------------------------

PLACER_NAMES = {
    "ilp": "DLPlacer's ILP",
    "ilp+blocks": "DLPlacer's ILP",
    "list": "list schedule",
    "pipeline": "contiguous stages",
    "single": "one device",
}


def seconds(t: float) -> str:
    """A duration in the unit that shows it: 3.2 s, 41 ms, 270 us."""
    if t >= 1.0:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.0f} ms"
    return f"{t * 1e6:.0f} us"


def measured_evidence(obs: Observation) -> str:
    """The measured truth the diagnosis starts from, in the words every tuner uses."""
    truth = obs.truth
    if truth is None:
        return "no measured baseline"
    if not truth.profiled:
        return f"measured: {truth.describe()}"
    return (
        f"measured: {truth.step_s * 1e3:.0f} ms per step of {obs.global_batch} samples, "
        f"{truth.phrase('compute')}, {truth.phrase('comm_exposed')}"
    )


def measured_figure(obs: Observation) -> str:
    """The measured figure a hybrid's verdict rests on: the all-reduce DDP leaves exposed,
    which model parallelism saves and a waiting device must not outweigh."""
    truth = obs.truth
    if truth is None or not truth.profiled:
        return "no measured breakdown of the step"
    return truth.phrase("comm_exposed", short=True)


def gain_of(pred: HybridPrediction) -> tuple[float, tuple[float, float]]:
    """Time per sample saved against the baseline (negative: lost), with its range."""

    def saved(step_s: float) -> float:
        return 1.0 - step_s / pred.global_batch / pred.baseline_per_sample_s

    return saved(pred.step_s), (saved(pred.range_s[1]), saved(pred.range_s[0]))


def expectation(obs: Observation, pred: HybridPrediction, m: int) -> str:
    """What the calibrated model expects, per step and per sample."""
    n = obs.nproc // m
    ratio = pred.per_sample_ratio
    verdict = (
        f"{ratio:.2f}x slower per sample" if ratio > 1 else f"{1 - ratio:.0%} faster per sample"
    )
    ex = pred.mp_step
    return (
        f"calibrated on it: a {n} x {m} hybrid step ~{pred.step_s * 1e3:.0f} ms for "
        f"{pred.global_batch} samples (a hybrid trains {pred.global_batch} samples per step, not "
        f"{obs.global_batch}), {pred.per_sample_s * 1e3:.1f} ms per sample against "
        f"{pred.baseline_per_sample_s * 1e3:.1f} ms measured: {verdict} "
        f"(the executor: {ex.segments} segments, {ex.transfers} messages of "
        f"{ex.transfer_bytes / 1e6:.0f} MB, {max(ex.wait_s.values(), default=0.0) * 1e3:.0f} ms "
        "waiting on the slower device)"
    )


def describe_stages(og: OpGraph, placement: Placement, units: Mapping[str, str] | None) -> str:
    """``device 0: tokens_1 .. blocks.2; device 1: blocks.3 .. head`` (first and last unit)."""
    spans: dict[str, list[str]] = {}
    for op in og.ops:
        unit = units.get(op.name, op.name) if units else op.name
        seen = spans.setdefault(placement.assignment[op.name], [])
        if not seen or seen[-1] != unit:
            seen.append(unit)
    return "; ".join(
        f"device {i}: {us[0]}" + (f" .. {us[-1]}" if len(us) > 1 else "")
        for i, us in enumerate(spans[d] for d in placement.devices if d in spans)
    )


def candidate_order(c: Candidate, batch: int) -> tuple:
    """Time to converge when E_N is known, else predicted time per sample (unpredicted last)."""
    if "time_to_converge_vs_best_dp" in c.details:
        return (0, -c.details["time_to_converge_vs_best_dp"])
    if c.predicted_step_s is None:
        return (2, -c.details["su_m"])
    return (1, c.predicted_step_s / (c.global_batch or batch))


# -- the tuner ------------------------------------------------------------------------------------


class HybridMp(Tuner):
    name = "hybrid_mp"
    title = "Hybrid data x model parallelism (DLPlacer, Pal et al.)"
    aspect = Aspect.PLACEMENT
    excludes = frozenset({Aspect.GRAD_SYNC})

    def knobs(self) -> list[Knob]:
        return [
            Knob(
                "mp_degree",
                "int",
                1,
                "devices per model-parallel worker M (1 = data parallel only); the global "
                "batch becomes (world / M) x B",
                1,
                64,
                changes_math=True,
                live="relaunch",
            ),
            Knob(
                "placement",
                "str",
                "",
                'the planned placement, JSON {"devices": {layer: index}, "start": {layer: s}, '
                '"end": {layer: s}}; '
                "empty: each worker plans with `placer`",
                parse=check_placement,
                live="relaunch",
            ),
            Knob(
                "placer",
                "choice",
                "dlplacer",
                "when no placement is given: DLPlacer's ILP on this machine's devices, or "
                "balanced contiguous stages",
                choices=("dlplacer", "pipeline"),
                live="relaunch",
            ),
            Knob(
                "time_limit_s",
                "float",
                30.0,
                "DLPlacer's time limit when a worker plans its placement",
                1.0,
                3600.0,
                live="relaunch",
            ),
        ]

    # -- diagnose / plan -----------------------------------------------------------------------

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2 or len(obs.hardware.devices) < 2:
            return Diagnosis(False, "one device: no model-parallel worker can be formed")
        # -- training features (issue 17) --
        from tunekit.api import declined_features
        from tunekit.plugins.hybrid_mp.runtime import HYBRID_HANDLES, HYBRID_NEEDS

        if why := declined_features(obs.workload.features(), HYBRID_HANDLES, HYBRID_NEEDS):
            return Diagnosis(False, why)
        # --
        evidence = measured_evidence(obs)
        opts = HybridOptions.of(obs)
        graph = model_graph(obs, strict=False)
        if graph.method != "fx":  # torch.export/hooks graphs: no fx nodes to place
            return Diagnosis(
                False, f"{evidence}; needs the model as a torch.fx graph ({graph.notice})"
            )
        try:
            og, source = op_graph(obs, opts)
        except ConfigError as exc:
            return Diagnosis(False, f"{evidence}; {exc}")
        bound = speedup_bound(og)
        details: dict[str, Any] = {"su_bound": bound, "ops": len(og.ops), "times": source}
        if bound < MIN_USEFUL_SPEEDUP:
            return self._diagnose_chain(obs, og, source, evidence, details)
        m = next(iter(mp_degrees(obs, opts)), 2)
        quick = quick_placement(og, obs, m)
        details[f"su{m}_list_schedule"] = quick.speedup
        text = (
            f"{evidence}; model: branches allow SU^M up to {bound:.2f}, DLPlacer's list schedule "
            f"gives SU^{m} = {quick.speedup:.2f} on {m} devices (layer time "
            f"{seconds(og.serial_time())} -> {seconds(quick.makespan)})"
        )
        gain: float | None = None
        shown: tuple[float | None, tuple[float, float] | None] = (None, None)
        model = step_model(obs, og, source)
        if isinstance(model, str):
            text += f"; no calibrated prediction: {model}"
        else:
            pred = predict_placement(obs, model, quick)
            details["calibrated"] = {**model.to_dict(), "prediction": pred.to_dict()}
            text += "; " + expectation(obs, pred, m)
            gain = max(0.0, 1.0 - pred.per_sample_ratio)
            shown = gain_of(pred)
        epochs = opts.epochs and EpochTable(opts.epochs)
        g = obs.nproc
        if epochs and g % m == 0 and epochs.covers(g // m) and epochs.covers(g):
            thr = eq6_threshold(g // m, m, epochs)
            su = quick.speedup if isinstance(model, str) else calibrated_su(model, pred)
            wins = su > thr
            text += (
                f"; Eq. 6 needs SU^{m} > {thr:.3f} on {g} devices, "
                f"{'calibrated' if not isinstance(model, str) else 'model'} SU^{m} = {su:.2f}: "
                + ("hybrid should win" if wins else "data parallelism stays ahead")
            )
            gain = (su / thr - 1.0) if wins else 0.0
            shown = (gain, None)
        elif gain is None or gain == 0.0:
            text += (
                f"; whether {g} devices are better spent on model parallelism depends on "
                f'E_N (epochs at each global batch): give extra["{OPTIONS_KEY}"]["epochs"] or '
                "epochs_from for Eq. 6"
            )
        return Diagnosis(
            True,
            text,
            expected_gain=gain,
            details=details,
            headline=compose_headline(True, *shown, figure=measured_figure(obs)),
        )

    def _diagnose_chain(self, obs, og, source, evidence, details) -> Diagnosis:
        """A chain has no branches to run side by side: what contiguous stages (whole
        transformer blocks per device) would do, calibrated on the baseline. Without
        micro-batches one device waits while the other works, so they pay only where the
        replicas' all-reduce costs more than that wait."""
        text = (
            f"{evidence}; the model's layers form a chain (model: critical path = "
            f"{1 / details['su_bound']:.0%} of the layers' time): no branch parallelism for "
            "model-parallel workers"
        )
        degrees = mp_degrees(obs, HybridOptions.of(obs))
        if not degrees:
            return Diagnosis(False, text, details=details)
        m = degrees[0]
        units = op_units(og, model_graph(obs))
        try:
            stages = stage_placement(og, obs, m, units)
        except ConfigError as exc:
            return Diagnosis(False, f"{text}; {exc}", details=details)
        where = describe_stages(og, stages, units)
        text += (
            f"; in {m} contiguous stages{' of whole transformer blocks' if units else ''} ({where})"
        )
        details["stages"] = where
        model = step_model(obs, og, source)
        if isinstance(model, str):
            return Diagnosis(
                False,
                f"{text}: no calibrated prediction: {model}",
                details=details,
                headline=compose_headline(False, figure=f"no prediction: {model}"),
            )
        pred = predict_placement(obs, model, stages)
        details["calibrated"] = {**model.to_dict(), "prediction": pred.to_dict()}
        text += f", {expectation(obs, pred, m)}"
        gain = 1.0 - pred.per_sample_ratio
        applies = pred.per_sample_ratio * MIN_USEFUL_SPEEDUP < 1.0
        headline = compose_headline(applies, *gain_of(pred), figure=measured_figure(obs))
        if not applies:
            return Diagnosis(
                False,
                f"{text}: the device that waits costs more than the all-reduce it saves",
                details=details,
                headline=headline,
            )
        return Diagnosis(
            True,
            f"{text}: the all-reduce it saves outweighs the device that waits",
            expected_gain=gain,
            details=details,
            headline=headline,
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2 or len(obs.hardware.devices) < 2:
            return []
        opts = HybridOptions.of(obs)
        if model_graph(obs, strict=False).method != "fx":
            return []  # diagnose said why: no fx nodes to place
        try:
            og, source = op_graph(obs, opts)
        except ConfigError:
            return []  # diagnose said why
        chain = speedup_bound(og) < MIN_USEFUL_SPEEDUP
        g, b = obs.nproc, step_batch(obs)
        if chain:  # contiguous stages only, and only where the calibrated model says they pay
            model = step_model(obs, og, source)
            if isinstance(model, str):
                return []
            units = op_units(og, model_graph(obs))
            best = {}
            for m in mp_degrees(obs, opts):
                with contextlib.suppress(ConfigError):  # the stages do not fit: none for this M
                    p = stage_placement(og, obs, m, units)
                    if predict_placement(obs, model, p).per_sample_ratio * MIN_USEFUL_SPEEDUP < 1:
                        best[m] = p
        else:
            best = {m: solve_placement(og, obs, m, opts) for m in mp_degrees(obs, opts)}
            best = {m: p for m, p in best.items() if p.speedup >= MIN_USEFUL_SPEEDUP}
            model = step_model(obs, og, source) if best else None
        if not best:
            return []  # the best placements barely split: M devices would do one's work
        graph = model_graph(obs)
        grad_bytes = sum(lay.param_bytes for lay in graph.layers.values())
        step_1 = paper_step_1(obs, opts, og, grad_bytes)
        se = scaling(obs, opts, step_1, grad_bytes)
        widths = sorted({g // m for m in [1, *best]} | set(opts.extra_widths) | {1})
        epochs = epoch_table(obs, opts, widths)
        out: list[Candidate] = []
        for m, ilp in best.items():
            for p in [ilp] if chain else alternatives(og, obs, m, ilp):
                out.append(self._candidate(obs, m, p, model, step_1, se, source))
        if epochs is not None:
            su = {1: 1.0}
            for c in out:  # the best SU^M of each M (calibrated where the model has one)
                m = c.details["mp_degree"]
                su[m] = max(su.get(m, 0.0), c.details.get("su_m_calibrated", c.details["su_m"]))
            decision = decide(g, su, epochs, se)
            for c in out:
                row = next(r for r in decision.rows if r.mp == c.details["mp_degree"])
                ttc = row.speedup / decision.best_dp.speedup
                c.details.update(
                    decision=decision.to_dict(),
                    epochs_source=epochs.source,
                    time_to_converge_vs_best_dp=ttc,
                )
                c.rationale += f"; time to converge {ttc:.3f}x the best DP scale ({decision.best_dp.dp} devices)"
        out.sort(key=lambda c: candidate_order(c, b))
        return out[:limit]

    def _candidate(self, obs, m, p, model, step_1, se, source) -> Candidate:
        """One N × M placement with the calibrated prediction (or why there is none)."""
        g, b = obs.nproc, step_batch(obs)
        n = g // m
        details: dict[str, Any] = {
            "mp_degree": m,
            "dp_degree": n,
            "global_batch": n * b,
            "su_m": p.speedup,
            "paper_step_s": step_1 / p.speedup / se(n),
            "placer": p.method,
            "times": source,
            "placement": p.to_dict(),
            "summary": format_summary(p),
            "gantt": format_gantt(p),
        }
        head = f"{n} x {m}, {PLACER_NAMES.get(p.method, p.method)}: model: " + format_summary(p)
        knobs = {"mp_degree": m, "placement": encode_placement(p)}
        if isinstance(model, str):
            return Candidate(
                knobs, None, f"{head}; no prediction: {model}", details, global_batch=n * b
            )
        pred = predict_placement(obs, model, p)
        details["calibrated"] = pred.to_dict()
        details["su_m_calibrated"] = calibrated_su(model, pred)
        ex = pred.mp_step
        rationale = (
            f"{head}; calibrated: {pred.step_s * 1e3:.0f} ms per step of {n * b} samples "
            f"({pred.per_sample_ratio:.2f}x the baseline's time per sample): executor "
            f"{ex.makespan_s * 1e3:.0f} ms over {ex.segments} segments, {ex.transfers} messages "
            f"({ex.transfer_bytes / 1e6:.1f} MB, {ex.transfer_s * 1e3:.0f} ms on the link)"
        )
        return Candidate(
            knobs,
            pred.step_s,
            rationale,
            details,
            predicted_range_s=pred.range_s,
            global_batch=n * b,
        )

    # -- runtime ---------------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        m = int(knobs["mp_degree"])
        if m == 1:
            return
        if session.world_size % m:
            raise ConfigError(
                f"hybrid_mp.mp_degree={m} must divide the number of ranks ({session.world_size})"
            )
        plan = None
        if session.rank == 0:
            given = decode_placement(knobs["placement"])
            if given["devices"]:
                plan = placement_nodes(session_graph(session), given, m)
            else:
                plan = worker_plan(session, m, knobs["placer"], float(knobs["time_limit_s"]))
        plan = broadcast_object(plan, src=0, group=session.group)
        install_hybrid(session, plan["node_device"], m, plan["order"])

    # -- reporting ---------------------------------------------------------------------------------

    def explain(self, candidate: Candidate) -> str | None:
        """The placement's schedule and table, and the decision table when E_N was known."""
        d = candidate.details
        if "placement" not in d:
            return None
        parts = [
            f"**{d['dp_degree']} x {d['mp_degree']}** (data x model), global batch "
            f"{d['global_batch']}. Model: {d['summary']}",
            calibrated_text(d.get("calibrated"), candidate.rationale),
            "Schedule (one line per device; upper case forward, lower case backward):",
            "```\n" + d["gantt"] + "\n```",
            "Placement (first 20 ops, times in ms):",
            "```\n" + format_placement_table(d["placement"], max_rows=20) + "\n```",
        ]
        if "decision" in d:
            parts += [
                f"Hybrid decision (E_N from {d.get('epochs_source', 'the table')}; Eq. 6):",
                "```\n" + format_decision_table(d["decision"]) + "\n```",
            ]
        return "\n\n".join(parts)


def calibrated_text(calibrated: Mapping[str, Any] | None, rationale: str) -> str:
    """The calibrated prediction of a candidate, part by part (or why there is none)."""
    if not calibrated:
        why = rationale.split("no prediction: ", 1)
        return "No calibrated prediction" + (f": {why[1]}." if len(why) > 1 else ".")
    ex = calibrated["mp_step"]
    busy = ", ".join(f"device {k} {v * 1e3:.0f} ms" for k, v in ex["busy_s"].items())
    return (
        f"Calibrated on the measured baseline: **{calibrated['step_s'] * 1e3:.0f} ms** per step "
        f"({calibrated['range_s'][0] * 1e3:.0f}-{calibrated['range_s'][1] * 1e3:.0f} ms) for "
        f"{calibrated['global_batch']} samples, {calibrated['per_sample_ratio']:.2f}x the "
        f"baseline's time per sample. The executor's forward and backward take "
        f"{ex['makespan_s'] * 1e3:.0f} ms ({busy} of work; {ex['segments']} segments, "
        f"{ex['transfers']} messages of {ex['transfer_bytes'] / 1e6:.1f} MB, its own costs "
        f"{ex['overhead_s'] * 1e3:.0f} ms); gradient exchange {calibrated['grad_sync_s'] * 1e3:.1f} ms, "
        f"optimizer {calibrated['optimizer_s'] * 1e3:.1f} ms."
    )
