"""The step model filled from one observation and fitted to its measured baseline.

What comes from where:

* per-sample forward and backward time of each block and of the root, from the layer
  profile (its layers mapped to the blocks they run in), scaled so that their sum is the
  per-sample slope of the step line timed here (:mod:`.measure`), and what FSDP adds to a
  pass (timed here on one rank); selective
  checkpointing's recomputation is a block's forward time outside its matrix
  multiplications and convolutions;
* parameter bytes per FSDP unit, from the core memory facts (``obs.memory``);
* all-reduce, all-gather and reduce-scatter from the probed collective fits
  (``obs.hardware``), host copies from its ``h2d``/``d2h`` fits;
* the measured baseline (``obs.truth``): the model is evaluated for the job's own layout
  and micro-batches, its collectives are slowed by the factor that makes their total the
  measured ``comm_total`` (collectives run slower beside a job's compute than on the idle
  probe), then :class:`tunekit.api.Calibration` scales compute, exposed communication and
  the optimizer to the measured parts. A candidate is the measured step plus each part's
  scaled change; data loading and idle time carry over.

Peak memory per rank comes from the core memory model (``obs.predict_memory``),
calibrated on the baseline's measured peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tunekit.api import (
    Calibration,
    Layout,
    MemoryPrediction,
    Observation,
    StepTruth,
)
from tunekit.plugins.sharding.measure import PassLine, fsdp_overhead, pass_line
from tunekit.plugins.sharding.model import PARTS, Collectives, Setting, StepModel, Unit, Wire

SAVED_KINDS = frozenset({"linear", "conv"})
"""Layer kinds whose outputs selective checkpointing keeps (not recomputed)."""
COMM_FACTOR_LIMITS = (0.2, 50.0)
"""Range of the collectives' slow-down beside compute that calibration accepts."""
UNKNOWN_LINK = Wire(1e-4, 1e9)
"""An all-reduce when the hardware has neither a probed fit nor links to model one."""
PROBE_SIZE = 64 * 2**20
"""Bytes at which a modelled all-reduce is sampled for its bandwidth (no probe fit)."""


@dataclass(frozen=True)
class Prediction:
    """One setting, predicted: its step (with a range) and its peak memory per rank."""

    setting: Setting
    step_s: float
    range_s: tuple[float, float]
    parts: dict[str, float]
    """The calibrated step's parts (seconds): compute, comm_exposed, optimizer, other."""
    memory: MemoryPrediction | None
    recompute_s: float
    """Seconds per step of recomputation (checkpointing)."""
    comm_total_s: float

    @property
    def peak_bytes(self) -> float | None:
        return self.memory.peak_bytes if self.memory is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "setting": self.setting.describe(),
            "layout": self.setting.layout.to_dict(),
            "micro_batches": self.setting.micro_batches,
            "micro_batch": self.setting.micro_batch,
            "step_s": self.step_s,
            "range_s": list(self.range_s),
            "parts": self.parts,
            "recompute_s": self.recompute_s,
            "comm_total_s": self.comm_total_s,
            "memory": self.memory.to_dict() if self.memory is not None else None,
        }


@dataclass
class CalibratedModel:
    """The model of one observed job, calibrated; predicts any setting of it."""

    model: StepModel
    calibration: Calibration
    base: Setting
    comm_factor: float
    obs: Observation = field(repr=False)
    line: PassLine | None = None
    notes: list[str] = field(default_factory=list)

    def parts_of(self, s: Setting) -> dict[str, float]:
        return self.model.parts(s)

    def predict(self, s: Setting) -> Prediction:
        raw = self.model.parts(s)
        step = self.calibration.predict({p: raw[p] for p in PARTS})
        spread = self.obs.baseline.spread_s if self.obs.baseline is not None else 0.0
        low, high = self.calibration.predicted_range(step, spread)
        # The collectives' own uncertainty: the fits at the ends of their intervals.
        for end in (self.slow, self.fast):
            other = self.calibration.predict({p: end.parts(s)[p] for p in PARTS})
            low, high = min(low, other), max(high, other)
        base_raw = self.calibration.baseline
        truth = self.calibration.truth
        parts = {
            p: max(
                0.0,
                (truth.part(p) or base_raw[p])
                + self.calibration.scales[p] * (raw[p] - base_raw[p]),
            )
            for p in PARTS
        }
        parts["other"] = max(0.0, step - sum(parts.values()))
        recompute = sum(self.model.recompute_per_sample(s.layout).values()) * s.samples
        return Prediction(
            setting=s,
            step_s=step,
            range_s=(low, high),
            parts=parts,
            memory=self.obs.predict_memory(
                s.layout, batch=s.micro_batch, accumulation=s.micro_batches
            ),
            recompute_s=recompute * self.calibration.scales["compute"],
            comm_total_s=raw["comm_total"],
        )

    @property
    def slow(self) -> StepModel:
        return self.model.with_collectives(_collectives(self.obs, "slow").slower(self.comm_factor))

    @property
    def fast(self) -> StepModel:
        return self.model.with_collectives(_collectives(self.obs, "fast").slower(self.comm_factor))

    def describe(self) -> str:
        text = self.calibration.describe()
        if abs(self.comm_factor - 1) > 0.01:
            text += f"; collectives x{self.comm_factor:.2g} their probe time beside compute"
        return text


def base_setting(obs: Observation) -> Setting:
    w = obs.workload
    return Setting(w.layout(), w.accumulation, w.batch_size * w.accumulation)


def calibrate_job(obs: Observation) -> CalibratedModel:
    """The model of ``obs``'s job fitted to its measured baseline (see the module docstring)."""
    base = base_setting(obs)
    notes: list[str] = []
    line = pass_line(obs, base.samples)
    if line is None:
        notes.append("the step could not be timed here: per-pass cost taken as 0")
    units = _units(obs, line)
    overhead = (0.0, 0.0)
    if obs.nproc > 1 and obs.device_type == "cuda":
        # Its copies run on the device, in its own streams: left to the calibration there.
        notes.append("FSDP's own compute is not timed on a GPU")
    elif obs.nproc > 1:
        try:
            found = fsdp_overhead(obs)
            overhead = (found["reshard"], found["keep"])
        except Exception as exc:  # the job cannot be sharded here: its trials will say why
            notes.append(f"FSDP's own compute could not be timed ({type(exc).__name__}: {exc})")
    model = StepModel(
        root=units[0],
        blocks=tuple(units[1:]),
        per_pass_s=line.per_pass_s if line is not None else 0.0,
        optimizer_s=line.optimizer_s if line is not None else 0.0,
        world_size=obs.nproc,
        gather_ratio=_gather_ratio(obs),
        collectives=_collectives(obs, None),
        device_type=obs.device_type,
        fsdp_pass_s=overhead,
        pass_times=line.measured if line is not None else (),
    )
    truth = obs.truth
    factor = 1.0
    modelled_total = model.parts(base)["comm_total"]
    if truth is not None and truth.comm_total_s and modelled_total > 0:
        lo, hi = COMM_FACTOR_LIMITS
        factor = min(hi, max(lo, truth.comm_total_s / modelled_total))
        model = model.with_collectives(model.collectives.slower(factor))
    if truth is not None and truth.profiled and base.layout.checkpointed:
        model = _fit_recompute(model, base, truth, notes)
    base_parts = model.parts(base)
    if truth is None:
        # No measured baseline (``tunekit plan`` without a study): the model's own step.
        truth = StepTruth(sum(base_parts[p] for p in PARTS), source="model (no measured baseline)")
        notes.append("no measured baseline: predictions are the model's own")
    calibration = Calibration.fit(truth, {p: base_parts[p] for p in PARTS})
    notes += list(calibration.notes)
    return CalibratedModel(model, calibration, base, factor, obs, line, notes)


RECOMPUTE_FACTOR_LIMITS = (1.0, 3.0)
"""How far a checkpointed baseline may stretch its recomputation's modelled cost."""


def _fit_recompute(
    model: StepModel, base: Setting, truth: StepTruth, notes: list[str]
) -> StepModel:
    """A checkpointed baseline's compute beyond its passes is its recomputation: fit the
    recompute's cost to it, so that a setting that recomputes less saves what it measured
    (scaling all compute alike left the passes holding recompute's excess: removing full
    checkpointing was predicted 20-30% slower than it measured)."""
    measured = truth.part("compute")
    recompute = base.samples * sum(model.recompute_per_sample(base.layout).values())
    if not measured or recompute <= 0:
        return model
    passes = model.parts(base)["compute"] - recompute
    lo, hi = RECOMPUTE_FACTOR_LIMITS
    factor = min(hi, max(lo, (measured - passes) / recompute))
    if factor > lo:
        notes.append(f"recomputation x{factor:.2g} a block's profiled forward (fitted)")
    return replace(model, recompute_factor=factor)


# -- filling the model -------------------------------------------------------------------


def _units(obs: Observation, line: PassLine | None) -> list[Unit]:
    """The root then each block, with per-sample times and parameter bytes."""
    blocks = list(obs.blocks)
    times = _profile_times(obs, blocks)
    profile_total = sum(f + b for f, b, _ in times.values())
    per_sample = line.per_sample_s if line is not None else None
    scale = per_sample / profile_total if per_sample and profile_total > 0 else 1.0
    facts = obs.memory
    params = {b.name: b.param_bytes for b in facts.blocks} if facts is not None else {}
    root_bytes = (
        facts.root_param_bytes
        if facts is not None
        else max(0.0, obs.model.param_bytes - sum(params.values()))
    )
    out = []
    for name in ["", *blocks]:
        f, b, sel = times.get(name, (0.0, 0.0, 0.0))
        out.append(
            Unit(
                name=name,
                forward_s=f * scale,
                backward_s=b * scale,
                selective_s=sel * scale,
                param_bytes=root_bytes if name == "" else params.get(name, 0.0),
            )
        )
    if profile_total <= 0 and per_sample:
        # No layer profile: the measured per-sample time on the root, nothing per block.
        out[0] = Unit("", per_sample / 3, 2 * per_sample / 3, 0.0, out[0].param_bytes)
    return out


def _profile_times(obs: Observation, blocks: list[str]) -> dict[str, tuple[float, float, float]]:
    """Per unit ("" for the root): (forward, backward, selective recompute) seconds per sample."""
    profile, graph = obs.layer_profile, obs.graph
    if profile is None or graph is None or not profile.batch_size:
        return {}
    per = 1.0 / profile.batch_size
    out: dict[str, list[float]] = {}
    current = ""
    for name, layer in graph.layers.items():
        anchor = graph.nodes.get(layer.nodes[0]) if layer.nodes else None
        path = anchor.target if anchor is not None and anchor.module_type else None
        if path is not None:
            current = next((b for b in blocks if path == b or path.startswith(b + ".")), "")
        timing = profile.layers.get(name)
        if timing is None:
            continue
        acc = out.setdefault(current, [0.0, 0.0, 0.0])
        acc[0] += timing.forward_s * per
        acc[1] += timing.backward_s * per
        if layer.kind not in SAVED_KINDS:
            acc[2] += timing.forward_s * per
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def _gather_ratio(obs: Observation) -> float:
    facts = obs.memory
    if facts is None or not facts.param_elem_bytes:
        return 1.0
    return facts.compute_bytes_per_param / facts.param_elem_bytes


def _collectives(obs: Observation, end: str | None) -> Collectives:
    hw = obs.hardware.at_end(end) if end else obs.hardware
    p = max(2, obs.nproc)

    def wire(op: str) -> Wire | None:
        fit = hw.fit(op, p)
        return Wire(fit.latency, fit.bandwidth) if fit is not None else None

    all_reduce = wire("all_reduce")
    if all_reduce is None:  # a modelled ring over the profile's links
        try:
            small = hw.allreduce_time(1.0, p)
            big = hw.allreduce_time(PROBE_SIZE, p)
            all_reduce = Wire(small, PROBE_SIZE / max(big - small, 1e-12))
        except Exception:  # no fit and no links to model one: a fast local link, said so
            all_reduce = UNKNOWN_LINK
    copies: Mapping[str, Wire | None] = {}
    if obs.device_type == "cuda":
        h2d, d2h = hw.fit("h2d", 1), hw.fit("d2h", 1)
        copies = {
            "h2d": Wire(h2d.latency, h2d.bandwidth) if h2d else None,
            "d2h": Wire(d2h.latency, d2h.bandwidth) if d2h else None,
        }
    found = Collectives.from_all_reduce(all_reduce, **copies)
    gather, scatter = wire("all_gather"), wire("reduce_scatter")
    return Collectives(
        found.all_reduce,
        gather or found.all_gather,
        scatter or found.reduce_scatter,
        found.h2d,
        found.d2h,
    )


def layout_of(obs: Observation, changes: Mapping[str, Any]) -> Layout:
    return obs.workload.layout().with_changes(changes)
