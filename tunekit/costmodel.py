"""Cost-model pieces shared by tuners: compute time from FLOPs, and calibration to what was measured.

**Predict relative to what was measured.** A tuner's model first reproduces
the measured baseline (``obs.truth``: the step and where it goes), then
predicts a candidate as a change to it::

    predicted = measured step + sum over parts p of  scale_p * (model_p(candidate) - model_p(baseline))

``scale_p`` makes the model's baseline match the measured part (a layer timed
alone runs faster than the same layer beside a busy neighbour rank; a fitted
all-reduce is not the exposed communication DDP leaves). Parts the model does
not change (data loading, idle) carry over as measured. :class:`Calibration`
does this once for every tuner.

**Compute from FLOPs.** For hardware one does not have, a layer's time is its
FLOPs over a rate: :class:`ComputeRate` is either measured here (the model's
training FLOPs over the measured compute time of the baseline) or assumed (a
fraction of the device's peak), and says which.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tunekit.observe.truth import StepTruth

BACKWARD_FLOPS_RATIO = 2.0
"""Backward FLOPs per forward FLOP: gradients with respect to the inputs and the weights."""


def training_flops(forward_flops: float) -> float:
    """FLOPs of a forward and its backward."""
    return forward_flops * (1.0 + BACKWARD_FLOPS_RATIO)


@dataclass(frozen=True)
class ComputeRate:
    """FLOP/s a device reaches on this model's layers, and where that figure comes from."""

    flops_per_s: float
    source: str

    def __post_init__(self) -> None:
        if not (self.flops_per_s > 0 and math.isfinite(self.flops_per_s)):
            raise ValueError(
                f"a compute rate must be a positive number of FLOP/s, not {self.flops_per_s}"
            )

    @classmethod
    def assumed(cls, peak_flops: float, efficiency: float) -> ComputeRate:
        """A fraction of the device's peak (for hardware one does not have)."""
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], not {efficiency}")
        return cls(
            peak_flops * efficiency,
            f"assumed: {efficiency:.0%} of {peak_flops / 1e12:.3g} TFLOP/s peak",
        )

    @classmethod
    def measured(cls, forward_flops_per_rank: float, compute_s: float) -> ComputeRate | None:
        """What the measured baseline reached: its training FLOPs per rank over its compute time."""
        if not forward_flops_per_rank > 0 or not compute_s > 0:
            return None
        rate = training_flops(forward_flops_per_rank) / compute_s
        return cls(
            rate,
            f"measured: {rate / 1e9:.1f} GFLOP/s in the baseline's compute ({compute_s * 1e3:.1f} ms)",
        )

    def seconds(self, flops: float) -> float:
        return flops / self.flops_per_s

    def forward_backward_s(self, forward_flops: float) -> tuple[float, float]:
        """(forward, backward) seconds of a layer with ``forward_flops``."""
        fwd = self.seconds(forward_flops)
        return fwd, BACKWARD_FLOPS_RATIO * fwd


SCALE_LIMITS = (0.05, 20.0)
"""A calibration factor outside this range means the model does not describe the part."""


@dataclass(frozen=True)
class Calibration:
    """Per-part factors that make a model reproduce the measured baseline (module docstring).

    Build it with :meth:`fit`; :meth:`predict` then gives a candidate's step
    time as the measured step plus the scaled change of each part.
    """

    truth: StepTruth
    baseline: Mapping[str, float]
    """The model's own figures for the baseline, by part (seconds per step)."""
    scales: Mapping[str, float]
    notes: tuple[str, ...] = field(default=())
    """Parts the model could not be fitted on, and why (their scale is 1)."""

    @classmethod
    def fit(cls, truth: StepTruth, baseline: Mapping[str, float]) -> Calibration:
        """Fit each part the model has to the measured part of the same name.

        A part is left unscaled (1.0, with a note) when the truth has no such
        part (the baseline was not profiled), either side is ~0, or the factor
        would fall outside :data:`SCALE_LIMITS`.
        """
        scales: dict[str, float] = {}
        notes: list[str] = []
        for part, modelled in baseline.items():
            measured = truth.part(part) if truth.profiled else None
            if measured is None:
                scales[part] = 1.0
                notes.append(
                    f"{part}: not measured (the baseline was not profiled); model taken as is"
                )
                continue
            floor = 0.01 * truth.step_s  # below 1% of the step a ratio is noise
            if modelled <= floor or measured <= floor:
                scales[part] = 1.0
                if abs(modelled - measured) > floor:
                    notes.append(
                        f"{part}: model {modelled * 1e3:.1f} ms vs measured {measured * 1e3:.1f} ms, "
                        "too small to scale; model taken as is"
                    )
                continue
            factor = measured / modelled
            lo, hi = SCALE_LIMITS
            if not lo <= factor <= hi:
                scales[part] = 1.0
                notes.append(
                    f"{part}: model {modelled * 1e3:.1f} ms vs measured {measured * 1e3:.1f} ms "
                    f"(x{factor:.2g}) is outside what calibration can fix; model taken as is"
                )
                continue
            scales[part] = factor
        return cls(truth, dict(baseline), scales, tuple(notes))

    def predict(self, candidate: Mapping[str, float]) -> float:
        """The candidate's step: the measured step plus each part's scaled change.

        ``candidate`` gives the model's figures for the candidate, by the same
        parts as the baseline (a part left out is unchanged)."""
        unknown = set(candidate) - set(self.baseline)
        if unknown:
            raise KeyError(f"parts {sorted(unknown)} have no baseline figure to change from")
        change = sum(self.scales[p] * (candidate[p] - self.baseline[p]) for p in candidate)
        return max(self.truth.step_s + change, 1e-9)

    def predicted_range(self, predicted_s: float, spread_s: float) -> tuple[float, float]:
        """(low, high) of a prediction, given the baseline's run-to-run spread (IQR).

        The prediction inherits the baseline's relative uncertainty: it was
        calibrated on a median with that spread.
        """
        rel = 0.5 * spread_s / self.truth.step_s if self.truth.step_s > 0 else 0.0
        return predicted_s * (1.0 - rel), predicted_s * (1.0 + rel)

    def reproduces_baseline(self) -> float:
        """The calibrated model's baseline step (equals the measured step by construction)."""
        return self.predict(self.baseline)

    def describe(self) -> str:
        shown = ", ".join(f"{p} x{s:.2f}" for p, s in self.scales.items() if abs(s - 1.0) > 0.005)
        text = f"calibrated on the measured {self.truth.step_s * 1e3:.1f} ms baseline"
        return text + (f" ({shown})" if shown else "")
