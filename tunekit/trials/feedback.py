"""Learning from trials: every measured trial corrects the predictions still to run.

A tuner's cost model is calibrated on the measured baseline, but it still errs
in ways only a trial reveals (an executor's overheads, contention the model
does not see). After each trial the orchestrator refits, per tuner, a model
of the residual on a log scale, with the candidate's own predicted change as
the knob feature::

    log(measured / baseline) = a + b * log(predicted / baseline)

``a`` is the tuner's bias (its candidates all run 20% slower than predicted:
a = log 1.2); ``b`` how much of a predicted change materialises (a model that
exaggerates gains and losses has b < 1). With no trials the fit is the
identity (a = 0, b = 1: trust the model); each trial moves it by Bayesian
ridge regression toward what was measured. Tuners are corrected only by their
own trials: their models err in their own ways (one tuner's executor overhead
says nothing about another's), and what all trials share, the machine drifting,
is already in the baseline, which is re-measured between candidates.

Predictions and measurements are per step of the candidate's own global
batch, as tuners predict them; the baseline is the study's measured median.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

NOISE_SD = 0.05
"""Run-to-run noise of a trial's median step on a log scale (about 5%)."""
BIAS_SD = 0.5
"""Prior spread of a tuner's bias around 0 (log scale: x1.65)."""
SLOPE_SD = 0.35
"""Prior spread of the slope b around 1."""


@dataclass(frozen=True)
class Outcome:
    """One finished trial that had a prediction."""

    plugin: str
    predicted_s: float
    measured_s: float


@dataclass(frozen=True)
class Residual:
    """A tuner's fitted correction ``log(m/base) = a + b log(p/base)``."""

    bias: float = 0.0
    slope: float = 1.0
    trials: int = 0

    def apply(self, predicted_s: float, baseline_s: float) -> float:
        x = math.log(predicted_s / baseline_s)
        return baseline_s * math.exp(self.bias + self.slope * x)

    def describe(self) -> str:
        if not self.trials:
            return "no trials yet: raw model"
        return (
            f"from {self.trials} trial(s): x{math.exp(self.bias):.2f} bias, "
            f"{self.slope:.2f} of each predicted change"
        )


def _ridge(
    x: np.ndarray, y: np.ndarray, prior_mean: np.ndarray, prior_sd: np.ndarray
) -> np.ndarray:
    """Posterior mean of y = X w with Gaussian noise NOISE_SD and prior N(prior_mean, prior_sd^2)."""
    design = np.column_stack([np.ones_like(x), x])
    precision = design.T @ design / NOISE_SD**2 + np.diag(1.0 / prior_sd**2)
    rhs = design.T @ y / NOISE_SD**2 + prior_mean / prior_sd**2
    return np.linalg.solve(precision, rhs)


class Corrector:
    """Per-tuner residual models refitted from the trials so far (see the module docstring)."""

    def __init__(self, baseline_s: float, outcomes: Iterable[Outcome] = ()):
        if not baseline_s > 0:
            raise ValueError("the baseline step time must be positive")
        self.baseline_s = baseline_s
        self.outcomes = [o for o in outcomes if o.predicted_s > 0 and o.measured_s > 0]
        self._fits = {p: self._fit(p) for p in {o.plugin for o in self.outcomes}}

    def _logs(self, outcomes: list[Outcome]) -> tuple[np.ndarray, np.ndarray]:
        x = np.array([math.log(o.predicted_s / self.baseline_s) for o in outcomes])
        y = np.array([math.log(o.measured_s / self.baseline_s) for o in outcomes])
        return x, y

    def _fit(self, plugin: str) -> Residual:
        own = [o for o in self.outcomes if o.plugin == plugin]
        x, y = self._logs(own)
        bias, slope = _ridge(x, y, np.array([0.0, 1.0]), np.array([BIAS_SD, SLOPE_SD]))
        return Residual(float(bias), float(slope), len(own))

    def residual(self, plugin: str | None) -> Residual:
        """The fitted correction of one tuner (none before its first trial)."""
        if plugin is None:  # a trial no tuner proposed: nothing fitted
            return Residual()
        return self._fits.get(plugin, Residual())

    def corrected(self, plugin: str | None, predicted_s: float | None) -> float | None:
        """The prediction corrected by the trials so far (None stays None: no prediction)."""
        if predicted_s is None or not predicted_s > 0:
            return None
        return self.residual(plugin).apply(predicted_s, self.baseline_s)

    def summary(self) -> dict[str, dict[str, float | int | str]]:
        plugins = sorted(set(self._fits))
        return {
            p: {
                "bias": self._fits[p].bias,
                "slope": self._fits[p].slope,
                "trials": self._fits[p].trials,
                "text": self._fits[p].describe(),
            }
            for p in plugins
        }


def relative_error(predicted_s: float | None, measured_s: float | None) -> float | None:
    """|predicted - measured| / measured, or None when either is missing."""
    if predicted_s is None or measured_s is None or measured_s <= 0:
        return None
    return abs(predicted_s - measured_s) / measured_s


def outcomes_of(rows: Iterable[Mapping | object]) -> list[Outcome]:
    """Outcomes of finished candidate trials that had a prediction (store rows or dicts)."""
    out = []
    for r in rows:
        get = r.get if isinstance(r, Mapping) else (lambda k, r=r: getattr(r, k, None))
        if get("role") not in ("candidate", "confirm", "search") or get("status") != "ok":
            continue
        pred, meas, plugin = get("predicted_s"), get("median_s"), get("plugin")
        if pred and meas and plugin:
            out.append(Outcome(plugin, float(pred), float(meas)))
    return out


# -- choosing what to run next ----------------------------------------------------------


@dataclass(frozen=True)
class PoolEntry:
    """One planned candidate, run or not: what re-ranking chooses from."""

    plugin: str
    config: dict
    config_id: str
    predicted_s: float | None
    global_batch: int | None
    """Samples per step of this candidate; None: the baseline's."""
    predicted_peak_bytes: float | None = None
    """Its predicted peak memory per rank (None: not predicted)."""


@dataclass(frozen=True)
class Ranked:
    entry: PoolEntry
    corrected_s: float | None
    gain: float | None
    """Predicted fraction of time per sample saved against the baseline, corrected."""


def rank_pool(pool: Iterable[PoolEntry], corrector: Corrector, base_batch: int) -> list[Ranked]:
    """Every entry with its corrected prediction and per-sample gain (unsorted)."""
    base_per_sample = corrector.baseline_s / base_batch
    out = []
    for e in pool:
        corrected = corrector.corrected(e.plugin, e.predicted_s)
        gain = None
        if corrected is not None:
            gain = 1.0 - (corrected / (e.global_batch or base_batch)) / base_per_sample
        out.append(Ranked(e, corrected, gain))
    return out


def choose_next(
    ranked: list[Ranked],
    tried_plugins: set[str],
    slots: int,
    min_gain: float,
    by_gain: bool = False,
) -> tuple[list[Ranked], list[Ranked]]:
    """Which untried candidates fill ``slots``, and which were dropped as not worth a trial.

    First every tuner not tried yet gets its best candidate (its model may be wrong
    in a way only a trial shows, and one trial corrects all of its candidates), best
    tuner first; then the rest by corrected gain. A candidate whose corrected
    prediction is slower than the baseline by more than ``min_gain`` is dropped;
    one with no prediction is kept, after the predicted ones. ``by_gain`` (a time budget,
    which may hold a trial or two): by corrected gain alone, so that a candidate too long for
    the budget gives its place to the next best, not to another tuner's best that expects
    nothing.
    """

    def key(r: Ranked) -> float:
        return -(r.gain if r.gain is not None else -math.inf)

    kept = sorted((r for r in ranked if r.gain is None or r.gain > -min_gain), key=key)
    dropped = [r for r in ranked if r.gain is not None and r.gain <= -min_gain]
    first: list[Ranked] = []
    for r in kept:
        if by_gain:
            break
        if r.entry.plugin not in tried_plugins and all(
            f.entry.plugin != r.entry.plugin for f in first
        ):
            first.append(r)
    rest = [r for r in kept if r not in first]
    return (first + rest)[:slots], dropped


def predicted_peaks(obs: dict[str, Any]) -> dict[str, float]:
    """Predicted peak per rank by config id (the planned pool), and each tuner's in-job
    search start's (``search:TUNER``: a search records the config it found instead)."""
    out = {
        e["config_id"]: e["predicted_peak_bytes"]
        for e in obs.get("pool", [])
        if e.get("predicted_peak_bytes")
    }
    for plugin, candidates in (obs.get("plans") or {}).items():
        start = next((c for c in candidates if c.get("search")), None)
        if start is not None and start.get("predicted_peak_bytes"):
            out[f"search:{plugin}"] = start["predicted_peak_bytes"]
    return out


def measured_peak(result: Mapping[str, Any] | None) -> float | None:
    """A trial's measured peak memory per rank: the largest over its ranks (None: unmeasured)."""
    ranks = (result or {}).get("ranks") or []
    return max((float(r["peak_bytes"]) for r in ranks if r.get("peak_bytes")), default=None)
