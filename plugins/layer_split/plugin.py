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

import json
from collections.abc import Mapping
from typing import Any

import torch

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.errors import ConfigError, PluginError
from tunekit.observe.observation import Observation
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
    plan_details,
    render_markdown,
)
from tunekit.runtime.session import Session

NAMED_PLANS = ("image", "owt")


def check_plan(text: str) -> None:
    """A named plan, or a JSON object of layer -> config label (``{"conv1": "n2", "fc1": "c2"}``).

    Whether the layers exist is checked when the plan is applied to a model.
    """
    if text in NAMED_PLANS:
        return
    if not text.lstrip().startswith("{"):
        raise ConfigError(f"plan must be one of {', '.join(NAMED_PLANS)} or a JSON object, not {text[:40]!r}")
    decode_plan(text)


class LayerSplit(Tuner):
    name = "layer_split"
    title = "Per-layer sample/channel/spatial splits (DeePa)"
    aspect = Aspect.PLACEMENT
    excludes = frozenset({Aspect.GRAD_SYNC})

    def __init__(self, options: CostOptions | None = None):
        self.options = options or CostOptions()
        self._memo: dict[int, tuple[Observation, Tables, dict[str, Plan]]] = {}
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
        if obs.graph is not None:
            return obs.graph
        from tunekit.observe.graph import trace_model

        inputs = obs.workload.example_batch(2)[0]
        return trace_model(obs.workload.model(), inputs)

    def tables(self, obs: Observation) -> Tables:
        """Eq. 1's tables for the observed job (memoised per observation)."""
        return self._analyse(obs)[0]

    def _analyse(self, obs: Observation) -> tuple[Tables, dict[str, Plan]]:
        memo = self._memo.get(id(obs))
        if memo is not None and memo[0] is obs:
            return memo[1], memo[2]
        graph = self._graph(obs)
        specs = specs_from_graph(graph, obs.global_batch)
        hw, ndev = obs.hardware, obs.nproc
        spaces, self.unsupported = runnable_spaces(obs.workload.model(), graph, specs, ndev)
        if hw.source in ("local", "probe"):
            compute, spaces, source = measured_compute(obs, graph, specs, spaces)
        else:
            compute, source = (
                analytic_compute(hw, self.options),
                (
                    f"analytic ({self.options.efficiency:.0%} of {hw.devices[0].peak_flops / 1e12:.3g} TFLOP/s)"
                ),
            )
        tables = build_tables(specs, hw, ndev, self.options, compute, source, spaces)
        plans = compare(tables)
        self._memo = {id(obs): (obs, tables, plans)}
        return tables, plans

    # -- diagnose / plan ---------------------------------------------------------------

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2:
            return Diagnosis(False, "one device: there is nothing to split")
        # -- training features (issue 17) --
        from tunekit.plugins.layer_split.runtime import LAYER_SPLIT_DECLINES, LAYER_SPLIT_HANDLES
        from tunekit.runtime.sync import declined_features

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
        tables, plans = self._analyse(obs)
        if self.unsupported:
            return Diagnosis(
                False,
                f"cannot execute this model: {self.unsupported[0]}",
                details={"unsupported": self.unsupported},
            )
        best, image = plans["best"], plans["image"]
        gain = max(0.0, 1.0 - best.cost_s / image.cost_s) if image.cost_s > 0 else 0.0
        t = image.totals()
        share = t["update_s"] / t["total_s"] if t["total_s"] else 0.0
        changed = [
            r
            for r in best.rows
            if r.config != image.configs[r.layer] and r.kind not in ("input", "output")
        ]
        return Diagnosis(
            applies=gain > 0.0,
            summary=(
                f"image parallelism: {image.cost_s * 1e3:.1f} ms/step predicted, "
                f"{share:.0%} of it gradient sync; a per-layer plan re-splits {len(changed)} "
                f"of {len(best.rows) - 2} layers for {best.cost_s * 1e3:.1f} ms "
                f"({image.cost_s / best.cost_s:.2f}x)"
            ),
            expected_gain=gain,
            details=plan_details(plans, tables),
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2:
            return []
        tables, plans = self._analyse(obs)
        if self.unsupported:
            return []
        image_cost = plans["image"].cost_s
        out: list[Candidate] = []
        seen: set[str] = set()
        for space in ("best", "image_search", "owt"):
            p = plans[space]
            knob = "owt" if space == "owt" else p.encode()
            key = json.dumps({k: c.label() for k, c in p.configs.items()}, sort_keys=True)
            if key in seen or p.configs == plans["image"].configs:
                continue
            seen.add(key)
            out.append(
                Candidate(
                    knobs={"plan": knob},
                    predicted_step_s=p.cost_s,
                    rationale=(
                        f"{SPACE_TITLES[space]}: {p.cost_s * 1e3:.1f} ms/step by Eq. 1 "
                        f"({image_cost / p.cost_s:.2f}x over image parallelism)"
                    ),
                    details=plan_details(plans, tables, focus=space),
                )
            )
        out.sort(key=lambda c: c.predicted_step_s)
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


def measured_compute(obs: Observation, graph, specs, spaces):
    """compute(v, c) timed on this machine (``time_layer_split``), cached in the study store.

    Each slice runs with the threads one rank gets on this host. Configs the
    timer cannot run are dropped from the layer's space.
    """
    from tunekit.observe.layer_profile import SplitTimer

    threads = (
        max(1, (obs.hardware.host.cores or 1) // max(obs.nproc, 1))
        if obs.device_type == "cpu"
        else None
    )
    key = f"layer_split:compute:{graph.graph_hash()}:{obs.global_batch}:{obs.nproc}:{threads}"
    cached = obs.cache.get(key) if obs.cache is not None else None
    table: dict[str, dict[str, float | None]] = cached or {}
    missing = [
        (v, c)
        for v, cs in spaces.items()
        for c in cs
        if specs[v].kind not in ("input", "output") and c.label() not in table.get(v, {})
    ]
    if missing:
        old_threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            timer = SplitTimer(
                obs.workload.model(),
                graph,
                batch_size=obs.global_batch,
                device="cuda" if obs.device_type == "cuda" else "cpu",
            )
            for v, cfg in missing:
                try:
                    seconds: float | None = timer.time(v, cfg.degrees).total_s
                except ValueError:
                    seconds = None
                table.setdefault(v, {})[cfg.label()] = seconds
        finally:
            torch.set_num_threads(old_threads)
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

    where = "measured on this machine" + (f", {threads} thread(s) per rank" if threads else "")
    return compute, kept, where


__all__ = ["LayerSplit", "allowed", "check_plan"]
