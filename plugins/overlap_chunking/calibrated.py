"""The step simulation calibrated on the measured baseline (``obs.truth``).

The per-layer profile runs in one process and the probe times collectives on
otherwise idle ranks; the baseline trial runs both at once. On CPU ranks
(gloo) the collectives' threads share the cores with compute, and the two
ranks drift apart. So the raw simulation gets neither the step nor its
exposed communication right (on 2 CPU ranks it leaves ~1 ms exposed where
the profiler measures 25 ms). Calibration makes it reproduce the measured
baseline (PyTorch's DDP defaults) — its step, its exposed communication and
how long its communication was in flight while the rank computed:

* what the model does not change is carried over as measured: data loading
  and idle time become the simulation's ``other_s``; the optimizer's time per
  byte is scaled to the measured optimizer part;
* ``a``, a factor on every compute time, makes the simulated step the
  measured step;
* ``b``, how many times its probe time a collective takes while the rank
  computes, makes the simulated hidden communication (in flight while the
  rank computes: measured ``comm_total`` minus exposed) the measured one;
* ``d``, how much later the peer rank posts the step's last collective, takes
  what the transfers leave of the measured exposed communication. Where the
  transfers alone would expose more than measured, ``d`` is 0 and ``b`` is
  lowered to match the exposure instead.

For each ``a``, ``b`` and then ``d`` are found by bisection (hidden time grows
with ``b``, the wait with ``d``); then ``a`` by bisection on the step. Every
candidate is then simulated with the same ``a``, ``b``, ``d``. Without a
profiled baseline only the step is known: one compute factor is fitted
(:func:`~.model.calibrate`) and collectives keep the probe's times; without a
baseline nothing is calibrated. :attr:`Fit.notes` says which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tunekit.api import Calibration, StepTruth
from tunekit.plugins.overlap_chunking.model import Prediction, StepCosts, calibrate

COMPUTE_LIMITS = (1e-2, 1e2)
"""Range searched for the compute factor ``a``."""
COMM_LIMITS = (0.05, 200.0)
"""Range searched for the collective factor ``b``. On a loaded CPU host a
collective posted mid-backward has been measured at ~20x its probe time
(gloo's threads wait for a share of saturated cores); beyond 200x the model
does not describe what happens."""
NOISE_SHARE = 0.005
"""Parts below this share of the step are measurement noise: not fitted on."""
ITERATIONS = 32
"""Bisection steps: 2^-32 of a range is far below any measured figure's noise."""

JOINT = "joint"
COMPUTE_ONLY = "compute only"
UNCALIBRATED = "uncalibrated"


@dataclass
class Fit:
    """The calibrated model of one job, and how it was calibrated."""

    costs: StepCosts
    """The costs every setting is simulated with (calibrated when possible)."""
    raw: Prediction
    """The uncalibrated model's prediction for DDP's defaults."""
    baseline: Prediction
    """The calibrated model's prediction for DDP's defaults (the measured baseline)."""
    method: str
    """:data:`JOINT`, :data:`COMPUTE_ONLY` or :data:`UNCALIBRATED`."""
    truth: StepTruth | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def compute_scale(self) -> float | None:
        return None if self.method == UNCALIBRATED else self.costs.compute_scale

    @property
    def comm_scale(self) -> float:
        return self.costs.comm_scale

    @property
    def peer_delay_s(self) -> float:
        return self.costs.peer_delay_s

    @property
    def calibration(self) -> Calibration | None:
        """The core's view of the calibrated baseline (its parts are the measured
        ones, so every scale is 1): its ``predicted_range`` gives a prediction
        the baseline's run-to-run spread."""
        if self.truth is None:
            return None
        parts = {p: v for p, v in self.baseline.parts.items() if p != "other"}
        return Calibration.fit(self.truth, parts if self.method == JOINT else {})

    def predicted_range(
        self, pred: Prediction, spread_s: float | None
    ) -> tuple[float, float] | None:
        cal = self.calibration
        if cal is None or spread_s is None:
            return None
        return cal.predicted_range(pred.step_s, spread_s)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "compute_scale": self.compute_scale,
            "comm_scale": self.comm_scale,
            "peer_delay_s": self.peer_delay_s,
            "raw_default": {"step_s": self.raw.step_s, "exposed_s": self.raw.blocked_s},
            "notes": list(self.notes),
        }


def _bisect(fn: Callable[[float], float], lo: float, hi: float, geometric: bool = True) -> float:
    """The root of nondecreasing ``fn`` in [lo, hi], where fn(lo) < 0 <= fn(hi)."""
    for _ in range(ITERATIONS):
        mid = (lo * hi) ** 0.5 if geometric else (lo + hi) / 2
        if fn(mid) < 0:
            lo = mid
        else:
            hi = mid
    return hi


def _root_in(fn: Callable[[float], float], lo: float, hi: float, geometric: bool = True) -> float:
    """The root of nondecreasing ``fn`` in [lo, hi], or the end it is closest to."""
    if fn(hi) < 0:
        return hi
    if fn(lo) >= 0:
        return lo
    return _bisect(fn, lo, hi, geometric)


def fit(
    costs: StepCosts,
    truth: StepTruth | None,
    predict_default: Callable[[StepCosts], Prediction],
) -> Fit:
    """Calibrate ``costs`` on ``truth`` (see the module docstring)."""
    raw = predict_default(costs)
    if truth is None:
        return Fit(
            costs, raw, raw, UNCALIBRATED, notes=["no baseline measured: the model is uncalibrated"]
        )
    if truth.profiled:
        joint = _fit_joint(costs, truth, predict_default, raw)
        if joint is not None:
            return joint
        why = (
            "the measured step and exposed communication cannot both be reproduced within "
            f"compute x{COMPUTE_LIMITS[0]:g}..{COMPUTE_LIMITS[1]:g}"
        )
    else:
        why = "the baseline was not profiled (no measured exposed communication)"
    return _fit_compute_only(costs, truth, predict_default, raw, why)


def _fit_compute_only(costs, truth, predict_default, raw, why: str) -> Fit:
    scale = calibrate(costs, truth.step_s, predict_default)
    if scale is None:
        note = (
            f"{why}; and the measured {truth.step_s * 1e3:.1f} ms step is shorter than the "
            "modelled communication alone, so no compute factor reproduces it: the model is "
            "uncalibrated (check the hardware's all-reduce fit)"
        )
        return Fit(costs, raw, raw, UNCALIBRATED, truth=truth, notes=[note])
    calibrated = costs.scaled(scale)
    note = (
        f"{why}: one compute factor (x{scale:.2f}) fitted to the measured step; "
        "collectives at the probe's times"
    )
    return Fit(
        calibrated, raw, predict_default(calibrated), COMPUTE_ONLY, truth=truth, notes=[note]
    )


@dataclass
class _Targets:
    """The measured baseline figures the joint fit reproduces."""

    step_s: float
    exposed_s: float
    hidden_s: float | None
    """Communication in flight while the rank computed: ``comm_total - exposed``."""
    other_s: float
    update: float | None
    floor_s: float


def _targets(truth: StepTruth, raw: Prediction) -> _Targets:
    parts = truth.parts_s
    floor = NOISE_SHARE * truth.step_s
    # The optimizer follows compute unless both figures are above the noise.
    update = None
    if parts["optimizer"] > floor and raw.parts["optimizer"] > 0:
        update = parts["optimizer"] / raw.parts["optimizer"]
    hidden = None
    if truth.comm_total_s is not None and truth.comm_total_s - parts["comm_exposed"] > floor:
        hidden = truth.comm_total_s - parts["comm_exposed"]
    return _Targets(
        truth.step_s, parts["comm_exposed"], hidden, parts["data"] + parts["idle"], update, floor
    )


def _fit_joint(costs, truth, predict_default, raw) -> Fit | None:
    target = _targets(truth, raw)
    notes: list[str] = []

    def costs_at(a: float, b: float, d: float) -> StepCosts:
        return costs.calibrated(a, b, target.update, target.other_s, d)

    def simulate(a: float, b: float, d: float) -> Prediction:
        return predict_default(costs_at(a, b, d))

    def comm_for(a: float) -> tuple[float, float]:
        """(b, d) reproducing the measured hidden and exposed communication at compute x``a``."""
        b = 1.0
        if target.hidden_s is not None:
            # Hidden time stops growing once a collective outlasts the compute it
            # overlaps; a measured figure at (or past) that ceiling says "at least
            # this slow": take the slowest that still ends within the compute.
            ceiling = simulate(a, COMM_LIMITS[1], 0.0).hidden_s - target.floor_s
            hidden = min(target.hidden_s, ceiling)
            b = _root_in(lambda b: simulate(a, b, 0.0).hidden_s - hidden, *COMM_LIMITS)
        if simulate(a, b, 0.0).blocked_s > target.exposed_s:
            # The transfers alone expose more than measured: slow them less, no delay.
            lo = COMM_LIMITS[0]
            return _root_in(lambda x: simulate(a, x, 0.0).blocked_s - target.exposed_s, lo, b), 0.0
        d = _root_in(
            lambda d: simulate(a, b, d).blocked_s - target.exposed_s,
            0.0,
            target.step_s,
            geometric=False,
        )
        return b, d

    def step_excess(a: float) -> float:
        return simulate(a, *comm_for(a)).step_s - target.step_s

    lo, hi = COMPUTE_LIMITS
    if not step_excess(lo) <= 0 <= step_excess(hi):
        return None
    a = _bisect(step_excess, lo, hi)
    b, d = comm_for(a)
    calibrated = costs_at(a, b, d)
    baseline = predict_default(calibrated)
    tolerance = max(0.01 * target.step_s, target.floor_s)
    if abs(baseline.step_s - target.step_s) > tolerance:
        return None
    if abs(baseline.blocked_s - target.exposed_s) > tolerance:
        notes.append(
            f"the model cannot expose the measured {target.exposed_s * 1e3:.1f} ms "
            f"(at most {baseline.blocked_s * 1e3:.1f} ms)"
        )
    if target.hidden_s is not None and abs(baseline.hidden_s - target.hidden_s) > tolerance:
        notes.append(
            f"measured {target.hidden_s * 1e3:.1f} ms of hidden communication, model at most "
            f"{baseline.hidden_s * 1e3:.1f} ms (the backward it can hide behind)"
        )
    if target.hidden_s is None:
        notes.append("no hidden communication measured: collectives at the probe's speed")
    if b in COMM_LIMITS:
        notes.append(f"collective factor at the end of its range (x{b:g})")
    return Fit(calibrated, raw, baseline, JOINT, truth=truth, notes=notes)
