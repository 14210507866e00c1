"""Typed events the orchestrator yields; the CLI and the TUI both consume them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Event:
    def to_dict(self) -> dict[str, Any]:
        return {"event": type(self).__name__, **asdict(self)}


@dataclass
class StudyStarted(Event):
    study_id: int
    workload: str
    nproc: int
    hardware: str
    resumed: bool
    finished_trials: int = 0
    nnodes: int = 1


@dataclass
class Notice(Event):
    message: str
    level: str = "info"  # info | warning


@dataclass
class PluginProblem(Event):
    plugin: str
    package: str
    status: str
    error: str
    """One line (with where in the plugin it raised, when it raised)."""
    traceback: str = ""
    """The whole traceback, when a hook raised (report.md shows it under Problems)."""


@dataclass
class Observed(Event):
    summary: dict[str, Any]


@dataclass
class Diagnosed(Event):
    plugin: str
    applies: bool
    summary: str
    expected_gain: float | None
    headline: str = ""
    """At most ~100 characters (:func:`tunekit.diagnosis_text.headline_of`); ``summary`` is the body."""


@dataclass
class Planned(Event):
    plugin: str
    candidates: list[dict[str, Any]]


@dataclass
class TrialStarted(Event):
    trial_id: int
    seq: int
    role: str
    plugin: str | None
    description: str
    predicted_s: float | None
    index: int
    """1-based position among the study's trials (those finished, skipped included, come first)."""
    total: int
    """Trials in the study so far; planning, a combination or a confirmation adds to it."""
    corrected_s: float | None = None
    """``predicted_s`` corrected by the trials before this one (see tunekit.trials.feedback)."""


@dataclass
class TrialProgress(Event):
    trial_id: int
    phase: str  # warmup | measure | search
    index: int
    total: int
    step_s: float | None = None


@dataclass
class TrialFinished(Event):
    trial_id: int
    seq: int
    role: str
    plugin: str | None
    description: str
    status: str
    median_s: float | None
    spread_s: float | None
    predicted_s: float | None
    error: str | None = None
    corrected_s: float | None = None
    samples_per_s: float | None = None
    """Measured throughput at the trial's own global batch (what a decision compares)."""
    predicted_peak_bytes: float | None = None
    """The tuner's predicted peak memory per rank for this config (None: not predicted)."""
    peak_bytes: float | None = None
    """The measured peak memory per rank (the largest rank's; None: not measured)."""


BUDGET_SKIP = "did not fit the time budget"
"""``TrialFinished.error`` of a trial skipped because the time budget had no room for it."""

NOTHING_RAN = (
    "nothing was measured since the last baseline run (every trial between was skipped or failed)"
)
"""``TrialFinished.error`` of an interleaved baseline run skipped: it would measure beside nothing."""


@dataclass
class Reranked(Event):
    """Trials so far corrected the tuners' predictions; what is left to run was re-ranked."""

    corrections: dict[str, dict[str, Any]]
    """Per tuner: fitted bias and slope, trials they came from, a sentence."""
    upcoming: list[dict[str, Any]]
    """The candidates now scheduled, in order: plugin, description, predicted and corrected."""
    dropped: list[dict[str, Any]] = field(default_factory=list)
    """Candidates no longer worth a trial: corrected prediction slower than the baseline."""


@dataclass
class Decided(Event):
    decision: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReportWritten(Event):
    paths: dict[str, str]


@dataclass
class StudyFinished(Event):
    study_id: int
    winner: str
    speedup: float | None
    timings: list[dict[str, Any]] = field(default_factory=list)
    """Where the study's time went, stage by stage (:mod:`tunekit.timings`)."""
