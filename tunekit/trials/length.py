"""How many steps a trial runs: as planned, fewer, or none.

A candidate predicted to be slow would otherwise run into the trial timeout
and measure nothing. Before it starts, its expected step time times its steps,
plus the trial's start-up, is held against the timeout: it runs with fewer
warm-up steps first, then fewer measured steps (never fewer than the decision
needs), or not at all, with the reason recorded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tunekit.store import TrialRow
from tunekit.trials.stats import MIN_MEASURED_STEPS

MIN_WARMUP_STEPS = 1
"""Warm-up kept when shortening: the first step pays one-off costs (allocator
growth, first collectives) that would be a third of a three-step measurement."""

HEADROOM = 1.5
"""Steps are planned at this multiple of the expected step time: predictions
miss by tens of percent, and runs on a shared machine vary as much."""

DEFAULT_STARTUP_S = 10.0
"""Start-up assumed before any trial of the study has measured its own (about
4 s on 2 idle cores, twice that on a busy machine)."""


@dataclass(frozen=True)
class TrialLength:
    """The steps a trial runs, and why when they are not the planned ones."""

    warmup: int
    steps: int
    planned_warmup: int
    planned_steps: int
    step_estimate_s: float | None = None
    """Expected seconds per step (None: nothing to go by, the trial runs as planned)."""
    source: str = ""
    """Where ``step_estimate_s`` comes from: ``predicted`` or ``measured``."""
    startup_s: float = DEFAULT_STARTUP_S
    reason: str = ""
    """Why the trial is shortened or skipped; empty when it runs as planned."""

    @property
    def skipped(self) -> bool:
        return self.steps == 0

    @property
    def skip_reason(self) -> str:
        return self.reason if self.skipped else ""

    @property
    def shortened(self) -> bool:
        return not self.skipped and (self.warmup, self.steps) != (
            self.planned_warmup,
            self.planned_steps,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_length(
    step_s: float | None,
    warmup: int,
    steps: int,
    timeout_s: float,
    startup_s: float = DEFAULT_STARTUP_S,
    source: str = "predicted",
) -> TrialLength:
    """Fit ``warmup`` + ``steps`` steps of ``step_s`` seconds (with ``HEADROOM``) and the start-up into the timeout."""
    planned = TrialLength(warmup, steps, warmup, steps, step_s, source, startup_s)
    if step_s is None or math.isnan(step_s) or step_s <= 0:  # nothing to go by
        return planned
    fit = math.floor((timeout_s - startup_s) / (step_s * HEADROOM))
    if warmup + steps <= fit:
        return planned
    least_warmup, least_steps = min(warmup, MIN_WARMUP_STEPS), min(steps, MIN_MEASURED_STEPS)
    why = f"at {HEADROOM:g}x the estimate, after {startup_s:.0f} s of start-up"
    head = f"{source} {step_s:.1f} s/step"
    if least_warmup + least_steps > fit:
        n = least_warmup + least_steps
        return TrialLength(
            0,
            0,
            warmup,
            steps,
            step_s,
            source,
            startup_s,
            f"{head}: even {n} steps would exceed the {timeout_s:.0f} s trial timeout "
            f"({least_warmup} warm-up + {least_steps} measured, {why})",
        )
    new_warmup = max(least_warmup, min(warmup, fit - steps))  # warm-up gives way first
    new_steps = min(steps, fit - new_warmup)
    return TrialLength(
        new_warmup,
        new_steps,
        warmup,
        steps,
        step_s,
        source,
        startup_s,
        f"{head}: shortened to {new_warmup + new_steps} of {warmup + steps} planned steps to fit the "
        f"{timeout_s:.0f} s trial timeout ({new_warmup} warm-up + {new_steps} measured, {why})",
    )


def startup_estimate(rows: Sequence[TrialRow]) -> float:
    """The longest start-up (launch to the first step) a trial of this study has shown."""
    seen = [
        float(r.result["startup_s"])
        for r in rows
        if r.result and r.result.get("startup_s") is not None
    ]
    return max(seen) if seen else DEFAULT_STARTUP_S


def step_estimate(row: TrialRow, rows: Sequence[TrialRow]) -> tuple[float | None, str]:
    """Expected seconds per step of ``row``: a measured run of its config beats a prediction,
    and a prediction corrected by earlier trials beats the tuner's raw one."""
    measured = [
        r.median_s for r in rows if r.config_id == row.config_id and r.status == "ok" and r.median_s
    ]
    if measured:
        return max(measured), "measured"
    if row.corrected_s and row.corrected_s != row.predicted_s:
        return row.corrected_s, "predicted (corrected by earlier trials)"
    return row.predicted_s, "predicted"


def trial_length(
    row: TrialRow, rows: Sequence[TrialRow], warmup: int, steps: int, timeout_s: float
) -> TrialLength:
    """The steps ``row`` runs in this study (``rows``: its trials so far)."""
    step_s, source = step_estimate(row, rows)
    return plan_length(step_s, warmup, steps, timeout_s, startup_estimate(rows), source)


# -- how long a trial takes, for a time budget -----------------------------------------------

DEFAULT_TAIL_S = 1.0
"""Seconds a trial takes after its last step (results written, the agents stopped), before
any trial of the study has shown its own."""

SEARCH_STEP_WEIGHT = 2.0
"""An in-job search's steps, counted as this many of the job's own: a batch search climbs to
batches several times the job's, whose steps take as many times longer."""


def wall_estimate(
    config_id: str,
    step_s: float | None,
    rows: Sequence[TrialRow],
    warmup: int,
    steps: int,
    search_steps: int = 0,
) -> float:
    """Expected wall seconds of a trial of ``config_id`` in this study (``rows``: its trials so far).

    A run of the same config already measured is the estimate (the longest, a plain run's:
    not the observed baseline's profiled steps, not a search); otherwise the study's start-up,
    the steps at ``step_s`` (the baseline's median step without a prediction) and the time
    plain trials took past their last step (:data:`DEFAULT_TAIL_S` before one has run).
    """
    done = [r for r in rows if r.status == "ok" and (r.result or {}).get("wall_s")]
    done = [r for r in done if not (r.result or {}).get("search")]
    plain = [r for r in done if r.seq != 0]  # the first baseline also profiles steps
    same = [float((r.result or {})["wall_s"]) for r in plain if r.config_id == config_id]
    if same and not search_steps:
        return max(same)
    if step_s is None or step_s <= 0:
        base = [r.median_s for r in rows if r.seq == 0 and r.median_s]
        step_s = base[0] if base else 0.0
    tails = [_tail_s(r) for r in plain]  # not the first baseline's: it profiles and exports traces
    tail = max(tails) if tails else DEFAULT_TAIL_S
    counted = warmup + steps + SEARCH_STEP_WEIGHT * search_steps
    return startup_estimate(rows) + counted * step_s + tail


def _tail_s(row: TrialRow) -> float:
    """What a finished trial took past its start-up and its steps."""
    result = row.result or {}
    m = result.get("measurement") or {}
    length = result.get("length") or {}
    measured = m.get("step_s") or []
    ran = (length.get("warmup") or 0) + len(measured)
    step = sorted(measured)[len(measured) // 2] if measured else 0.0
    return max(0.0, float(result["wall_s"]) - float(result.get("startup_s") or 0.0) - ran * step)
