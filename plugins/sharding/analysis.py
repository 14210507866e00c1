"""The models evaluated on one observation, once (diagnose and plan share it): the bound,
every setting of the space predicted, what the plan proposes, and the levers — one change
each from the job as it runs, with the memory it frees and what it costs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunekit.api import Observation, format_bytes
from tunekit.plugins.sharding.calibrated import CalibratedModel, Prediction, calibrate_job
from tunekit.plugins.sharding.model import Setting
from tunekit.plugins.sharding.search import (
    Proposal,
    combined,
    larger_batches,
    propose,
    space,
)


@dataclass(frozen=True)
class Bound:
    bytes: float
    source: str
    """``the --memory-cap``, ``device memory`` or ``host memory per rank``."""


@dataclass(frozen=True)
class Lever:
    """One change from the running job: the memory it frees, what it costs."""

    words: str
    prediction: Prediction
    freed_bytes: float
    """Positive: the predicted peak drops by this much."""
    cost: float
    """The predicted step's relative change (+0.18: 18% slower)."""
    part: str
    """What the time change is mostly made of: ``compute``, ``communication``, ``optimizer``."""
    hidden: bool
    """Communication: most of the added communication overlaps compute."""

    def phrase(self) -> str:
        part = self.part + (", mostly hidden" if self.hidden else "")
        if self.freed_bytes >= 0:
            return (
                f"{self.words} frees {format_bytes(self.freed_bytes)} for {self.cost:+.0%} {part}"
            )
        verb = "saves" if self.cost < 0 else "costs"
        return (
            f"{self.words} needs {format_bytes(-self.freed_bytes)} more and {verb} "
            f"{abs(self.cost):.0%} ({part})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "lever": self.words,
            "freed_bytes": self.freed_bytes,
            "cost": self.cost,
            "part": self.part,
            "hidden": self.hidden,
            "peak_bytes": self.prediction.peak_bytes,
            "step_s": self.prediction.step_s,
        }


@dataclass
class Analysis:
    model: CalibratedModel
    base: Prediction
    predictions: list[Prediction]
    bound: Bound
    measured_peak: float | None
    proposals: list[Proposal]
    levers: list[Lever] = field(default_factory=list)

    @property
    def best(self) -> Prediction | None:
        return self.proposals[0].prediction if self.proposals else None

    @property
    def gain(self) -> float:
        """The best proposal's predicted gain in samples/s (a proposal may change the batch)."""
        best = self.best
        return max(0.0, self.gain_at(best.step_s)) if best is not None else 0.0

    def gain_at(self, step_s: float) -> float:
        """Samples/s over the baseline's, less one, for the best proposal taking ``step_s``."""
        best = self.best
        assert best is not None
        base = self.base
        return (best.setting.samples / step_s) / (base.setting.samples / base.step_s) - 1

    @property
    def peak(self) -> float | None:
        """The job's peak per rank: measured, else the model's."""
        return self.measured_peak or self.base.peak_bytes


def memory_bound(obs: Observation) -> Bound:
    if obs.memory_cap_bytes:
        return Bound(float(obs.memory_cap_bytes), "the --memory-cap")
    devices = [d for d in obs.hardware.devices[: max(1, obs.nproc)] if d.memory_bytes]
    if obs.device_type == "cuda" and devices:
        return Bound(min(d.memory_bytes for d in devices), "device memory")
    return Bound(obs.hardware.host.memory_bytes / max(1, obs.nproc), "host memory per rank")


def analyse(obs: Observation, limit: int = 8) -> Analysis:
    model = calibrate_job(obs)
    base = model.predict(model.base)
    settings = space(model.base, obs.nproc, obs.device_type, bool(obs.blocks))
    predictions = [base if s == model.base else model.predict(s) for s in settings]
    bound = memory_bound(obs)
    proposals = propose(predictions, base, bound.bytes, limit)
    # Memory this tuner frees may let the batch tuner's larger batch fit: planned as one.
    w = obs.workload
    larger = {
        b: [
            model.predict(s)
            for s in space(
                model.base, obs.nproc, obs.device_type, bool(obs.blocks), b * w.accumulation
            )
        ]
        for b in larger_batches(w.batch_size, w.batch_range)
    }
    together = combined(larger, proposals[0] if proposals else None, base, bound.bytes)
    proposals = (proposals[:1] + together[:2] + proposals[1:])[:limit]
    analysis = Analysis(model, base, predictions, bound, obs.baseline_peak_bytes, proposals)
    analysis.levers = levers(analysis, obs)
    return analysis


def levers(a: Analysis, obs: Observation) -> list[Lever]:
    """One change at a time from the running job, each predicted (module docstring)."""
    base = a.model.base
    layout = base.layout
    changes: list[tuple[str, dict[str, Any], int]] = []
    if obs.blocks:
        if layout.checkpointed:
            changes.append(
                ("no checkpointing", {"checkpointing": "none", "checkpoint_blocks": None}, 0)
            )
        else:
            changes += [
                ("checkpointing every block", {"checkpointing": "full", "checkpoint_every": 1}, 0),
                (
                    "checkpointing every 2nd block",
                    {"checkpointing": "full", "checkpoint_every": 2},
                    0,
                ),
                (
                    "selective checkpointing",
                    {"checkpointing": "selective", "checkpoint_every": 1},
                    0,
                ),
            ]
    if base.samples % (2 * base.micro_batches) == 0:
        changes.append(
            (f"{2 * base.micro_batches} micro-batches per step", {}, 2 * base.micro_batches)
        )
    if obs.nproc > 1:
        if layout.sharded:
            flip = not layout.reshard_after_forward
            changes.append(
                (
                    "resharding after forward" if flip else "keeping gathered blocks to backward",
                    {"reshard_after_forward": flip},
                    0,
                )
            )
            changes.append(("replicating with DDP", {"sharding": "ddp", "cpu_offload": False}, 0))
            if obs.device_type == "cuda" and not layout.cpu_offload:
                changes.append(("CPU offload", {"cpu_offload": True}, 0))
        else:
            changes.append(
                ("sharding with FSDP", {"sharding": "fsdp", "reshard_after_forward": True}, 0)
            )
    out = []
    for words, fields, micro in changes:
        s = Setting(layout.with_changes(fields), micro or base.micro_batches, base.samples)
        p = a.model.predict(s)
        if p.peak_bytes is None or a.base.peak_bytes is None:
            continue
        out.append(_lever(words, p, a.base))
    return out


def _lever(words: str, p: Prediction, base: Prediction) -> Lever:
    deltas = {
        part: p.parts[part] - base.parts[part] for part in ("compute", "comm_exposed", "optimizer")
    }
    part = max(deltas, key=lambda k: abs(deltas[k]))
    comm_added = p.comm_total_s - base.comm_total_s
    hidden = part == "comm_exposed" and comm_added > 0 and deltas["comm_exposed"] < 0.5 * comm_added
    return Lever(
        words,
        p,
        (base.peak_bytes or 0.0) - (p.peak_bytes or 0.0),
        p.step_s / base.step_s - 1,
        {"comm_exposed": "communication"}.get(part, part),
        hidden,
    )
