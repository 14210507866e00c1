"""The one measured truth about the baseline step, which every tuner, report and screen reads.

A study measures its baseline twice over: the trial's timed steps (the step
time every decision compares against) and a few extra steps under
``torch.profiler`` (where the time goes: compute, exposed communication,
data, optimizer, idle). The profiler slows the steps it records, so its parts
add up to more than the measured step. :class:`StepTruth` reconciles the two
once: the measured median step, split in the proportions the profiled steps
show. Tuners start their diagnoses from these figures (their models may refine
them, and then say how), so no two figures on a screen contradict each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tunekit.observe.breakdown import PARTS

if TYPE_CHECKING:
    from tunekit.observe.breakdown import Breakdown
    from tunekit.observe.observation import Measurement

PART_LABELS = {
    "compute": "compute",
    "comm_exposed": "exposed communication",
    "data": "data loading",
    "optimizer": "optimizer",
    "idle": "idle",
}
"""How each part is named in every sentence tunekit writes (tests match these)."""


@dataclass(frozen=True)
class StepTruth:
    """The baseline's measured step time and where it goes (see the module docstring)."""

    step_s: float
    """Median measured step time of the baseline (the slowest rank's, per step)."""
    parts_s: dict[str, float] = field(default_factory=dict)
    """Seconds per step of each part in :data:`PARTS`, summing to ``step_s``;
    empty when the baseline was not profiled."""
    comm_total_s: float | None = None
    """All communication per step, hidden or not, on the same scale as the parts."""
    overlap_R: float | None = None
    """Lee et al.'s overlap ratio R of the profiled steps (a ratio: not rescaled)."""
    profiled_step_s: float | None = None
    """Mean step time under the profiler, before the parts were scaled to ``step_s``."""
    source: str = "measured baseline"

    @classmethod
    def of(cls, baseline: Measurement | None, breakdown: Breakdown | None) -> StepTruth | None:
        """The truth of one observed baseline; None without a measured step."""
        if baseline is None:
            return None
        summary = breakdown.summary() if breakdown is not None else {}
        profiled = summary.get("total_s") or 0.0
        if profiled <= 0:
            return cls(baseline.median_s, source="measured baseline (not profiled)")
        scale = baseline.median_s / profiled
        parts = {p: max(0.0, float(summary.get(f"{p}_s") or 0.0)) * scale for p in PARTS}
        comm_total = summary.get("comm_total_s")
        return cls(
            step_s=baseline.median_s,
            parts_s=parts,
            comm_total_s=None if comm_total is None else comm_total * scale,
            overlap_R=summary.get("overlap_R"),
            profiled_step_s=profiled,
            source=(
                f"measured baseline; parts from {summary.get('ranks', 0)} rank(s)' profiled "
                f"steps ({profiled * 1e3:.1f} ms under the profiler), scaled to the measured "
                f"{baseline.median_s * 1e3:.1f} ms"
            ),
        )

    @property
    def profiled(self) -> bool:
        return bool(self.parts_s)

    def part(self, name: str) -> float | None:
        """Seconds per step of one part, or None when the baseline was not profiled."""
        if name not in PARTS:
            raise KeyError(f"unknown step part {name!r}; parts are {', '.join(PARTS)}")
        return self.parts_s.get(name)

    def fraction(self, name: str) -> float | None:
        value = self.part(name)
        return None if value is None or self.step_s <= 0 else value / self.step_s

    def phrase(self, name: str, short: bool = False) -> str:
        """``exposed communication 13% of the step (4.8 ms, measured)`` — how tuners quote a part;
        ``short``: ``exposed communication 13% of the step``, for a headline."""
        frac = self.fraction(name)
        if frac is None:
            return f"{PART_LABELS[name]} unknown" + (
                "" if short else " (the baseline was not profiled)"
            )
        text = f"{PART_LABELS[name]} {frac:.0%} of the step"
        return text if short else f"{text} ({self.parts_s[name] * 1e3:.1f} ms, measured)"

    def describe(self) -> str:
        """One line: the step and every part's share."""
        head = f"{self.step_s * 1e3:.1f} ms per step (measured)"
        if not self.profiled:
            return head + "; no breakdown (the baseline was not profiled)"
        shares = " · ".join(f"{PART_LABELS[p]} {self.parts_s[p] / self.step_s:.0%}" for p in PARTS)
        return f"{head}: {shares}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fractions"] = {p: self.fraction(p) for p in self.parts_s}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTruth:
        return cls(**{k: v for k, v in data.items() if k != "fractions"})
