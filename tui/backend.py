"""The app's only way to the job and the core: :class:`Backend`.

:class:`LiveBackend` is the real one. It reads a live run's files
(``status.json``, ``metrics.jsonl``), samples its ranks' telemetry, talks to
its control socket, and calls the core's observation, tuners and
orchestrator. Every method that blocks is called from a worker thread, never
from the UI's event loop. Tests give the app a backend with fixed data
instead, so that every screen can be driven without processes.

What is not the app's own lives in the core and is shared with the CLI: the
job started as a ``tunekit run`` child process (:mod:`tunekit.runtime.job_process`),
its metric lines (:mod:`tunekit.runtime.live_metrics`), applying a config
(:mod:`tunekit.runtime.client`) and the tuners' diagnose-and-plan loop
(:mod:`tunekit.planning`).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunekit.config import TuningConfig
from tunekit.diagnosis_text import headline_of
from tunekit.errors import ControlError, PluginError, WorkloadError
from tunekit.events import Event
from tunekit.observe.telemetry import TelemetrySampler
from tunekit.runtime.client import ApplyOutcome, apply_to_run
from tunekit.runtime.job_process import JobProcess
from tunekit.runtime.live_metrics import MetricsTail, live_baseline
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, last_error
from tunekit.tui.state import CHANGE_KINDS, HISTORY, BaselineView, CandidateView, candidate_view

if TYPE_CHECKING:
    from tunekit.contract import Tuner
    from tunekit.planning import TunerStep

# Nothing here imports torch at import time, nor does anything the idle app calls (polling,
# listing the plugins): the app holds ~100 MB instead of ~1 GB until a diagnosis needs the
# model in this process (tests/tui/test_tui_backend.py checks it).

# -- what the app asks for -----------------------------------------------------------------


@dataclass
class TuneRequest:
    """A tuning started from the app (the subset of ``tunekit auto``'s settings it exposes)."""

    plugins: list[str] | None = None
    """Enabled tuners; None: every tuner that loads."""
    trials: int = 3
    steps: int = 16
    warmup: int = 3
    timeout_s: float = 300.0
    min_effect: float = 0.01
    pause_job: bool = True
    """Hold the attached job at a step boundary while the trials measure the machine."""

    def describe(self) -> str:
        return f"{self.trials} trial(s) × {self.steps} steps (+{self.warmup} warm-up)"


@dataclass
class LiveSnapshot:
    """One poll of the live job: the core's own formats, turned into views by :mod:`.state`."""

    status: dict[str, Any]
    metrics: list[dict[str, Any]]
    """The most recent metric lines (at most :data:`HISTORY`)."""
    series: dict[str, list[dict[str, Any]]]
    """Telemetry samples per source (``host``, ``nvml``, ``pyspy``)."""
    static: dict[str, Any] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    """The run's config changes (``events.jsonl``: ``applied``, ``rolled_back``)."""
    applied: int = 0
    """Applies the job could roll back (``run.json``'s ``applied``)."""


@dataclass(frozen=True)
class PluginInfo:
    """An installed plugin as :func:`tunekit.plugin_loading.load_all` classifies it, as data."""

    name: str
    package: str
    status: str
    error: str = ""
    title: str = ""
    aspect: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def plugin_infos() -> list[PluginInfo]:
    """Every installed plugin, loaded and classified in a child process.

    Plugins import torch (and their own dependencies): listing them here would load
    ~1 GB into the app for a table of names. The child prints one JSON line.
    """
    proc = subprocess.run(
        [sys.executable, "-c", "from tunekit.tui.backend import _print_plugins; _print_plugins()"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise PluginError(f"could not list the installed plugins: {why}")
    return [PluginInfo(**d) for d in json.loads(lines[-1])]


def _print_plugins() -> None:
    """In the child of :func:`plugin_infos`."""
    from tunekit.plugin_loading import load_all

    infos = [
        PluginInfo(r.name, r.package, r.status, r.error, r.title, r.aspect) for r in load_all()
    ]
    print(json.dumps([asdict(i) for i in infos]))


@dataclass
class DiagnosisResult:
    """One tuner's diagnosis and plan for the live job, or why it failed."""

    name: str
    applies: bool | None = None
    summary: str = ""
    expected_gain: float | None = None
    candidates: tuple[CandidateView, ...] = ()
    error: str | None = None
    baseline: BaselineView | None = None
    """What the predictions are against (the same for every tuner of one diagnosis)."""
    headline: str = ""
    """The diagnosis in one line (derived from the rest where the tuner gives none)."""


Progress = Callable[[str | None, str], None]
"""``(tuner or None for the observation, what it does now)``."""


class Backend(ABC):
    """What the screens need; see the module docstring."""

    run_id: str
    workload: str
    nproc: int
    owns_job: bool
    """True when the app started the job (and stops it on quit)."""

    def start(self) -> list[str]:
        """Begin sampling; return notices to show once (no GPU, no py-spy ...)."""
        return []

    def screenshot_dir(self) -> Path:
        """Where the app's screenshots go (created on first use): the working directory."""
        return Path.cwd()

    @abstractmethod
    def poll(self) -> LiveSnapshot:
        """The job's state now (reads files; cheap, but call it from a worker)."""

    @abstractmethod
    def plugins(self) -> Sequence[PluginInfo]:
        """Every installed plugin, loaded and classified (blocking)."""

    @abstractmethod
    def diagnose(
        self, names: Sequence[str], limit: int, on_progress: Progress = lambda name, what: None
    ) -> Iterator[DiagnosisResult]:
        """Each named tuner's diagnosis and candidates for the live job, one at a time (blocking).

        ``on_progress(tuner, what)`` hears what runs now: the observation they share
        (``tuner`` None: "timing 11 layers standalone"), then each tuner's hooks."""

    @abstractmethod
    def profile(
        self, on_stage: Callable[[str], None]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A profiled run: ``tunekit profile``'s report and its py-spy samples (blocking)."""

    @abstractmethod
    def tune(self, request: TuneRequest) -> AsyncIterator[Event]:
        """The orchestrator's events for a tuning of the job's workload."""

    @abstractmethod
    def trial_config(self, study_id: int, trial_id: int) -> dict[str, Any] | None:
        """The config a finished trial measured (a search trial's is the one it found)."""

    @abstractmethod
    def apply(self, config: Mapping[str, Any]) -> ApplyOutcome:
        """Apply ``config`` to the live job and wait for the watch verdict (blocking)."""

    @abstractmethod
    def rollback(self) -> ApplyOutcome:
        """Go back to the config before the last apply (blocking)."""

    @abstractmethod
    def close(self, stop_job: bool) -> None:
        """Stop sampling; stop the job too when ``stop_job`` (and the app started it)."""


# -- the real backend ----------------------------------------------------------------------


class LiveBackend(Backend):
    """The real backend for one live run (see the module docstring)."""

    def __init__(
        self,
        rd: RunDir,
        store_dir: Path,
        *,
        job: JobProcess | None = None,
        device: str = "auto",
        telemetry_interval_s: float = 1.0,
        pyspy_interval_s: float = 5.0,
    ):
        self.rd = rd
        self.job = job
        self.owns_job = job is not None
        self.store_dir = Path(store_dir)
        self.device = device
        spec = rd.read_run()
        self.run_id = rd.run_id
        self.workload = spec["workload"]
        self.nproc = int(spec.get("nproc") or 1)
        self.memory_cap_bytes: int | None = spec.get("memory_cap_bytes")
        self.out_dir = self.store_dir / "tui" / self.run_id
        self._tail = MetricsTail(rd.metrics_file, HISTORY)
        self._sampler = TelemetrySampler(
            rd.path / "pids",
            interval_s=telemetry_interval_s,
            pyspy_interval_s=pyspy_interval_s,
            max_samples=4 * HISTORY,
        )
        self._profile_report: dict[str, Any] | None = None

    def start(self) -> list[str]:
        self._sampler.start()
        return list(self._sampler.notices)

    def poll(self) -> LiveSnapshot:
        status = self.rd.read_status()
        code = self.job.returncode if self.job is not None else None
        if code is not None and status.get("status") in ("starting", "running", "relaunching"):
            status = {
                **status,
                "status": "exited",
                "error": status.get("error") or last_error(self.job.log_path),
            }
        if status.get("world_size"):
            self.nproc = int(status["world_size"])
        series = {
            name: self._sampler.series.samples(name)[-HISTORY:]
            for name in ("host", "nvml", "pyspy")
        }
        return LiveSnapshot(
            status,
            self._tail.read(),
            series,
            self._sampler.static(),
            list(self._sampler.notices),
            [e for e in self.rd.read_events() if e.get("kind") in CHANGE_KINDS],
            len(self.rd.read_run().get("applied") or []),
        )

    def plugins(self) -> list[PluginInfo]:
        return plugin_infos()

    def diagnose(
        self, names: Sequence[str], limit: int, on_progress: Progress = lambda name, what: None
    ) -> Iterator[DiagnosisResult]:
        from tunekit.observe.breakdown import Breakdown
        from tunekit.observe.static import observe_static
        from tunekit.planning import diagnose_and_plan_here
        from tunekit.plugin_loading import load_all
        from tunekit.store import Store

        on_progress(None, "loading the tuners")
        records = {r.name: r for r in load_all()}
        store = Store.open_default(self.store_dir)
        try:
            static = observe_static(
                self.workload,
                self.nproc,
                self.device,
                None,
                store,
                on_stage=lambda what: on_progress(None, what),
            )
            metrics = self._tail.read()
            baseline = live_baseline(metrics, self.nproc)
            obs = static.observation(
                self.nproc, baseline, store, memory_cap_bytes=self.memory_cap_bytes
            )
            against = BaselineView(
                obs.global_batch,
                baseline.median_s if baseline else None,
                f"the live job's last {len(baseline.step_s)} untuned steps"
                if baseline
                else "no measured baseline (the job runs a tuned config, or has too few steps): "
                "predictions from the models alone",
            )
            if self._profile_report and self._profile_report.get("nproc") == self.nproc:
                obs.breakdown = Breakdown.from_dict(self._profile_report["breakdown"])
                obs.telemetry = self._profile_report.get("telemetry")
            tuners: dict[str, Tuner] = {}
            for name in names:  # those that cannot run say so first; the rest diagnose in turn
                rec = records.get(name)
                if rec is None or not rec.ok:
                    yield DiagnosisResult(
                        name, error=rec.error if rec else "not installed", baseline=against
                    )
                else:
                    tuners[name] = rec.tuner
            for step in diagnose_and_plan_here(
                tuners, obs, limit, hooks=_saying(tuners, obs, on_progress)
            ):
                result = _diagnosis_result(step, tuners[step.name], against)
                if result is not None:
                    yield result
        finally:
            store.close()

    def profile(
        self, on_stage: Callable[[str], None]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        import json

        from tunekit.observe.profile_job import ProfileOptions, profile_job

        out = self.out_dir / "profile"
        with contextlib.ExitStack() as held:
            # Hold the job while the profiled run measures: sharing the CPUs would skew both.
            if self._job_running():
                try:
                    reply = held.enter_context(
                        client(self.rd).paused("tunekit tui is profiling the workload")
                    )
                    on_stage(f"run {self.run_id} paused at step {reply.get('paused_at')}")
                except ControlError as exc:
                    on_stage(f"run {self.run_id} not paused ({exc}): the run shares the machine")
            report = profile_job(
                self.workload,
                ProfileOptions(nproc=self.nproc, out_dir=out, device=self.device),
                on_stage=on_stage,
            )
        self._profile_report = report
        try:
            series = json.loads((out / "telemetry.json").read_text())["series"].get("pyspy", [])
        except (OSError, ValueError, KeyError):
            series = []
        return report, series

    def tune(self, request: TuneRequest) -> AsyncIterator[Event]:
        from tunekit.orchestrator import AutoSettings, run_auto

        settings = AutoSettings(
            workload=self.workload,
            nproc=self.nproc,
            plugins=request.plugins,
            trials=request.trials,
            steps=request.steps,
            warmup=request.warmup,
            timeout_s=request.timeout_s,
            min_effect=request.min_effect,
            out_dir=self.out_dir / "tuning",
            store_dir=self.store_dir,
            device=self.device,
            pause_run=self.rd if request.pause_job and self._job_running() else None,
            memory_cap_bytes=self.memory_cap_bytes,
        )
        return run_auto(settings)

    def _job_running(self) -> bool:
        return self.rd.read_status().get("status") == "running"

    def trial_config(self, study_id: int, trial_id: int) -> dict[str, Any] | None:
        from tunekit.store import Store

        store = Store.open_default(self.store_dir)
        try:
            row = next((t for t in store.trials(study_id) if t.id == trial_id), None)
        finally:
            store.close()
        if row is None:
            return None
        return {k: v for k, v in row.config.items() if k != "search"}

    def apply(self, config: Mapping[str, Any]) -> ApplyOutcome:
        return apply_to_run(self.rd, TuningConfig.from_dict(dict(config)))

    def rollback(self) -> ApplyOutcome:
        reply = client(self.rd).request("rollback")
        return ApplyOutcome(f"rolled back at step {reply.get('step')}", reply)

    def close(self, stop_job: bool) -> None:
        self._sampler.stop()
        if stop_job and self.job is not None:
            self.job.stop()


def attach(run: str, store_dir: Path, device: str = "auto", **options: Any) -> LiveBackend:
    """A backend for a run started elsewhere (``tunekit run``); it is left running on quit.

    ``options`` go to :class:`LiveBackend` (telemetry intervals)."""
    rd = RunDir.find(run, store_dir)
    if not rd.read_run().get("workload"):
        raise WorkloadError(f"run {rd.run_id} names no workload")
    return LiveBackend(rd, store_dir, device=device, **options)


def _saying(tuners: Mapping[str, Tuner], obs: Any, on_progress: Progress) -> Any:
    """The in-process hooks, saying which tuner runs which hook before it runs it (made here:
    :mod:`tunekit.planning` imports torch, which the idle app never needs)."""
    from tunekit.planning import InProcessHooks

    class SayingHooks(InProcessHooks):
        async def diagnose(self, name: str):
            on_progress(name, "diagnosing")
            return await super().diagnose(name)

        async def plan(self, name: str, limit: int):
            on_progress(name, "planning its candidates")
            return await super().plan(name, limit)

    return SayingHooks(tuners, obs)


def _diagnosis_result(
    step: TunerStep, tuner: Tuner, against: BaselineView
) -> DiagnosisResult | None:
    """The app's row for a tuner once its diagnose-and-plan is over (None while its plan is to come)."""
    from tunekit.planning import TunerFailed, TunerPlanned

    if isinstance(step, TunerFailed):
        return DiagnosisResult(step.name, error=step.problem, baseline=against)
    diag = step.diagnosis
    if not isinstance(step, TunerPlanned):
        if diag.applies:
            return None
        return DiagnosisResult(
            step.name,
            diag.applies,
            diag.summary,
            diag.expected_gain,
            baseline=against,
            headline=headline_of(diag),
        )
    try:
        defaults = tuner.defaults()
        cands = tuple(
            candidate_view(step.name, {**asdict(c), "knobs": cfg.plugins[step.name]}, defaults)
            for c, cfg in zip(step.candidates, step.configs, strict=True)
        )
    except Exception as exc:  # a broken plugin is a notification, not a crash
        return DiagnosisResult(step.name, error=f"{type(exc).__name__}: {exc}", baseline=against)
    return DiagnosisResult(
        step.name,
        diag.applies,
        diag.summary,
        diag.expected_gain,
        cands,
        baseline=against,
        headline=headline_of(diag),
    )
