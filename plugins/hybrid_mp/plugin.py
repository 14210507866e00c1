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

import contextlib
import hashlib
import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tunekit.api import (
    LayerProfile,
    Observation,
    Session,
    broadcast_object,
    graph_units,
    intra_op_threads,
    time_steps,
)
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.calibrated import (
    ExecutorOverheads,
    HybridPrediction,
    HybridStepModel,
    copies_on_cores,
)
from tunekit.plugins.hybrid_mp.convergence import (
    allreduce_model,
    estimate_noise_scale,
    measure_epochs,
    noise_scale_epochs,
)
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import (
    EpochTable,
    OpGraph,
    decide,
    eq6_threshold,
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
from tunekit.plugins.hybrid_mp.runtime import SplitProgram, build_program, install_hybrid
from tunekit.plugins.hybrid_mp.schedule import (
    Placement,
    device_order_key,
    improve,
    list_schedule,
)
from tunekit.plugins.hybrid_mp.search import (
    PlacerOptions,
    pipeline_placement,
    place,
    speedup_bound,
)

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
    from tunekit.api import trace_model

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
    """DLPlacer's op graph of the job, and where Δ(k) came from (``measured``,
    ``measured (CPU time)`` or ``analytic``)."""
    graph = model_graph(obs)
    b = obs.workload.batch_size
    state = optimizer_state_factor(
        type(obs.workload.optimizer([torch.zeros(1, requires_grad=True)], 1.0)).__name__
    )
    prof = usable_profile(obs)
    if prof is not None:
        # measured at the profile's batch; op_graph_from_model scales from the graph's batch
        rescale = graph.batch_size / prof.batch_size
        measured = {
            name: (t.forward_s * rescale, t.backward_s * rescale) for name, t in prof.layers.items()
        }
        og = op_graph_from_model(
            graph, measured=measured, peak_flops=_peak(obs), batch_size=b, state_factor=state
        )
        return og, profile_source(prof)
    og = op_graph_from_model(
        graph,
        peak_flops=_peak(obs),
        efficiency=opts.compute_efficiency,
        batch_size=b,
        state_factor=state,
    )
    return og, "analytic"


def usable_profile(obs: Observation):
    """The observation's layer profile when it was measured on this machine, else None."""
    prof = obs.layer_profile
    if prof is None or prof.hardware_fingerprint not in (
        "",
        obs.hardware.fingerprint(),
    ):
        return None
    return prof


def profile_source(prof: LayerProfile) -> str:
    """Where Δ(k) came from: ``measured`` (wall clock) or ``measured (CPU time)``.

    The core times layers of CPU ranks on the thread's CPU clock where it can (the
    profile's ``clock``), so a shared machine's preemption does not skew them layer by
    layer; the calibration then scales that work to the measured compute.
    """
    return "measured" if prof.clock == "wall" else "measured (CPU time)"


def _peak(obs: Observation) -> float:
    return obs.hardware.devices[0].peak_flops


def epoch_table(obs: Observation, opts: HybridOptions, widths: list[int]) -> EpochTable | None:
    """E_N from the workload's table, the gradient noise scale, or short measured runs."""
    if opts.epochs_from == "table":
        return EpochTable(opts.epochs, source="user") if opts.epochs else None
    if opts.epochs_from == "noise_scale":
        noise = estimate_noise_scale(obs.workload)
        return noise_scale_epochs(noise.b_noise, step_batch(obs), widths)
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
    digest = hashlib.sha256(
        json.dumps(
            [og.to_dict(), hw.devices, hw.memory, [a.__dict__ for a in hw.arcs]], sort_keys=True
        ).encode()
    ).hexdigest()[:20]
    return obs.cached(
        f"hybrid_mp:placement:{digest}:{opts.gap}",
        lambda: place(og, hw, PlacerOptions(time_limit_s=opts.time_limit_s, gap=opts.gap)),
        encode=Placement.to_dict,
        decode=Placement.from_dict,
    )


# -- the calibrated prediction ------------------------------------------------------------------

PLACER_NAMES = {
    "ilp": "DLPlacer's ILP",
    "ilp+blocks": "DLPlacer's ILP",
    "list": "list schedule",
    "pipeline": "contiguous stages",
    "single": "one device",
}
OVERHEADS_KEY = "hybrid_mp:executor_overheads"
OWN_COMPUTE_KEY = "hybrid_mp:own_compute_s"


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


def step_model(obs: Observation, og: OpGraph, source: str) -> HybridStepModel | str:
    """The calibrated step model of this job, or why there is none."""
    why = HybridStepModel.missing(obs.truth, obs.hardware)
    if why is not None:
        return why
    overheads = obs.cached(  # diagnose and plan quote the same measurement
        OVERHEADS_KEY,
        ExecutorOverheads.measure,
        encode=ExecutorOverheads.to_dict,
        decode=lambda hit: ExecutorOverheads(**hit),
    )
    threads = threads_per_rank(obs)
    own = None
    if copies_on_cores(obs.hardware, obs.nproc, threads):
        own = own_compute_s(obs, threads)
    return HybridStepModel.build(
        truth=obs.truth,
        graph=model_graph(obs),
        og=og,
        times_source=source,
        hardware=obs.hardware,
        world=obs.nproc,
        batch_size=obs.workload.batch_size,
        accumulation=obs.workload.accumulation,
        spread_s=obs.baseline.spread_s if obs.baseline is not None else 0.0,
        allreduce=allreduce_model(obs.hardware),
        overheads=overheads,
        threads_per_rank=threads,
        own_compute_s=own,
    )


def own_compute_s(obs: Observation, threads: int) -> float:
    """The job's forward and backward at its batch (its micro-batches), timed in this process
    alone with a rank's threads (median of three after a warm-up; cached per observation):
    the model's own compute, which the baseline's measured compute exceeds by what ran
    beside it on the same cores."""

    def measure() -> float:
        b = obs.workload.batch_size
        with intra_op_threads(threads):
            timing = time_steps(obs.workload, (b,), repeats=3)
        return statistics.median(timing.part_samples("compute")[b]) * obs.workload.accumulation

    return obs.cached(OWN_COMPUTE_KEY, measure, decode=float)


def step_batch(obs: Observation) -> int:
    """Samples a data-parallel replica trains per optimizer step: the batch times the
    micro-batches accumulated (B in the paper's global batch N × B)."""
    return obs.workload.batch_size * obs.workload.accumulation


def threads_per_rank(obs: Observation) -> int:
    """Intra-op threads of each rank: as the layers were timed, else the host's share."""
    prof = obs.layer_profile
    if prof is not None and prof.torch_threads:
        return prof.torch_threads
    return max(1, obs.hardware.host.cores // max(obs.nproc, 1))


def executor_program(
    obs: Observation, model: torch.nn.Module, placement: Placement
) -> SplitProgram:
    """The segments the executor will run for ``placement`` (as a trial builds them)."""
    plan = nodes_of(model_graph(obs), placement)
    return build_program(model, plan["node_device"], plan["order"], len(placement.devices))


def param_bytes_of(model: torch.nn.Module) -> dict[int, float]:
    return {id(p): float(p.numel() * p.element_size()) for p in model.parameters()}


def predict_placement(
    obs: Observation, model: HybridStepModel, placement: Placement
) -> HybridPrediction:
    net = obs.workload.model()
    return model.predict(executor_program(obs, net, placement), param_bytes_of(net))


def calibrated_su(model: HybridStepModel, pred: HybridPrediction) -> float:
    """SU^M as measured units give it: one device's step of B samples (the baseline without
    its exposed exchange) over the M-device worker's step (without the replicas' exchange)."""
    truth = model.truth
    one_device = truth.step_s - truth.parts_s["comm_exposed"]
    worker = pred.step_s - pred.grad_sync_s
    return one_device / worker if worker > 0 else 1.0


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


def quick_placement(og: OpGraph, obs: Observation, m: int) -> Placement:
    """A fast placement for the diagnosis: list scheduling (DLPlacer's starting point)."""
    hw = HardwareGraph.from_hardware(obs.hardware, m)
    quick = list_schedule(og, hw)
    return quick if quick is not None else solve_placement(og, obs, m, HybridOptions.of(obs))


def op_units(og: OpGraph, graph) -> dict[str, str] | None:
    """Op -> the transformer block it lies in (its own name outside one), or None when the
    model has no transformer blocks (:func:`tunekit.observe.blocks.graph_units`)."""
    units = graph_units(graph)
    if units is None:
        return None
    return {op.name: units.get(op.members[0], op.name) for op in og.ops}


def stage_placement(
    og: OpGraph, obs: Observation, m: int, units: Mapping[str, str] | None
) -> Placement:
    """Contiguous stages on ``m`` devices, cut between the ``units`` (:func:`op_units`: the
    transformer blocks) where the model has them: what model parallelism can do with a chain."""
    return pipeline_placement(og, HardwareGraph.from_hardware(obs.hardware, m), units)


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


def alternatives(og: OpGraph, obs: Observation, m: int, best: Placement) -> list[Placement]:
    """DLPlacer's placement, then the list schedule it starts from and contiguous stages
    (the paper's comparison with a placement by hand), where they differ from it."""
    hw = HardwareGraph.from_hardware(obs.hardware, m)
    found = [best]
    start = list_schedule(og, hw)
    if start is not None:
        found.append(improve(og, hw, start))
    try:
        found.append(stage_placement(og, obs, m, op_units(og, model_graph(obs))))
    except ConfigError:
        pass  # the stages do not fit: DLPlacer's placement is the only one
    out: list[Placement] = []
    for p in found:
        if p.devices_used > 1 and all(p.assignment != q.assignment for q in out):
            out.append(p)
    return out


def paper_step_1(obs: Observation, opts: HybridOptions, og: OpGraph, grad_bytes: float) -> float:
    """T_1, one device's step as the paper's decision takes it: the measured G-rank baseline
    less its modelled gradient exchange (T_G = T_1 + all-reduce), or Σ Δ(k)."""
    if obs.baseline is None:
        return og.serial_time()
    step_1 = obs.baseline.median_s
    if opts.scaling_efficiency == "model":
        exchange = allreduce_model(obs.hardware)(grad_bytes, obs.nproc)
        step_1 = max(step_1 - exchange, 0.05 * step_1)
    return step_1


def candidate_order(c: Candidate, batch: int) -> tuple:
    """Time to converge when E_N is known, else predicted time per sample (unpredicted last)."""
    if "time_to_converge_vs_best_dp" in c.details:
        return (0, -c.details["time_to_converge_vs_best_dp"])
    if c.predicted_step_s is None:
        return (2, -c.details["su_m"])
    return (1, c.predicted_step_s / (c.global_batch or batch))


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
        model = step_model(obs, og, source)
        if isinstance(model, str):
            text += f"; no calibrated prediction: {model}"
        else:
            pred = predict_placement(obs, model, quick)
            details["calibrated"] = {**model.to_dict(), "prediction": pred.to_dict()}
            text += "; " + expectation(obs, pred, m)
            gain = max(0.0, 1.0 - pred.per_sample_ratio)
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
        elif gain is None or gain == 0.0:
            text += (
                f"; whether {g} devices are better spent on model parallelism depends on "
                f'E_N (epochs at each global batch): give extra["{OPTIONS_KEY}"]["epochs"] or '
                "epochs_from for Eq. 6"
            )
        return Diagnosis(True, text, expected_gain=gain, details=details)

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
            return Diagnosis(False, f"{text}: no calibrated prediction: {model}", details=details)
        pred = predict_placement(obs, model, stages)
        details["calibrated"] = {**model.to_dict(), "prediction": pred.to_dict()}
        text += f", {expectation(obs, pred, m)}"
        gain = 1.0 - pred.per_sample_ratio
        if pred.per_sample_ratio * MIN_USEFUL_SPEEDUP >= 1.0:
            return Diagnosis(
                False,
                f"{text}: the device that waits costs more than the all-reduce it saves",
                details=details,
            )
        return Diagnosis(
            True,
            f"{text}: the all-reduce it saves outweighs the device that waits",
            expected_gain=gain,
            details=details,
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


def _trace(session: Session):
    from tunekit.api import trace_model

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
    from tunekit.api import describe_local_machine

    graph = _trace(session)
    hw = describe_local_machine(m, session.device.type)
    og = op_graph_from_model(
        graph, peak_flops=hw.devices[0].peak_flops, batch_size=session.batch_size
    )
    hwg = HardwareGraph.from_hardware(hw, m)
    if placer == "pipeline":
        p = pipeline_placement(og, hwg, op_units(og, graph))
    else:
        p = place(og, hwg, PlacerOptions(time_limit_s=time_limit_s))
    return nodes_of(graph, p)


def nodes_of(graph, placement: Placement) -> dict[str, Any]:
    """Per fx node: the model-parallel index and the planned start of its layer's op."""
    given = decode_placement(encode_placement(placement))
    return placement_nodes(graph, given, len(placement.devices))
