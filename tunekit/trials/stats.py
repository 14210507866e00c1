"""Noise-aware measurement of step times.

A trial's step time is, per measured step, the slowest rank's time (the job
moves at the pace of its slowest rank); its summary is the median with the
interquartile range.

Two configs are compared with a hierarchical bootstrap of the ratio of
medians: resample runs, then steps within each run. Separate processes
differ by more than steps within one process do (placement on cores,
allocator state, a noisy neighbour), so an arm measured in a single run
borrows the run-to-run spread seen in arms with several runs. A candidate
wins only if the whole confidence interval clears the minimum effect.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tunekit.observe.observation import Measurement

MIN_MEASURED_STEPS = 3
"""The fewest measured steps a run may have and still count: a median of three
outlasts one stray step (a page fault, a neighbour's burst), a median of two does
not. Runs of different lengths compare fairly (see ``_boot_medians``)."""


def slowest_rank_steps(ranks: list[dict[str, Any]]) -> list[float]:
    """Per measured step, the maximum over ranks."""
    per_rank = [r["step_s"] for r in ranks if r.get("step_s")]
    if not per_rank:
        return []
    n = min(len(s) for s in per_rank)
    return [max(s[i] for s in per_rank) for i in range(n)]


def summarize(step_s: list[float], global_batch: int) -> Measurement:
    arr = np.asarray(step_s, dtype=float)
    med = float(np.median(arr))
    q1, q3 = np.percentile(arr, [25, 75])
    return Measurement(
        step_s=[float(x) for x in arr],
        median_s=med,
        spread_s=float(q3 - q1),
        samples_per_s=global_batch / med if med > 0 else 0.0,
    )


def measurement_from_ranks(ranks: list[dict[str, Any]]) -> Measurement | None:
    steps = slowest_rank_steps(ranks)
    if not steps:
        return None
    return summarize(steps, ranks_global_batch(ranks))


def ranks_global_batch(ranks: list[dict[str, Any]]) -> int:
    """Samples per step of a trial, as its ranks reported it."""
    reported = [r["global_batch"] for r in ranks if r.get("global_batch")]
    if reported:
        return int(reported[0])
    return sum(int(r.get("batch_size") or 0) for r in ranks) or 1


@dataclass
class Comparison:
    speedup: float
    """baseline median / candidate median (> 1: the candidate is faster)."""
    ci_low: float
    ci_high: float
    """95 % bootstrap interval of ``speedup``."""
    significant: bool
    """True when the candidate beats the baseline beyond noise and ``min_effect``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare_runs(
    baseline_runs: list[list[float]],
    candidate_runs: list[list[float]],
    *,
    min_effect: float = 0.01,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> Comparison:
    """Hierarchical bootstrap over runs and steps; see the module docstring."""
    base = [np.asarray(r, dtype=float) for r in baseline_runs if len(r)]
    cand = [np.asarray(r, dtype=float) for r in candidate_runs if len(r)]
    if not base or not cand:
        raise ValueError("both arms need at least one run with step times")
    effects = _run_effects(base) + _run_effects(cand)
    rng = np.random.default_rng(seed)
    ratios = _boot_medians(base, effects, n_boot, rng) / _boot_medians(cand, effects, n_boot, rng)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha])
    speedup = float(np.median(np.concatenate(base)) / np.median(np.concatenate(cand)))
    return Comparison(speedup, float(low), float(high), bool(low > 1 + min_effect))


def _run_effects(runs: list[np.ndarray]) -> list[float]:
    """Each run's median relative to its arm's pooled median (needs two runs or more)."""
    if len(runs) < 2:
        return []
    pooled = float(np.median(np.concatenate(runs)))
    return [float(np.median(r)) / pooled for r in runs]


def _boot_medians(runs: list[np.ndarray], effects: list[float], n_boot: int, rng) -> np.ndarray:
    """Medians of ``n_boot`` two-level resamples: ``k`` runs with replacement, then each run's steps.

    Vectorised: runs are padded with NaN to one length and the padding is
    masked out of each resample, so unequal run lengths keep their weights.
    """
    k = len(runs)
    lengths = np.array([len(r) for r in runs])
    table = np.full((k, lengths.max()), np.nan)
    for i, r in enumerate(runs):
        table[i, : len(r)] = r
    picks = rng.integers(k, size=(n_boot, k))
    n = lengths[picks][..., None]  # (n_boot, k, 1): the picked run's length
    slots = np.arange(table.shape[1])
    steps = (rng.random((n_boot, k, table.shape[1])) * n).astype(np.int64)
    sample = np.where(slots < n, table[picks[..., None], steps], np.nan)
    out = np.nanmedian(sample.reshape(n_boot, -1), axis=1)
    if k == 1:  # one run says nothing about run-to-run spread: borrow it
        out = out * rng.choice(np.asarray(effects or [1.0]), size=n_boot)
    return out


def compare(
    baseline: list[float],
    candidate: list[float],
    *,
    min_effect: float = 0.01,
    confidence: float = 0.95,
    n_boot: int = 4000,
    seed: int = 0,
) -> Comparison:
    """Bootstrap the ratio of medians; significant iff the interval's low end > 1 + min_effect."""
    b = np.asarray(baseline, dtype=float)
    c = np.asarray(candidate, dtype=float)
    if len(b) == 0 or len(c) == 0:
        raise ValueError("both samples need at least one step time")
    rng = np.random.default_rng(seed)
    bm = np.median(rng.choice(b, size=(n_boot, len(b)), replace=True), axis=1)
    cm = np.median(rng.choice(c, size=(n_boot, len(c)), replace=True), axis=1)
    ratios = bm / cm
    alpha = (1 - confidence) / 2
    low, high = np.quantile(ratios, [alpha, 1 - alpha])
    speedup = float(np.median(b) / np.median(c))
    return Comparison(speedup, float(low), float(high), bool(low > 1 + min_effect))
