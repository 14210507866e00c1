"""Scheduling trials and deciding a winner: pure functions over trial rows."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tunekit.config import TuningConfig
from tunekit.store import FAILED_STATUSES, TrialRow
from tunekit.trials.stats import compare_runs, ranks_global_batch

BASELINE = "baseline"
CANDIDATE = "candidate"
COMBINED = "combined"
CONFIRM = "confirm"
SEARCH = "search"


@dataclass
class PlannedTrial:
    role: str
    plugin: str | None
    config: TuningConfig
    predicted_s: float | None = None
    search: dict[str, Any] | None = None
    corrected_s: float | None = None


def schedule(
    ranked: Mapping[str, list[PlannedTrial]],
    n_trials: int | None,
    baseline_every: int,
) -> list[PlannedTrial]:
    """Interleave candidates of several tuners with baseline re-measurements.

    Candidates are taken round-robin across tuners (in the order given, best
    expected gain first), each tuner's in its own ranking, up to ``n_trials``;
    a baseline run follows every ``baseline_every`` candidates and closes the
    schedule, so drift shows up in the baseline samples instead of favouring
    whichever config ran last.
    """
    queues = [list(q) for q in ranked.values() if q]
    picked: list[PlannedTrial] = []
    while queues and (n_trials is None or len(picked) < n_trials):
        for q in list(queues):
            if n_trials is not None and len(picked) >= n_trials:
                break
            picked.append(q.pop(0))
            if not q:
                queues.remove(q)
    out: list[PlannedTrial] = []
    for i, trial in enumerate(picked, 1):
        out.append(trial)
        if baseline_every and i % baseline_every == 0 and i != len(picked):
            out.append(PlannedTrial(BASELINE, None, TuningConfig()))
    if picked:
        out.append(PlannedTrial(BASELINE, None, TuningConfig()))
    return out


def trial_samples(row: TrialRow) -> list[float]:
    """Seconds per sample of each measured step.

    Per sample, not per step: a candidate that changes the batch size runs
    longer steps by design, and what it must win on is throughput.
    """
    if row.status != "ok" or not row.result or not row.result.get("measurement"):
        return []
    batch = global_batch(row)
    return [s / batch for s in row.result["measurement"]["step_s"]]


def _step_s(row: TrialRow) -> list[float]:
    """Seconds of each measured step ([] for a trial that measured none)."""
    if row.status != "ok" or not row.result or not row.result.get("measurement"):
        return []
    return row.result["measurement"]["step_s"]


def global_batch(row: TrialRow) -> int:
    return ranks_global_batch((row.result or {}).get("ranks") or [])


def decide(trials: list[TrialRow], min_effect: float, describe=None) -> dict[str, Any]:
    """Pick the winner: the highest-throughput config that beats the baseline beyond noise.

    Every run of a config counts (a candidate and its confirmation run); the
    baseline's runs are pooled the same way. See ``compare_runs``.
    """
    describe = describe or (lambda cfg: TuningConfig.from_dict(cfg).describe())
    base_runs = [trial_samples(t) for t in trials if t.role == BASELINE]
    base_runs = [r for r in base_runs if r]
    if not base_runs:
        return {
            "winner": BASELINE,
            "reason": "no successful baseline measurement",
            "candidates": [],
        }
    base_rows = [t for t in trials if t.role == BASELINE and trial_samples(t)]
    base_median = float(statistics.median([x for t in base_rows for x in _step_s(t)]))
    groups: dict[str, list[TrialRow]] = {}
    untuned = TuningConfig().config_id  # a search that kept every default: no candidate
    for t in trials:
        if t.role != BASELINE and t.config_id != untuned:
            groups.setdefault(t.config_id, []).append(t)
    rows = []
    for runs in groups.values():
        first = runs[0]
        samples = [trial_samples(t) for t in runs]
        samples = [r for r in samples if r]
        unmeasured = [t for t in runs if t.status in FAILED_STATUSES or t.status == "skipped"]
        row = {
            "trial_id": first.id,
            "seq": first.seq,
            "role": first.role,
            "plugin": first.plugin,
            "config": first.config,
            "config_id": first.config_id,
            "description": describe(first.config),
            "status": first.status if not samples else "ok",
            "runs": len(samples),
            "predicted_s": first.predicted_s,
            "median_s": float(
                statistics.median([x for t in runs if trial_samples(t) for x in _step_s(t)])
            )
            if samples
            else None,
            "global_batch": global_batch(first),
            "spread_s": first.spread_s,
            "error": unmeasured[0].error if unmeasured and not samples else None,
        }
        if samples:
            row["comparison"] = compare_runs(base_runs, samples, min_effect=min_effect).to_dict()
        rows.append(row)
    winners = [r for r in rows if r.get("comparison", {}).get("significant")]
    decision: dict[str, Any] = {
        "baseline_median_s": base_median,
        "baseline_global_batch": global_batch(base_rows[0]),
        "baseline_runs": len(base_runs),
        "min_effect": min_effect,
        "candidates": rows,
    }
    if winners:
        best = _best_supported(winners, trials)
        c = best["comparison"]
        decision.update(
            winner=best["description"],
            winner_trial=best["trial_id"],
            winner_config=best["config"],
            speedup=c["speedup"],
            ci=[c["ci_low"], c["ci_high"]],
            winner_median_s=best["median_s"],
            winner_global_batch=best["global_batch"],
            reason=f"{c['speedup'] - 1:.1%} more samples/s than the baseline over {best['runs']} run(s) "
            f"(95% CI {c['ci_low']:.3f}-{c['ci_high']:.3f}x)",
        )
    else:
        ok = [r for r in rows if "comparison" in r]
        decision.update(
            winner=BASELINE,
            winner_config=TuningConfig().to_dict(),
            speedup=1.0,
            winner_median_s=base_median,
            reason=(
                "no candidate beat the baseline beyond noise"
                if ok
                else "no candidate trial ran"
                if rows and all(r["status"] == "skipped" for r in rows)
                else "no candidate trial succeeded"
                if rows
                else "no tuner proposed a candidate for this job"
            ),
        )
    return decision


def _best_supported(winners: list[dict[str, Any]], trials: list[TrialRow]) -> dict[str, Any]:
    """The fastest winner; but a winner measured once does not displace one measured twice or
    more that its single run cannot tell apart from (either gains about as much, and one is
    confirmed: ``still_unclear`` then asks only which of the two is faster)."""
    best = max(winners, key=lambda r: r["comparison"]["speedup"])
    confirmed = [r for r in winners if r["runs"] >= 2]
    if best["runs"] >= 2 or not confirmed:
        return best
    surest = max(confirmed, key=lambda r: r["comparison"]["speedup"])
    # the comparison still_unclear makes of a leader and its rival, to agree with it
    versus = compare_runs(
        _runs_of(trials, best["config_id"]), _runs_of(trials, surest["config_id"]), min_effect=0
    )
    return best if versus.ci_high < 1.0 else surest


DRIFT_LIMIT = 0.25
"""Baseline runs whose medians differ by more than this fraction (slowest over fastest)
mean the machine changed under the study: its comparisons are not to be trusted."""


def baseline_drift(trials: list[TrialRow], limit: float = DRIFT_LIMIT) -> dict[str, Any] | None:
    """The baseline runs' median steps, in order, when they drifted beyond ``limit``; else None."""
    medians = [t.median_s for t in trials if t.role == BASELINE and t.status == "ok" and t.median_s]
    if len(medians) < 2 or max(medians) <= min(medians) * (1 + limit):
        return None
    return {"medians_s": medians, "ratio": max(medians) / min(medians), "limit": limit}


def leader_to_confirm(decision: dict[str, Any], min_effect: float) -> dict[str, Any] | None:
    """The fastest candidate measured once that looks faster than the baseline: worth a second run."""
    rows = [
        r
        for r in decision.get("candidates", [])
        if r.get("comparison") and r["runs"] == 1 and r["comparison"]["speedup"] > 1 + min_effect
    ]
    return max(rows, key=lambda r: r["comparison"]["speedup"]) if rows else None


PLAUSIBLE_GAIN = 3
"""A leader that measured no slower than the baseline is measured again while its interval
reaches this many ``min_effect``s of gain: the noise could be hiding a win."""


@dataclass
class Unclear:
    """What a decision still hinges on: the configs to measure again, beside the baseline."""

    rows: list[dict[str, Any]]
    """``decide``'s rows of the configs to run again: the leader, and its rival where the two
    are too close to tell apart."""
    why: str
    rival_only: bool = False
    """The leader is a confirmed win over the baseline; only which of it and its rival is the
    faster is open (applying either gains what the decision says)."""


def still_unclear(
    decision: dict[str, Any], trials: list[TrialRow], min_effect: float
) -> Unclear | None:
    """Whether the measurements support ``decision`` (None) or what to measure again.

    Clear means: a winner measured in two runs or more, beyond noise, with no other winner
    that paired runs cannot tell apart from it (and, when the baseline drifted between its
    runs, measured in three); or, without a winner, no candidate that looks faster than the
    baseline by ``min_effect``, nor one that measured no slower with an interval reaching
    ``PLAUSIBLE_GAIN`` times that (more runs would not turn those into a winner; a drifting
    baseline is said in the decision). Anything else is worth more paired, interleaved runs
    of the two closest configurations: the leader beside the baseline, or the leader and its
    rival beside it.
    """
    rows = sorted(
        (r for r in decision.get("candidates", []) if r.get("comparison")),
        key=lambda r: -r["comparison"]["speedup"],
    )
    if not rows:
        return None
    # A confirmed winner leads though single runs it cannot be told apart from look faster
    # (_best_supported); a faster candidate that is not a win yet still leads, to be measured.
    winner = next((r for r in rows if r["trial_id"] == decision.get("winner_trial")), None)
    above = rows[: rows.index(winner)] if winner is not None else []
    if winner is not None and all(r["comparison"]["significant"] for r in above):
        rows = [winner] + [r for r in rows if r is not winner]
    leader, drift = rows[0], baseline_drift(trials)
    c = leader["comparison"]
    if not c["significant"]:
        interval = f"its interval ({c['ci_low']:.2f}–{c['ci_high']:.2f}x)"
        if c["speedup"] > 1 + min_effect:
            why = f"looks {c['speedup']:.2f}x but {interval} holds no gain"
            return Unclear([leader], f"{leader['description']} {why}")
        if c["speedup"] >= 1 and c["ci_high"] >= 1 + PLAUSIBLE_GAIN * min_effect:
            # Not slower, and its noise hides a gain worth having: a few percent measured once
            # reads as 1.00x as often as not (the grid's batch 32 on the transformer did).
            why = f"measured {c['speedup']:.2f}x but {interval} may hold a gain"
            return Unclear([leader], f"{leader['description']} {why}")
        return None  # a drifting baseline says so in the decision; no candidate even looks faster
    if leader["runs"] < 2:
        return Unclear([leader], f"{leader['description']} has one run")
    if drift is not None and leader["runs"] < 3:
        return Unclear([leader], "the baseline drifted between its runs")
    rival = next((r for r in rows[1:] if r["comparison"]["significant"]), None)
    if rival is not None:
        versus = compare_runs(
            _runs_of(trials, rival["config_id"]),
            _runs_of(trials, leader["config_id"]),
            min_effect=0,
        )
        if versus.ci_low <= 1.0 <= versus.ci_high:
            return Unclear(
                [leader, rival],
                f"{leader['description']} and {rival['description']} are within each other's "
                f"noise ({versus.speedup:.2f}x, {versus.ci_low:.2f}–{versus.ci_high:.2f}x)",
                rival_only=True,
            )
    return None


def _runs_of(trials: list[TrialRow], config_id: str) -> list[list[float]]:
    """Seconds per sample of every measured run of one config."""
    runs = [trial_samples(t) for t in trials if t.config_id == config_id and t.role != BASELINE]
    return [r for r in runs if r]
