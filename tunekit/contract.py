"""The tuner contract: what a plugin implements, phase by phase.

A tuner is a class deriving from :class:`Tuner`, registered under the
``tunekit.plugins`` entry-point group (the built-in tuners register exactly as
a third party would)::

    [project.entry-points."tunekit.plugins"]
    my_tuner = "my_package.plugin:MyTuner"

tunekit drives every tuner through four phases. The first three run in the
tuning process; the last runs inside every training worker.

1. **Declare** — :attr:`Tuner.name`, :attr:`Tuner.aspect` and
   :meth:`Tuner.knobs`: what the tuner controls and the values it may take.
2. **Diagnose** — :meth:`Tuner.diagnose`: does the technique apply to this job
   on this hardware, and what gain does it expect?
3. **Plan** — :meth:`Tuner.plan`: the paper's cost model and search turned into
   ranked :class:`Candidate` configs, each with a predicted step time. The
   orchestrator verifies the best of them with short real trials.
4. **Runtime** — :meth:`Tuner.apply`: inside each worker, change the training
   :class:`~tunekit.runtime.session.Session` to run the tuner's knobs (wrap the
   model, install a gradient reducer, set the batch size ...). It runs at a step
   boundary, in a fresh trial or in a live job; to undo it the session is reset
   to the workload's defaults and the previous config is applied again, so a
   tuner registers anything else it changed with ``session.on_reset``.

**Aspects.** Each tuner controls one :class:`Aspect` of the job. A combined
config holds at most one tuner per aspect: the orchestrator never runs two
``grad_sync`` strategies at once. A tuner that takes over a neighbouring aspect
too (a placement that synchronises its own gradients) lists it in
:attr:`Tuner.excludes`.

**Versioning.** :attr:`Tuner.api_version` is the contract's major version the
plugin was written for; tunekit refuses a plugin built for another major
version with a message that says which tunekit to install.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from tunekit import API_VERSION
from tunekit.errors import ConfigError, shown

if TYPE_CHECKING:  # only for annotations: the contract imports nothing heavy
    from tunekit.observe.observation import Observation
    from tunekit.runtime.session import Session

__all__ = [
    "API_VERSION",
    "Aspect",
    "Candidate",
    "Diagnosis",
    "Knob",
    "SearchResult",
    "Tuner",
]


class Aspect(str, Enum):
    """The part of a training job a tuner's knobs control."""

    BATCH = "batch"
    """Per-rank batch size and the learning rate that goes with it."""
    PLACEMENT = "placement"
    """How layers, or slices of them, map onto devices."""
    GRAD_SYNC = "grad_sync"
    """How gradients are reduced across data-parallel ranks."""
    DATA = "data"
    """The input pipeline: loader workers, pinned memory, prefetching."""
    LAYOUT = "layout"
    """How the model is laid out in memory: sharding (FSDP), activation checkpointing,
    offload, micro-batches per step (the tuner's ``layout`` hook returns the layout part)."""

    def __str__(self) -> str:
        return self.value


# -- phase 1: declare ----------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    """One setting a tuner controls, with its type and allowed values."""

    name: str
    """Identifier, unique within the tuner (``bucket_cap_mb``)."""
    type: Literal["int", "float", "bool", "choice", "str"]
    default: Any
    """The value that reproduces the job's untuned behaviour."""
    help: str = ""
    """One line for ``tunekit plugins --knobs`` and the TUI."""
    low: float | None = None
    """Smallest allowed value (int and float knobs)."""
    high: float | None = None
    """Largest allowed value (int and float knobs)."""
    choices: tuple[Any, ...] = ()
    """Allowed values (choice knobs)."""
    changes_math: bool = False
    """True when a change alters the training arithmetic beyond float
    summation order (batch size, gradient compression): it is reported and
    only applied within what the user allowed."""
    live: Literal["step", "relaunch"] = "step"
    """How a live job takes a change: at a step boundary, or by checkpointing
    and relaunching its processes (world size, placement)."""
    parse: Callable[[str], Any] | None = field(default=None, compare=False, repr=False)
    """For ``str`` knobs (structured values such as a per-layer plan): checks
    the text and raises ConfigError with one line when it is not acceptable."""

    def __post_init__(self) -> None:
        if self.type not in ("int", "float", "bool", "choice", "str"):
            raise ValueError(f"knob {self.name}: unknown type {self.type!r}")
        if self.type == "choice" and not self.choices:
            raise ValueError(f"knob {self.name}: a choice knob needs choices")
        if self.live not in ("step", "relaunch"):
            raise ValueError(f"knob {self.name}: live must be 'step' or 'relaunch'")
        self.check(self.default, where=f"knob {self.name} default")

    def check(self, value: Any, where: str | None = None) -> Any:
        """Return ``value`` converted to the knob's type; raise ConfigError if it is not allowed."""
        where = where or f"knob {self.name}"
        if self.type == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
            return value
        if self.type == "choice":
            if value not in self.choices:
                allowed = ", ".join(map(str, self.choices))
                raise ConfigError(f"{where}: {shown(value)} is not one of {allowed}")
            return value
        if self.type == "str":
            if not isinstance(value, str):
                raise ConfigError(f"{where}: expected a string, got {shown(value)}")
            if self.parse is not None:
                try:
                    self.parse(value)
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
                except Exception as exc:
                    raise ConfigError(f"{where}: {type(exc).__name__}: {exc}") from None
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {shown(value)}")
        if self.type == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
            value = int(value)
        else:
            try:
                value = float(value)  # an integer of hundreds of digits does not fit
            except OverflowError:
                raise ConfigError(f"{where}: {shown(value)} is out of range") from None
        if (self.low is not None and value < self.low) or (
            self.high is not None and value > self.high
        ):
            raise ConfigError(f"{where}: {shown(value)} is out of range [{self.low}, {self.high}]")
        return value

    def describe(self) -> str:
        if self.type == "str":
            return "str"
        if self.type == "choice":
            return "|".join(map(str, self.choices))
        if self.type == "bool":
            return "bool"
        return f"{self.type} [{self.low}, {self.high}]"


# -- phase 2 and 3: diagnose, plan -----------------------------------------------------


@dataclass
class Diagnosis:
    """A tuner's verdict on one observed job."""

    applies: bool
    """Whether the technique can help this job on this hardware at all."""
    summary: str
    """One line for people: the evidence and the expectation
    ("exposed communication 31% of the step (12.0 ms, measured); chunked overlap should
    recover ~25%"). Quote what was measured from ``obs.truth`` (``obs.truth.phrase(part)``),
    so a diagnosis never contradicts the step breakdown beside it; a figure of the
    tuner's own model is labelled as such ("model: ...")."""
    expected_gain: float | None = None
    """Predicted fraction of step time saved (0.25 = 25 %), if the model gives one."""
    details: dict[str, Any] = field(default_factory=dict)
    """Plain JSON-able evidence for reports and the TUI."""
    headline: str = ""
    """At most ~100 characters, read at a glance: verdict, expected gain with its range, and
    the one measured figure it rests on ("applies · +3% (−1…+6%) · exposed comm 12% of the
    step"). ``summary`` is the body beside it. Empty: the core derives one
    (:func:`tunekit.diagnosis_text.headline_of`)."""


@dataclass
class Candidate:
    """One config a tuner proposes, with the cost model's prediction."""

    knobs: dict[str, Any]
    """Knob values; knobs left out keep their defaults."""
    predicted_step_s: float | None
    """Predicted time of one training step on the observed job, in seconds; None when
    the model cannot predict it (say why in ``rationale``: "no prediction: ...").
    Predict relative to what was measured: a model first reproduces the measured
    baseline step (``obs.truth``), then predicts the candidate as a change to it."""
    rationale: str = ""
    """Why this candidate: one line for people."""
    details: dict[str, Any] = field(default_factory=dict)
    """Plain JSON-able extras (a per-layer plan table, a schedule ...)."""
    predicted_range_s: tuple[float, float] | None = None
    """(low, high) step time given the uncertainty of the prediction's inputs."""
    global_batch: int | None = None
    """Samples one step of this candidate consumes over all ranks, when that is not the
    job's own (a batch size or a model-parallel degree changes it); None: unchanged.
    Candidates are ranked by predicted time per sample."""
    predicted_peak_bytes: float | None = None
    """Predicted peak memory of one rank under this candidate, in bytes, from the core
    memory model (``obs.predict_memory``); None: not predicted (a candidate that changes
    neither the layout nor the batch peaks as the baseline did). With ``--memory-cap``, a
    candidate predicted over it is not tried."""
    combined_with: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Knobs of other tuners this candidate was planned with (tuner name -> knobs): its config
    holds them too, and it is tried, predicted and ranked as one (a layout that frees memory
    with the larger batch that memory lets fit). Dropped when a named tuner is not in use."""
    search: bool = False
    """Run this candidate as the tuner's in-job search: its trial applies these knobs, then
    calls the tuner's ``search`` hook from there (instead of from the defaults). Only for a
    tuner that overrides ``search``."""


@dataclass
class SearchResult:
    """What an in-job search found (see :meth:`Tuner.search`)."""

    knobs: dict[str, Any]
    """The knob values the search settled on."""
    trace: list[dict[str, Any]] = field(default_factory=list)
    """One entry per tried setting: its knobs, steps, measured time, anything else."""
    summary: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    """Plain JSON-able findings beside the choice (e.g. a gradient noise scale)."""


# -- the tuner -------------------------------------------------------------------------


class Tuner(ABC):
    """Base class of every tuner plugin. Override the hooks of each phase."""

    name: ClassVar[str]
    """Entry-point name and config key (``overlap_chunking``)."""
    title: ClassVar[str]
    """A short human title (``Overlapped gradient chunks (Lee et al.)``)."""
    aspect: ClassVar[Aspect]
    """The aspect this tuner's knobs control."""
    excludes: ClassVar[frozenset[Aspect]] = frozenset()
    """Other aspects this tuner takes over; it is never combined with tuners of those."""
    api_version: ClassVar[int] = API_VERSION[0]
    """Major version of this contract the plugin was written for."""

    # phase 1 -----------------------------------------------------------------------

    @abstractmethod
    def knobs(self) -> Sequence[Knob]:
        """Declare the settings this tuner controls. Called once per process."""

    # phase 2 -----------------------------------------------------------------------

    @abstractmethod
    def diagnose(self, obs: Observation) -> Diagnosis:
        """Say whether the technique applies to the observed job, and what it expects.

        Must not launch processes; it reads ``obs`` and may time small pieces
        of the model in this process.
        """

    # phase 3 -----------------------------------------------------------------------

    @abstractmethod
    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        """Return up to ``limit`` candidates, best predicted first.

        The cost model of the tuner's paper turns the observation into a
        predicted step time for each; the orchestrator runs real trials of
        the first few and keeps the winner only if it beats the baseline
        beyond noise.
        """

    # phase 4 -----------------------------------------------------------------------

    @abstractmethod
    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        """Inside every worker: make ``session`` train with ``knobs``.

        Called at a step boundary on every rank with the same (validated,
        defaults-filled) knobs, after the session was reset to the workload's
        defaults. Model and optimizer state must carry over. Anything changed
        that :meth:`Session.reset` does not know about is undone by a callback
        given to ``session.on_reset``.
        """

    def layout(self, knobs: Mapping[str, Any]) -> Mapping[str, Any]:
        """Optional: how ``knobs`` lay the model out, as fields of :class:`tunekit.api.Layout`
        (``sharding``, ``reshard_after_forward``, ``cpu_offload``, ``checkpointing``,
        ``checkpoint_every``, ``checkpoint_blocks``) to change from the workload's own.

        The core applies them, not :meth:`apply`: the build fields (sharding, resharding,
        offload) before the model and its optimizer exist (a relaunch trial builds its
        session with them; a live job relaunches from its sharded checkpoint when they
        change), checkpointing at the step boundary before :meth:`apply` runs. A knob that
        changes a build field is declared ``live="relaunch"``. Return ``{}`` (the default)
        when the knobs change no layout.
        """
        return {}

    # phase 3b (optional) -------------------------------------------------------------

    def search(
        self, session: Session, knobs: Mapping[str, Any], max_steps: int
    ) -> SearchResult | None:
        """Optionally search knob values inside a running job, Horovod-style.

        Called on every rank at once, after :meth:`apply` installed ``knobs``,
        in a trial or in a live job; it trains with ``session.train_step()``
        for at most ``max_steps`` steps while trying settings, and must make
        the same decision on every rank (decide on rank 0 and broadcast).
        Return ``None`` (the default) when the tuner has no in-job search.
        """
        return None

    # reporting (optional) -------------------------------------------------------------

    def snippet(self, knobs: Mapping[str, Any]) -> str | None:
        """Code that gets ``knobs`` in a user's own training script, without tunekit.

        Shown in reports next to the winning config (e.g. the DDP keyword
        arguments). Return ``None`` (the default) when there is nothing to paste.
        """
        return None

    def explain(self, candidate: Candidate) -> str | None:
        """Markdown that explains one candidate: a per-layer plan table, a schedule.

        ``tunekit plan`` renders it under the candidate list and the report
        shows it for the winner. Return ``None`` (the default) when the
        rationale line says enough.
        """
        return None

    # helpers (not hooks) ---------------------------------------------------------------

    def knob_map(self) -> dict[str, Knob]:
        return {k.name: k for k in self.knobs()}

    def validate(self, knobs: Mapping[str, Any]) -> dict[str, Any]:
        """Knob values checked against their declarations, defaults filled in."""
        declared = self.knob_map()
        unknown = sorted(set(knobs) - set(declared))
        if unknown:
            raise ConfigError(
                f"{self.name}: unknown knob {shown(unknown[0])}; known: {', '.join(declared)}"
            )
        return {
            name: knob.check(knobs[name], where=f"{self.name}.{name}")
            if name in knobs
            else knob.default
            for name, knob in declared.items()
        }

    def defaults(self) -> dict[str, Any]:
        return {k.name: k.default for k in self.knobs()}
