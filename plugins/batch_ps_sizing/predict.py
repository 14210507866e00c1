"""The step time of another per-rank batch: measured step-time fits, calibrated on the measured baseline.

Which parts of a step scale with the batch, and which do not:

* **compute** (forward, loss, backward) and **data** (making the batch) do:
  each is a :class:`~tunekit.plugins.batch_ps_sizing.model.StepTimeFit` of
  steps timed in this process at several batches, with a trial rank's threads;
* the **gradient all-reduce** (exposed communication), the **optimizer** step
  and **idle** time (Python, scheduling) do not: they carry over as measured.

:class:`tunekit.costmodel.Calibration` ties the fits to the measured baseline
(``obs.truth``): a candidate's step is the measured step plus each scaling
part's change, scaled by measured part / fitted part at the current batch::

    step(b) = step_measured + compute_measured * (f_c(b) / f_c(b0) - 1) + data_measured * (...)

So what is measured in this process enters only as a ratio between two
batches timed side by side, and the absolute figures are the baseline's: the
machine's load (it touches both batches alike), the share of the cores a
neighbour rank leaves and the profiler's overhead cancel. What does not cancel
is what changes with the batch in a trial only (two ranks sharing the last-level
cache and memory bandwidth at large batches): the model's remaining error.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from tunekit.api import Calibration, StepTiming, StepTruth
from tunekit.plugins.batch_ps_sizing.model import StepTimeFit

SCALING_PARTS = ("compute", "data")
"""Parts of a step that grow with the batch; the others (exposed communication,
optimizer, idle) are per step."""
MAX_EXTRAPOLATION = 2.0
"""Batches up to this multiple of the largest timed batch are predicted (and flagged);
beyond it the fit is not trusted: such batches are not proposed."""


@dataclass(frozen=True)
class BatchStepModel:
    """Per-rank step time against the batch (see the module docstring)."""

    batch: int
    """The job's own per-rank batch (b0)."""
    fits: dict[str, StepTimeFit]
    """Fit of each scaling part (:data:`SCALING_PARTS`), seconds per step in this process."""
    optimizer_s: float
    """Median optimizer step timed here (model figure; the measured one is in the truth)."""
    threads: int
    calibration: Calibration
    spread_s: float
    """Run-to-run spread (IQR) of the baseline step it was calibrated on."""
    skipped: dict[int, str]
    """Batches not timed (measuring budget), and why."""
    measured: bool = True
    """Whether ``calibration.truth`` was measured (else it is the model's own step)."""
    accumulation: int = 1
    """The job's micro-batches per optimizer step: the scaling parts run once per micro-batch."""

    @classmethod
    def build(
        cls,
        batch: int,
        timing: StepTiming,
        truth: StepTruth,
        spread_s: float,
        measured: bool = True,
        accumulation: int = 1,
    ) -> BatchStepModel:
        fits = {p: StepTimeFit.fit(_positive(timing.part_samples(p))) for p in SCALING_PARTS}
        optimizer_s = statistics.median(
            s for rows in timing.part_samples("optimizer").values() for s in rows
        )
        model_base = {p: accumulation * fits[p].seconds(batch) for p in SCALING_PARTS}
        model_base["optimizer"] = optimizer_s
        return cls(
            batch,
            fits,
            optimizer_s,
            timing.threads,
            Calibration.fit(truth, model_base),
            spread_s,
            dict(timing.skipped),
            measured,
            accumulation,
        )

    # -- predictions -----------------------------------------------------------------

    def model_parts(self, batch: int, accumulation: int | None = None) -> dict[str, float]:
        """The fits' seconds per step of each scaling part at micro-batch ``batch`` run
        ``accumulation`` times (default: the job's) per step (model figures)."""
        acc = self.accumulation if accumulation is None else accumulation
        return {p: acc * self.fits[p].seconds(batch) for p in SCALING_PARTS}

    def step_s(self, batch: int, accumulation: int | None = None) -> float:
        """Predicted step at ``batch`` (× ``accumulation`` micro-batches, default the job's):
        the measured step plus the scaled change of each scaling part."""
        return self.calibration.predict(self.model_parts(batch, accumulation))

    def parts_s(self, batch: int, accumulation: int | None = None) -> dict[str, float]:
        """The predicted step at ``batch`` part by part (scaling parts changed, the rest as measured)."""
        truth = self.calibration.truth
        base = dict(truth.parts_s) if truth.profiled else {}
        for p, seconds in self.model_parts(batch, accumulation).items():
            if p in base:
                base[p] += self.calibration.scales[p] * (seconds - self.calibration.baseline[p])
        return base

    def extrapolation(self, batch: int) -> float:
        """How far ``batch`` lies beyond the largest timed batch (1.0: inside)."""
        return self.fits["compute"].extrapolation(batch)

    def predictable(self, batch: int) -> bool:
        return self.extrapolation(batch) <= MAX_EXTRAPOLATION

    def range_s(self, batch: int, accumulation: int | None = None) -> tuple[float, float]:
        """(low, high) of :meth:`step_s`: the baseline's spread, plus the fit's error on the change.

        The change rests on a ratio of two fitted values, each uncertain by the
        fit's residual (or the medians' noise, if larger); beyond the timed
        batches that error grows in proportion to the distance.
        """
        acc = self.accumulation if accumulation is None else accumulation
        predicted = self.step_s(batch, acc)
        low, high = self.calibration.predicted_range(predicted, self.spread_s)
        fit = self.fits["compute"]
        rel = max(fit.residual, fit.noise, 0.01) * math.sqrt(2) * self.extrapolation(batch)
        scaled = self.calibration.scales["compute"] * acc * self.fits["compute"].seconds(batch)
        margin = rel * scaled if (batch, acc) != (self.batch, self.accumulation) else 0.0
        return max(1e-9, low - margin), high + margin

    # -- words -----------------------------------------------------------------------

    def describe(self) -> str:
        """The model in one clause, labelled as the model's."""
        fit = self.fits["compute"]
        threads = f"{self.threads} thread{'s' if self.threads > 1 else ''}"
        scale = self.calibration.scales["compute"]
        refused = [n for n in self.calibration.notes if n.startswith("compute:")]
        if not (self.measured and self.calibration.truth.profiled):
            tied = "not scaled (no measured compute)"
        elif refused:
            tied = f"not scaled ({refused[0]})"
        else:
            tied = f"x{scale:.2f} to the measured compute"
        return f"model: compute {fit.describe()} here at {threads}, {tied}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "accumulation": self.accumulation,
            "fits": {p: f.to_dict() for p, f in self.fits.items()},
            "optimizer_s": self.optimizer_s,
            "threads": self.threads,
            "calibration": {
                "scales": dict(self.calibration.scales),
                "model_baseline_s": dict(self.calibration.baseline),
                "notes": list(self.calibration.notes),
                "text": self.calibration.describe(),
            },
            "skipped": {str(b): why for b, why in self.skipped.items()},
        }


def per_step_phrase(truth: StepTruth) -> str:
    """``exposed communication 13% of the step (4.8 ms, measured), optimizer ... do not grow with the batch``."""
    fixed = [
        p for p in truth.parts_s if p not in SCALING_PARTS and (truth.fraction(p) or 0) >= 0.005
    ]
    if not fixed:
        return "nothing measured is per step: the whole step grows with the batch"
    listed = _join([truth.phrase(p) for p in fixed])
    verb = "does" if len(fixed) == 1 else "do"
    return f"{listed} {verb} not grow with the batch"


def scaling_phrase(truth: StepTruth) -> str:
    """``compute 74% of the step (111.0 ms, measured) grows with it``."""
    parts = [p for p in SCALING_PARTS if p == "compute" or (truth.fraction(p) or 0) >= 0.005]
    verb = "grows" if len(parts) == 1 else "grow"
    return f"{_join([truth.phrase(p) for p in parts])} {verb} with it"


def _positive(samples: dict[int, list[float]]) -> dict[int, list[float]]:
    """Times below a microsecond (a batch that is already in memory) as one microsecond."""
    return {b: [max(t, 1e-6) for t in ts] for b, ts in samples.items()}


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
