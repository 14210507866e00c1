"""layer_split: DeePa's per-layer parallelism over sample, channel, height and width.

After Jia et al., "Exploring Hidden Dimensions in Parallelizing Convolutional
Neural Networks" (DeePa). Each layer gets its own split of its output tensor;
the optimum of the paper's cost model (Eq. 1) is found exactly by node and
edge elimination (``tunekit.search.elimination``) and applied in real
training by this plugin's executor, which also synchronises the gradients
(so the tuner excludes the ``grad_sync`` aspect).

The plan is one knob, ``plan``: ``image`` (image parallelism, the untuned
behaviour), ``owt`` (Krizhevsky's one weird trick), or a per-layer plan as JSON
(``{"conv1": "n2", "fc1": "c2", ...}``) -- what :meth:`LayerSplit.plan` proposes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tunekit.api import Observation, Session, compose_headline
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.errors import ConfigError, PluginError
from tunekit.plugins.layer_split.calibrated import (
    CalibratedModel,
    ExecutorOverhead,
    exact_tables,
    gradient_bytes,
    measure_executor_overhead,
)
from tunekit.plugins.layer_split.model import (
    CostOptions,
    SplitConfig,
    Tables,
    analytic_compute,
    build_tables,
    config_space,
    specs_from_graph,
)
from tunekit.plugins.layer_split.search import (
    SPACE_TITLES,
    Plan,
    allowed,
    compare,
    decode_plan,
    encode_plan,
    evaluate,
    plan_details,
    render_markdown,
)

NAMED_PLANS = ("image", "owt")

CALIBRATED_LABEL = "model (this executor, calibrated on the measured baseline)"
"""How the calibrated model's figures are introduced in a diagnosis and a rationale: a
model's figure, never to be read as a measurement (Eq. 1's are "model (Eq. 1, paper)")."""


def check_plan(text: str) -> None:
    """A named plan, or a JSON object of layer -> config label (``{"conv1": "n2", "fc1": "c2"}``).

    Whether the layers exist is checked when the plan is applied to a model.
    """
    if text in NAMED_PLANS:
        return
    if not text.lstrip().startswith("{"):
        raise ConfigError(
            f"plan must be one of {', '.join(NAMED_PLANS)} or a JSON object, not {text[:40]!r}"
        )
    decode_plan(text)


class LayerSplit(Tuner):
    name = "layer_split"
    title = "Per-layer sample/channel/spatial splits (DeePa)"
    aspect = Aspect.PLACEMENT
    excludes = frozenset({Aspect.GRAD_SYNC})

    def __init__(self, options: CostOptions | None = None):
        self.options = options or CostOptions()
        self.unsupported: list[str] = []
        """Why the executor cannot run some layers of the last analysed model (empty: it can)."""

    def knobs(self) -> list[Knob]:
        return [
            Knob(
                "plan",
                "str",
                "image",
                "image | owt | per-layer JSON {layer: config like n2, c2, h2w2}",
                parse=check_plan,
            )
        ]

    # -- observe ------------------------------------------------------------------------

    def _graph(self, obs: Observation):
        """The traced model with each attention core one layer (:func:`split_graph`)."""
        from tunekit.plugins.layer_split.units import split_graph

        if obs.graph is not None:
            return split_graph(obs.graph)
        from tunekit.api import trace_model

        inputs = obs.workload.example_batch(2)[0]
        return split_graph(trace_model(obs.workload.model(), inputs))

    def tables(self, obs: Observation) -> Tables:
        """Eq. 1's tables for the observed job (memoised per observation)."""
        return self.analyse(obs).tables

    def analyse(self, obs: Observation) -> Analysis:
        """Eq. 1's tables and plans, and the calibrated model when this machine was measured
        (once per observation; ``unsupported`` then says what the executor cannot run)."""
        analysis = obs.memo(f"{self.name}:analysis", lambda: self._analyse(obs))
        self.unsupported = analysis.unsupported
        return analysis

    def _analyse(self, obs: Observation) -> Analysis:
        graph = self._graph(obs)
        specs = specs_from_graph(graph, obs.global_batch)
        hw, ndev = obs.hardware, obs.nproc
        spaces, unsupported = runnable_spaces(obs.workload.model(), graph, specs, ndev)
        local = hw.source in ("local", "probe")
        if local:
            compute, spaces, source = measured_compute(obs, graph, specs, spaces)
            untimed = [v for v, cs in spaces.items() if not cs]
            for v in untimed:  # refused by name, not "node has no configurations"
                unsupported.append(
                    f"layer_split: layer {v!r} ({specs[v].kind}): the split timer cannot run "
                    "any of its configs on this machine"
                )
                spaces[v] = [SplitConfig()]
            if untimed:
                timed = compute

                def compute(spec, cfg, timed=timed, untimed=frozenset(untimed)):
                    return 0.0 if spec.name in untimed else timed(spec, cfg)
        else:
            compute, source = (
                analytic_compute(hw, self.options),
                (
                    f"analytic ({self.options.efficiency:.0%} of {hw.devices[0].peak_flops / 1e12:.3g} TFLOP/s)"
                ),
            )
        tables = build_tables(specs, hw, ndev, self.options, compute, source, spaces)
        plans = compare(tables)
        calibrated, why = None, ""
        if not local:
            why = f"planning for the {hw.name} profile, not this machine: Eq. 1 uncalibrated"
        elif obs.truth is None:
            why = "no measured baseline to calibrate on"
        elif not unsupported:
            calibrated = calibrated_model(obs, graph, tables)
        return Analysis(tables, plans, calibrated, why, unsupported)

    # -- diagnose / plan ---------------------------------------------------------------

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2:
            return Diagnosis(False, "one device: there is nothing to split")
        # -- training features (issue 17) --
        from tunekit.api import declined_features
        from tunekit.plugins.layer_split.runtime import LAYER_SPLIT_DECLINES, LAYER_SPLIT_HANDLES

        if why := declined_features(
            obs.workload.features(), LAYER_SPLIT_HANDLES, LAYER_SPLIT_DECLINES
        ):
            return Diagnosis(False, why)
        # --
        graph = self._graph(obs)
        if graph.method != "fx":
            return Diagnosis(False, f"needs the model as a torch.fx graph: {graph.notice}")
        if not any(lay.kind in ("conv", "linear") for lay in graph.layers.values()):
            return Diagnosis(False, "no conv or linear layers to split")
        analysis = self.analyse(obs)
        if analysis.unsupported:
            return Diagnosis(
                False,
                f"cannot execute this model: {analysis.unsupported[0]}",
                details={"unsupported": analysis.unsupported},
            )
        paper = paper_summary(analysis.plans)
        details = plan_details(analysis.plans, analysis.tables)
        cal = analysis.calibrated
        if cal is None:
            best, image = analysis.plans["best"], analysis.plans["image"]
            gain = max(0.0, 1.0 - best.cost_s / image.cost_s) if image.cost_s > 0 else 0.0
            return Diagnosis(
                applies=gain > 0.0,
                summary=f"{paper}; {analysis.uncalibrated_why}",
                expected_gain=gain,
                details=details,
            )
        truth = obs.truth
        ranked = analysis.ranked()
        top_label, top_configs = ranked[0]
        predicted = cal.predict(top_configs)
        gain = 1.0 - predicted / truth.step_s
        changes = cal.changes(top_configs)
        overhead = cal.executor_work_s()
        allreduce = cal.model.allreduce_s
        verdict = f"{gain:.0%} faster" if gain > 0 else f"{-gain:.0%} slower"
        # The measured figures come first, quoted from obs.truth; every figure after them is a
        # model's and says which (Eq. 1 as the paper prices DeePa; the calibrated model of this
        # executor, whose baseline is the measured step by construction).
        summary = (
            f"measured: {truth.step_s * 1e3:.1f} ms per step, {truth.phrase('compute')}, "
            f"{truth.phrase('comm_exposed')}; {paper}; {CALIBRATED_LABEL}: the best plan "
            f"({SPACE_TITLES.get(top_label, top_label)}) {predicted * 1e3:.1f} ms per step, "
            f"{verdict} than the measured step (compute {_signed_ms(changes['compute'])}, "
            f"communication {_signed_ms(changes['comm_exposed'])}, data {_signed_ms(changes['data'])}): "
            f"the executor's own per-layer work costs {overhead * 1e3:.1f} ms and its gradient "
            f"all-reduce, which DDP overlaps with backward, {allreduce * 1e3:.1f} ms, exposed"
        )
        details["calibrated"] = cal.describe(top_configs)
        details["calibrated"]["plan"] = top_label
        gain_range = None
        if (rng := cal.calibration.predicted_range(predicted, obs.baseline.spread_s)) is not None:
            gain_range = (1.0 - rng[1] / truth.step_s, 1.0 - rng[0] / truth.step_s)
        return Diagnosis(
            applies=gain > 0.0,
            summary=summary,
            expected_gain=max(0.0, gain),
            details=details,
            headline=compose_headline(
                gain > 0.0, gain, gain_range, truth.phrase("comm_exposed", short=True)
            ),
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2:
            return []
        analysis = self.analyse(obs)
        if analysis.unsupported:
            return []
        plans, cal = analysis.plans, analysis.calibrated
        image_cost = plans["image"].cost_s
        out: list[Candidate] = []
        for label, configs in analysis.ranked():
            paper = evaluate(analysis.tables, configs, label)
            knob = (
                "owt"
                if label == "owt"
                else encode_plan(
                    configs, skip={v for v, s in analysis.tables.specs.items() if s.replicated}
                )
            )
            details = plan_details({label: paper, **plans}, analysis.tables, focus=label)
            details["paper_cost_s"] = paper.cost_s
            if cal is None:
                predicted = paper.cost_s if analysis.profile_planning else None
                rationale = (
                    f"{SPACE_TITLES.get(label, label)}: model (Eq. 1, paper): {paper.cost_s * 1e3:.1f} "
                    f"ms/step ({image_cost / paper.cost_s:.2f}x over image parallelism); "
                    + (
                        "uncalibrated: planned for a hardware profile"
                        if predicted is not None
                        else f"no prediction: {analysis.uncalibrated_why}"
                    )
                )
                range_s = None
            else:
                predicted = cal.predict(configs)
                range_s = cal.calibration.predicted_range(predicted, obs.baseline.spread_s)
                changes = cal.changes(configs)
                details["calibrated"] = cal.describe(configs)
                rationale = (
                    f"{SPACE_TITLES.get(label, label)}: {CALIBRATED_LABEL}: "
                    f"{predicted * 1e3:.1f} ms/step against the measured "
                    f"{obs.truth.step_s * 1e3:.1f} ms (compute {_signed_ms(changes['compute'])}, "
                    f"communication {_signed_ms(changes['comm_exposed'])}, "
                    f"data {_signed_ms(changes['data'])}); "
                    f"model (Eq. 1, paper): {paper.cost_s * 1e3:.1f} ms"
                )
            out.append(
                Candidate(
                    knobs={"plan": knob},
                    predicted_step_s=predicted,
                    rationale=rationale,
                    details=details,
                    predicted_range_s=range_s,
                )
            )
        return out[:limit]

    def explain(self, candidate: Candidate) -> str | None:
        """The per-layer plan table (config, compute, transfer, update) against image-only and OWT."""
        return render_markdown(candidate.details) if candidate.details else None

    # -- runtime -------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        from tunekit.plugins.layer_split.runtime import apply_plan, named_plan

        value = knobs["plan"]
        apply_plan(
            session, named_plan(session, value) if value in NAMED_PLANS else decode_plan(value)
        )


def runnable_spaces(
    model, graph, specs, ndev: int
) -> tuple[dict[str, list[SplitConfig]], list[str]]:
    """Each layer's configs (:func:`config_space`) that the executor can run on this model,
    and why layers it cannot run at all are refused (plans are made only of what
    :meth:`LayerSplit.apply` can carry out)."""
    from tunekit.plugins.layer_split.slices import build_programs

    spaces = {v: config_space(s, ndev) for v, s in specs.items()}
    if graph.method != "fx":
        return spaces, [graph.notice]
    programs, ops = build_programs(model, graph, specs)
    out, problems = {}, []
    for v, configs in spaces.items():
        kept, why = [], ""
        for cfg in configs:
            try:
                ops.check(programs[v], cfg)
            except PluginError as exc:
                why = why or str(exc)
                continue
            kept.append(cfg)
        if not kept:
            problems.append(why)
        out[v] = kept or [SplitConfig()]
    return out, problems


def rank_threads(obs: Observation) -> int | None:
    """Intra-op threads one training rank gets on this host (the launcher's rule); None on a GPU."""
    if obs.device_type != "cpu":
        return None
    return max(1, (obs.hardware.host.cores or 1) // max(obs.nproc, 1))


def measured_compute(obs: Observation, graph, specs, spaces):
    """compute(v, c) timed on this machine (``SplitTimer``), cached in the study store.

    Each slice runs with the threads one rank gets on this host, on the clock
    that makes layer times add up to the step (the thread's CPU time with one
    thread). Configs the timer cannot run are dropped from the layer's space.
    """
    from tunekit.api import effort_repeats, intra_op_threads, timing_clock
    from tunekit.plugins.layer_split.measure import SplitTimer

    threads = rank_threads(obs)
    device = "cuda" if obs.device_type == "cuda" else "cpu"
    # v4: attention cores split by heads (v3: fused attention layers, and per-model constants
    # timed whole; v2 cached them as untimeable, which dropped their consumers' configs)
    key = f"layer_split:compute:v4:{graph.graph_hash()}:{obs.global_batch}:{obs.nproc}:{threads}"
    cached = obs.cache.get(key) if obs.cache is not None else None
    table: dict[str, dict[str, float | None]] = cached or {}
    missing = [
        (v, c)
        for v, cs in spaces.items()
        for c in cs
        if specs[v].kind not in ("input", "output") and c.label() not in table.get(v, {})
    ]
    if missing:
        timer = SplitTimer(
            obs.workload.model(),
            graph,
            batch_size=obs.global_batch,
            device=device,
            threads=threads,
            warmup=effort_repeats(2, 1),
            repeats=effort_repeats(5, 2),
        )
        # head splits last: they reuse the timing of the sample split of as many workers
        for v, cfg in sorted(missing, key=lambda m: bool(specs[m[0]].heads and m[1].h > 1)):
            try:
                seconds: float | None = _time_config(
                    timer, specs[v], cfg, obs.global_batch, table.get(v, {})
                )
            except ValueError:  # a split the timer refuses
                seconds = None
            except RuntimeError:  # a slice torch cannot run: a 3x3 kernel on a 1-row slice
                seconds = None  # of a 2x2 map (the timer slices without padding)
            table.setdefault(v, {})[cfg.label()] = seconds
        if obs.cache is not None:
            obs.cache.put(key, table)
    kept = {
        v: [
            c
            for c in cs
            if specs[v].kind in ("input", "output") or table.get(v, {}).get(c.label()) is not None
        ]
        for v, cs in spaces.items()
    }

    def compute(spec, cfg: SplitConfig) -> float:
        if spec.kind in ("input", "output"):
            return 0.0
        return float(table[spec.name][cfg.label()])

    with intra_op_threads(threads):
        clock = timing_clock(device)[1]
    where = "measured on this machine" + (f", {threads} thread(s) per rank" if threads else "")
    where += ", CPU clock" if clock == "thread_cpu" else ""
    return compute, kept, where


def _time_config(
    timer, spec, cfg: SplitConfig, batch: int, timed: Mapping[str, float | None]
) -> float:
    """One worker's timed forward and backward of ``spec`` under ``cfg``. A head split of an
    attention core does the work of the sample split with as many workers (each head is
    as much work as each sample: the same matmuls on a share of the scores); it is timed
    as that, or as the sample split it refines with its time shared among the heads' workers
    where the batch has too few samples (``timed``: this layer's timings so far)."""
    if not (spec.heads and cfg.h > 1):
        return timer.time(spec.name, cfg.degrees).total_s
    same, share = (
        (SplitConfig(n=cfg.n * cfg.h), 1)
        if cfg.n * cfg.h <= batch
        else (SplitConfig(n=cfg.n), cfg.h)
    )
    seconds = timed.get(same.label())
    if seconds is None:
        seconds = timer.time(spec.name, same.degrees).total_s
    return seconds / share


def executor_overhead(obs: Observation, graph) -> ExecutorOverhead:
    """The executor's own per-step work on one rank (:func:`measure_executor_overhead`), cached."""
    from tunekit.api import effort_repeats, effort_seconds

    threads = rank_threads(obs)
    batch = obs.workload.batch_size
    return obs.cached(
        f"layer_split:executor:v3:{graph.graph_hash()}:{batch}:{threads}",
        lambda: measure_executor_overhead(
            obs.workload,
            graph,
            batch,
            threads=threads,
            device="cuda" if obs.device_type == "cuda" else "cpu",
            block=effort_repeats(6, 3),
            warmup=effort_repeats(2, 1),
            budget_s=effort_seconds(30.0),
            least_rounds=effort_repeats(2, 1),  # a quick look: one round when it is all that fits
        ),
        encode=ExecutorOverhead.to_dict,
        decode=ExecutorOverhead.from_dict,
    )


def calibrated_model(obs: Observation, graph, tables: Tables) -> CalibratedModel:
    """The executor's model of this job (:mod:`~tunekit.plugins.layer_split.calibrated`),
    fitted to the measured baseline."""
    return CalibratedModel.fit(
        obs.truth,
        tables,
        exact_tables(tables, obs.hardware),
        executor_overhead(obs, graph),
        obs.hardware.allreduce_time(gradient_bytes(obs.workload.model()), obs.nproc),
        obs.nproc,
    )


def paper_summary(plans: Mapping[str, Plan]) -> str:
    """The paper's Eq. 1 figures in one clause, labelled as the model's."""
    best, image = plans["best"], plans["image"]
    t = image.totals()
    share = t["update_s"] / t["total_s"] if t["total_s"] else 0.0
    changed = [
        r
        for r in best.rows
        if r.config != image.configs[r.layer] and r.kind not in ("input", "output")
    ]
    return (
        f"model (Eq. 1, paper): image parallelism {image.cost_s * 1e3:.1f} ms/step, "
        f"{share:.0%} of it gradient sync; a per-layer plan re-splitting {len(changed)} of "
        f"{len(best.rows) - 2} layers {best.cost_s * 1e3:.1f} ms "
        f"({image.cost_s / best.cost_s:.2f}x)"
    )


def _signed_ms(seconds: float) -> str:
    return f"{seconds * 1e3:+.1f} ms"


@dataclass
class Analysis:
    """Everything the tuner derives from one observation."""

    tables: Tables
    plans: dict[str, Plan]
    """Eq. 1's optimum in each space (``best``, ``image_search``, ``image``, ``owt``)."""
    calibrated: CalibratedModel | None
    uncalibrated_why: str = ""
    """Why there is no calibrated model (empty when there is one)."""
    unsupported: list[str] = field(default_factory=list)
    """What the executor cannot run in this model, by layer (empty: it runs all of it)."""

    @property
    def profile_planning(self) -> bool:
        """Planning for a hardware profile: Eq. 1 is the only model there is."""
        return self.calibrated is None and self.uncalibrated_why.startswith("planning for")

    def ranked(self) -> list[tuple[str, dict[str, SplitConfig]]]:
        """Distinct plans other than image parallelism, best predicted first: the calibrated
        model's optimum (when there is a calibrated model) and Eq. 1's in each space."""
        found: list[tuple[str, dict[str, SplitConfig]]] = []
        if self.calibrated is not None:
            found.append(("calibrated", self.calibrated.best().configs))
        found += [(s, self.plans[s].configs) for s in ("best", "image_search", "owt")]
        image = self.plans["image"].configs
        out, seen = [], []
        for label, configs in found:
            if configs == image or configs in seen:
                continue
            seen.append(configs)
            out.append((label, configs))
        if self.calibrated is not None:
            out.sort(key=lambda lc: self.calibrated.predict(lc[1]))
        else:
            out.sort(key=lambda lc: evaluate(self.tables, lc[1]).cost_s)
        return out


__all__ = ["LayerSplit", "allowed", "check_plan"]
