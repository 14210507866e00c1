"""hybrid_mp: when data × model parallelism beats data parallelism alone, and where each op runs.

After Pal et al., "Optimizing Multi-GPU Parallelization Strategies for Deep
Learning Training" (DLPlacer). For a budget of G devices the tuner scores
every factorisation G = N × M — N-way data parallelism over workers of M
model-parallel devices, global batch N × B — with SU_N^M = SU^M × SE_N × N ×
E_1/E_N (Eq. 5) against the best DP-only scale (Eq. 3, Eq. 6), where SU^M
is the per-step speed-up DLPlacer's ILP predicts for the best placement of
the model's layers on M devices.

Options a workload may give in ``Workload.extra["hybrid_mp"]``:

``epochs``             ``{N: E_N}`` epochs to converge at global batch N × B (Figure 4)
``epochs_from``        ``"table"`` (default: ``epochs``), ``"noise_scale"`` (estimate
                       B_noise from gradients, E_N ∝ 1 + N·B/B_noise) or ``"measure"``
                       (short runs to ``target_loss``, gradient accumulation)
``target_loss``        the loss ``"measure"`` trains to
``scaling_efficiency`` ``"paper"`` (SE_N = 1, the default), ``"model"`` (all-reduce
                       of the gradients fully exposed) or ``{N: SE_N}`` measured
``compute_efficiency`` fraction of peak FLOP/s the analytic Δ(k) assumes (1.0, as the paper)
``time_limit_s``       DLPlacer's time limit per M (60)
``gap``                DLPlacer's target optimality gap (0.01)
``max_mp``             largest M to consider (8)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.errors import ConfigError
from tunekit.observe.observation import Observation
from tunekit.plugins.hybrid_mp.convergence import (
    allreduce_model,
    estimate_noise_scale,
    measure_epochs,
    noise_scale_epochs,
)
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import (
    Decision,
    EpochTable,
    OpGraph,
    decide,
    modelled_scaling_efficiency,
    op_graph_from_model,
    optimizer_state_factor,
    unit_scaling,
)
from tunekit.plugins.hybrid_mp.render import (
    format_decision_table,
    format_gantt,
    format_placement_table,
    format_summary,
)
from tunekit.plugins.hybrid_mp.runtime import install_hybrid
from tunekit.plugins.hybrid_mp.schedule import Placement, device_order_key, list_schedule
from tunekit.plugins.hybrid_mp.search import (
    PlacerOptions,
    pipeline_placement,
    place,
    speedup_bound,
)
from tunekit.runtime.dist import broadcast_object
from tunekit.runtime.session import Session

OPTIONS_KEY = "hybrid_mp"
MIN_USEFUL_SPEEDUP = 1.02


@dataclass
class HybridOptions:
    """The workload's settings for this tuner (``Workload.extra["hybrid_mp"]``)."""

    epochs: dict[int, float] | None = None
    """E_N by data-parallel width N (global batch N × B)."""
    epochs_from: str = "table"
    """``table``, ``noise_scale`` or ``measure``."""
    target_loss: float | None = None
    """The loss ``epochs_from="measure"`` trains to."""
    scaling_efficiency: Any = "paper"
    """``paper`` (SE_N = 1), ``model``, or ``{N: SE_N}``."""
    compute_efficiency: float = 1.0
    """Fraction of peak FLOP/s the analytic Δ(k) assumes."""
    time_limit_s: float = 60.0
    gap: float = 0.01
    max_mp: int = 8
    extra_widths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        where = f'workload extra["{OPTIONS_KEY}"]'
        if self.epochs_from not in ("table", "noise_scale", "measure"):
            raise ConfigError(f"{where}: epochs_from must be table, noise_scale or measure")
        if self.epochs_from == "measure" and self.target_loss is None:
            raise ConfigError(f'{where}: epochs_from="measure" needs target_loss')
        if not (
            self.scaling_efficiency in ("paper", "model")
            or isinstance(self.scaling_efficiency, Mapping)
        ):
            raise ConfigError(f"{where}: scaling_efficiency must be paper, model or {{N: SE_N}}")
        if self.epochs is not None:
            EpochTable(self.epochs)  # validates
        if not 0 < self.compute_efficiency <= 1:
            raise ConfigError(f"{where}: compute_efficiency must be in (0, 1]")
        if self.max_mp < 2:
            raise ConfigError(f"{where}: max_mp must be at least 2")

    @classmethod
    def of(cls, obs_or_workload) -> HybridOptions:
        workload = getattr(obs_or_workload, "workload", obs_or_workload)
        raw = dict((workload.extra or {}).get(OPTIONS_KEY, {}))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f'workload extra["{OPTIONS_KEY}"]: unknown setting {unknown[0]!r}; known: {", ".join(sorted(known))}'
            )
        return cls(**raw)


# -- inputs ---------------------------------------------------------------------------------


def model_graph(obs: Observation, strict: bool = True):
    """The observation's traced graph at the per-rank batch, tracing the model if needed
    (``strict``: refusing any graph but a torch.fx one)."""
    from tunekit.observe.graph import trace_model

    b = obs.workload.batch_size
    graph = obs.graph
    if graph is None:
        x, _ = obs.workload.example_batch(min(b, 2))
        graph = trace_model(obs.workload.model(), x, batch_size=b)
    if strict and graph.method != "fx":
        raise ConfigError(
            f"hybrid_mp needs a torch.fx-traceable model to see its branches ({graph.notice})"
        )
    return graph


def op_graph(obs: Observation, opts: HybridOptions) -> tuple[OpGraph, str]:
    """DLPlacer's op graph of the job, and where Δ(k) came from (``measured``/``analytic``)."""
    graph = model_graph(obs)
    b = obs.workload.batch_size
    state = optimizer_state_factor(
        type(obs.workload.optimizer([torch.zeros(1, requires_grad=True)], 1.0)).__name__
    )
    prof = obs.layer_profile
    usable = prof is not None and getattr(prof, "hardware_fingerprint", "") in (
        "",
        obs.hardware.fingerprint(),
    )
    if usable:
        # measured at the profile's batch; op_graph_from_model scales from the graph's batch
        rescale = graph.batch_size / prof.batch_size
        measured = {
            name: (t.forward_s * rescale, t.backward_s * rescale) for name, t in prof.layers.items()
        }
        og = op_graph_from_model(
            graph, measured=measured, peak_flops=_peak(obs), batch_size=b, state_factor=state
        )
        return og, "measured"
    og = op_graph_from_model(
        graph,
        peak_flops=_peak(obs),
        efficiency=opts.compute_efficiency,
        batch_size=b,
        state_factor=state,
    )
    return og, "analytic"


def _peak(obs: Observation) -> float:
    return obs.hardware.devices[0].peak_flops


def epoch_table(obs: Observation, opts: HybridOptions, widths: list[int]) -> EpochTable | None:
    """E_N from the workload's table, the gradient noise scale, or short measured runs."""
    if opts.epochs_from == "table":
        return EpochTable(opts.epochs, source="user") if opts.epochs else None
    if opts.epochs_from == "noise_scale":
        noise = estimate_noise_scale(obs.workload)
        return noise_scale_epochs(noise.b_noise, obs.workload.batch_size, widths)
    table, _ = measure_epochs(obs.workload, widths, opts.target_loss)
    return table


def scaling(obs: Observation, opts: HybridOptions, step_s: float, grad_bytes: float):
    se = opts.scaling_efficiency
    if se == "paper":
        return unit_scaling
    if se == "model":
        return modelled_scaling_efficiency(step_s, grad_bytes, allreduce_model(obs.hardware))
    table = {int(k): float(v) for k, v in se.items()}
    return lambda n: 1.0 if n <= 1 else table[n] if n in table else _missing_se(n, table)


def _missing_se(n: int, table: dict[int, float]) -> float:
    raise ConfigError(f"scaling_efficiency gives SE_N for N = {sorted(table)}, not N = {n}")


def mp_degrees(obs: Observation, opts: HybridOptions) -> list[int]:
    """The M worth placing: divisors of the budget the hardware has devices for."""
    g = obs.nproc
    cap = min(opts.max_mp, len(obs.hardware.devices), g)
    return [m for m in range(2, cap + 1) if g % m == 0]


def solve_placement(og: OpGraph, obs: Observation, m: int, opts: HybridOptions) -> Placement:
    """DLPlacer on the first ``m`` devices; cached in the study store when there is one."""
    hw = HardwareGraph.from_hardware(obs.hardware, m)
    key = None
    if obs.cache is not None:
        digest = hashlib.sha256(
            json.dumps(
                [og.to_dict(), hw.devices, hw.memory, [a.__dict__ for a in hw.arcs]], sort_keys=True
            ).encode()
        ).hexdigest()[:20]
        key = f"hybrid_mp:placement:{digest}:{opts.gap}"
        hit = obs.cache.get(key)
        if hit is not None:
            return Placement.from_dict(hit)
    p = place(og, hw, PlacerOptions(time_limit_s=opts.time_limit_s, gap=opts.gap))
    if key is not None:
        obs.cache.put(key, p.to_dict())
    return p


# -- the placement as a knob value ----------------------------------------------------------------


def encode_placement(placement: Placement) -> str:
    """A planned placement as the ``placement`` knob's JSON text.

    ``{"devices": {layer: model-parallel index}, "start": {layer: planned start, s},
    "end": {layer: planned end, s}}``: plain data that survives the config file and the
    trip to every worker. Start and end together fix each device's run order, also
    where a zero-duration layer starts when another does.
    """
    index = {d: i for i, d in enumerate(placement.devices)}
    forward = {t.op: t for t in placement.schedule if t.phase == "fwd"}
    devices, start, end = {}, {}, {}
    for op, layers in placement.members.items():
        for layer in layers:
            devices[layer] = index[placement.assignment[op]]
            start[layer] = round(forward[op].start, 12)
            end[layer] = round(forward[op].end, 12)
    return json.dumps({"devices": devices, "start": start, "end": end}, separators=(",", ":"))


def decode_placement(text: str) -> dict[str, dict[str, Any]]:
    """The ``placement`` knob's JSON, checked; empty text means "let the worker plan"."""
    if not text.strip():
        return {"devices": {}, "start": {}, "end": {}}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"placement is not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        raise ConfigError(
            'placement must be a JSON object {"devices": {layer: index}, "start": {...}}'
        )
    devices = data["devices"]
    for layer, idx in devices.items():
        if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
            raise ConfigError(f"placement: layer {layer!r} needs a device index >= 0, not {idx!r}")
    times = {key: data.get(key, {}) for key in ("start", "end")}
    for key, values in times.items():
        if not isinstance(values, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values.values()
        ):
            raise ConfigError(f"placement: {key} must map layers to numbers")
    return {"devices": devices, **times}


def _check_placement(text: str) -> None:
    decode_placement(text)


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
                parse=_check_placement,
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
        opts = HybridOptions.of(obs)
        graph = model_graph(obs, strict=False)
        if graph.method != "fx":  # torch.export/hooks graphs: no fx nodes to place
            return Diagnosis(False, f"needs the model as a torch.fx graph ({graph.notice})")
        og, source = op_graph(obs, opts)
        bound = speedup_bound(og)
        details = {"su_bound": bound, "ops": len(og.ops), "times": source}
        if bound < MIN_USEFUL_SPEEDUP:
            return Diagnosis(
                False,
                f"the model's layers form a chain (critical path = {1 / bound:.0%} of the step): "
                "no branch parallelism for model-parallel workers",
                details=details,
            )
        hw = HardwareGraph.from_hardware(obs.hardware, 2)
        quick = list_schedule(og, hw)
        su2 = quick.speedup if quick is not None else 1.0
        details["su2_list_schedule"] = su2
        epochs = opts.epochs and EpochTable(opts.epochs)
        g = obs.nproc
        if epochs and g % 2 == 0 and epochs.covers(g // 2) and epochs.covers(g):
            from tunekit.plugins.hybrid_mp.model import eq6_threshold

            thr = eq6_threshold(g // 2, 2, epochs)
            wins = su2 > thr
            summary = (
                f"branch parallelism allows SU^M up to {bound:.2f}; a 2-device placement gives "
                f"~{su2:.2f} per step; Eq. 6 needs > {thr:.3f} on {g} devices: "
                + ("hybrid should win" if wins else "data parallelism stays ahead")
            )
            gain = (su2 / thr - 1.0) if wins else 0.0
            return Diagnosis(True, summary, expected_gain=gain, details=details)
        return Diagnosis(
            True,
            f"branch parallelism allows SU^M up to {bound:.2f} (~{su2:.2f} on 2 devices by list "
            f"scheduling); whether {g} devices are better spent on model parallelism depends on "
            f'E_N: give extra["{OPTIONS_KEY}"]["epochs"] or epochs_from',
            details=details,
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2 or len(obs.hardware.devices) < 2:
            return []
        opts = HybridOptions.of(obs)
        graph = model_graph(obs, strict=False)
        if graph.method != "fx":  # torch.export/hooks graphs: no fx nodes to place
            return Diagnosis(False, f"needs the model as a torch.fx graph ({graph.notice})")
        og, source = op_graph(obs, opts)
        if speedup_bound(og) < MIN_USEFUL_SPEEDUP:
            return []
        g, b = obs.nproc, obs.workload.batch_size
        placements = {m: solve_placement(og, obs, m, opts) for m in mp_degrees(obs, opts)}
        if not placements:
            return []
        graph = model_graph(obs)
        grad_bytes = sum(lay.param_bytes for lay in graph.layers.values())
        # T_1, one device's step: the measured G-rank baseline less its modelled gradient
        # exchange (T_G = T_1 + all-reduce), or the op graph's analytic sum.
        step_1 = og.serial_time()
        if obs.baseline is not None:
            step_1 = obs.baseline.median_s
            if opts.scaling_efficiency == "model":
                exchange = allreduce_model(obs.hardware)(grad_bytes, g)
                step_1 = max(step_1 - exchange, 0.05 * step_1)
        se = scaling(obs, opts, step_1, grad_bytes)
        widths = sorted({g // m for m in [1, *placements]} | set(opts.extra_widths) | {1})
        epochs = epoch_table(obs, opts, widths)
        decision: Decision | None = None
        if epochs is not None:
            su = {1: 1.0, **{m: p.speedup for m, p in placements.items()}}
            decision = decide(g, su, epochs, se)
        out = []
        for m, p in placements.items():
            if p.speedup < MIN_USEFUL_SPEEDUP:
                continue  # the best placement barely splits: M devices would do one's work
            n = g // m
            step_s = step_1 / p.speedup / se(n)
            details: dict[str, Any] = {
                "mp_degree": m,
                "dp_degree": n,
                "global_batch": n * b,
                "su_m": p.speedup,
                "times": source,
                "placement": p.to_dict(),
                "summary": format_summary(p),
                "gantt": format_gantt(p),
            }
            rationale = f"{n} x {m}: " + format_summary(p)
            if decision is not None:
                row = next(r for r in decision.rows if r.mp == m)
                details["decision"] = decision.to_dict()
                details["epochs_source"] = epochs.source
                details["time_to_converge_vs_best_dp"] = row.speedup / decision.best_dp.speedup
                rationale += (
                    f"; time to converge {row.speedup / decision.best_dp.speedup:.3f}x the best "
                    f"DP scale ({decision.best_dp.dp} devices)"
                )
            knobs = {"mp_degree": m, "placement": encode_placement(p)}
            out.append(Candidate(knobs, step_s, rationale, details))
        if decision is not None:
            out.sort(key=lambda c: -c.details["time_to_converge_vs_best_dp"])
        else:
            out.sort(key=lambda c: -c.details["su_m"])
        return out[:limit]

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
                plan = placement_nodes(_trace(session), given, m)
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
            f"{d['global_batch']}. {d['summary']}",
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


def _trace(session: Session):
    from tunekit.observe.graph import trace_model

    x, _ = session.workload.example_batch(min(session.batch_size, 2))
    graph = trace_model(session.model, x, batch_size=session.batch_size)
    if graph.method != "fx":
        raise ConfigError(f"hybrid_mp needs a torch.fx-traceable model ({graph.notice})")
    return graph


def placement_nodes(graph, given: Mapping[str, Mapping[str, Any]], m: int) -> dict[str, Any]:
    """The ``placement`` knob's layers mapped onto this model's fx nodes: each node's
    model-parallel index, and its place in the planned order (the midpoint of its layer's
    planned interval, so a zero-duration layer runs when the schedule has it)."""
    devices, start, end = given["devices"], given["start"], given.get("end", {})
    unknown = sorted(set(devices) - set(graph.layers))
    if unknown:
        raise ConfigError(
            f"hybrid_mp.placement names layer {unknown[0]!r}, which this model does not have"
        )
    too_big = [layer for layer, i in devices.items() if i >= m]
    if too_big:
        raise ConfigError(
            f"hybrid_mp.placement puts {too_big[0]!r} on device {devices[too_big[0]]}, "
            f"but mp_degree={m}"
        )
    node_device, order = {}, {}
    for name, node in graph.nodes.items():
        if node.layer in devices:
            node_device[name] = int(devices[node.layer])
            if node.layer in start:
                begin = float(start[node.layer])
                order[name] = device_order_key(begin, float(end.get(node.layer, begin)))
    return {"node_device": node_device, "order": order}


def worker_plan(session: Session, m: int, placer: str, time_limit_s: float) -> dict[str, Any]:
    """The placement a worker computes for itself: traced model, this machine's devices.

    Returns plain data every rank can use: fx node -> model-parallel index,
    and each node's place in the planned execution order.
    """
    from tunekit.observe.local import describe_local_machine

    graph = _trace(session)
    hw = describe_local_machine(m, session.device.type)
    og = op_graph_from_model(
        graph, peak_flops=hw.devices[0].peak_flops, batch_size=session.batch_size
    )
    hwg = HardwareGraph.from_hardware(hw, m)
    if placer == "pipeline":
        p = pipeline_placement(og, hwg)
    else:
        p = place(og, hwg, PlacerOptions(time_limit_s=time_limit_s))
    return nodes_of(graph, p)


def nodes_of(graph, placement: Placement) -> dict[str, Any]:
    """Per fx node: the model-parallel index and the planned start of its layer's op."""
    given = decode_placement(encode_placement(placement))
    return placement_nodes(graph, given, len(placement.devices))
