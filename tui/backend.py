"""The app's only way to the job and the core: :class:`Backend`.

:class:`LiveBackend` is the real one. It reads a live run's files
(``status.json``, ``metrics.jsonl``), samples its ranks' telemetry, talks to
its control socket, and calls the core's observation, tuners and
orchestrator. Every method that blocks is called from a worker thread, never
from the UI's event loop. Tests give the app a backend with fixed data
instead, so that every screen can be driven without processes.

:class:`JobProcess` starts the live job as a ``tunekit run`` child process.
A separate process, not a thread of the app: the job's supervisor and its
torchrun ranks must outlive anything that goes wrong in the UI (a crash
leaves the job running, to be attached to again), and the supervisor's own
signal handling (Ctrl+C checkpoints and stops the ranks) keeps working. On a
normal quit the app asks the job to checkpoint and stop over the control
socket, and escalates to signals only if it will not.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tunekit.config import TuningConfig
from tunekit.errors import ControlError, TunekitError, WorkloadError
from tunekit.events import Event
from tunekit.observe.telemetry import TelemetrySampler, read_pid_dir
from tunekit.plugin_loading import PluginRecord, load_all
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, last_error
from tunekit.tui.state import HISTORY, BaselineView, CandidateView, candidate_view

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
    def plugins(self) -> list[PluginRecord]:
        """Every installed plugin, loaded and classified."""

    @abstractmethod
    def diagnose(self, names: Sequence[str], limit: int) -> Iterator[DiagnosisResult]:
        """Each named tuner's diagnosis and candidates for the live job, one at a time (blocking)."""

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
    def apply(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Apply ``config`` to the live job and wait for the watch verdict (blocking).

        Returns the job's reply with ``message`` and ``rolled_back``."""

    @abstractmethod
    def rollback(self) -> dict[str, Any]:
        """Go back to the config before the last apply (blocking)."""

    @abstractmethod
    def close(self, stop_job: bool) -> None:
        """Stop sampling; stop the job too when ``stop_job`` (and the app started it)."""


# -- the live job as a child process -------------------------------------------------------


class JobProcess:
    """A ``tunekit run`` child process started by the app (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, rd: RunDir, log_path: Path):
        self.proc = proc
        self.rd = rd
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        workload: str,
        *,
        nproc: int,
        store_dir: Path,
        watch_window: int = 10,
        min_effect: float = 0.02,
        device: str = "auto",
        name: str | None = None,
        timeout_s: float = 120.0,
    ) -> JobProcess:
        """Start the job and return once its run directory exists; a bad workload raises one line."""
        from tunekit.workload import load_workload, resolve_spec

        spec = resolve_spec(workload)
        load_workload(spec)  # fail here, in one clear line, not in a child's log
        run_id = name or time.strftime("tui-%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        logs = Path(store_dir) / "tui"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{run_id}.log"
        cmd = [
            sys.executable,
            "-m",
            "tunekit",
            "run",
            spec,
            "--nproc",
            str(nproc),
            "--name",
            run_id,
            "--store",
            str(store_dir),
            "--watch-window",
            str(watch_window),
            "--min-effect",
            str(min_effect),
            "--device",
            device,
        ]
        with open(log_path, "ab") as log:
            # A session of its own: the terminal's Ctrl+C (Textual's to handle) never reaches it.
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise TunekitError(
                    f"tunekit run exited ({proc.returncode}): {last_error(log_path)}"
                )
            try:
                return cls(proc, RunDir.find(run_id, store_dir), log_path)
            except ControlError:
                if time.monotonic() > deadline:
                    cls(proc, RunDir(Path(store_dir) / "runs" / run_id), log_path).stop(wait_s=5)
                    raise TunekitError(
                        f"tunekit run did not create its run directory in {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.1)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def stop(self, wait_s: float = 60.0) -> int | None:
        """Checkpoint and stop the job; signals only if it will not stop. Returns the exit code."""
        deadline = time.monotonic() + wait_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:  # the socket appears once the ranks are up: keep asking until then
                client(self.rd, timeout_s=max(1.0, deadline - time.monotonic())).request("stop")
                break
            except (ControlError, OSError):
                time.sleep(0.5)
        try:
            return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # The supervisor turns SIGINT into "checkpoint and stop the ranks".
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(timeout=10)

    def kill(self) -> None:
        """Last resort: kill the ranks' process group (the torchrun agent's) and the supervisor."""
        for pid in read_pid_dir(self.rd.path / "pids").values():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
        if self.proc.poll() is None:
            self.proc.kill()


# -- the real backend ----------------------------------------------------------------------


class MetricsTail:
    """The last lines of ``metrics.jsonl``, read incrementally."""

    def __init__(self, path: Path, keep: int = HISTORY):
        self.path = path
        self.lines: deque[dict[str, Any]] = deque(maxlen=keep)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        import json

        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return list(self.lines)
        if size < self._offset:  # rewritten (a resume truncates it): start over
            self.lines.clear()
            self._offset, self._partial = 0, b""
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        for line in complete:
            if line.strip():
                try:
                    self.lines.append(json.loads(line))
                except ValueError:
                    continue
        return list(self.lines)


def live_baseline(metrics: Sequence[Mapping[str, Any]], world_size: int, min_steps: int = 8):
    """The live job's recent steps as a baseline :class:`Measurement`, when it runs the untuned config.

    The first steps after a config change or a relaunch are left out (warm-up).
    """
    from tunekit.trials.stats import summarize

    base_id = TuningConfig().config_id
    run: list[Mapping[str, Any]] = []
    for m in metrics:  # the trailing run of baseline steps at this world size
        if m.get("config_id") == base_id and m.get("world_size") == world_size:
            run.append(m)
        else:
            run = []
    steps = [m["step_s"] for m in run[3:] if m.get("step_s")]
    if len(steps) < min_steps:
        return None
    return summarize(steps, int(run[-1].get("batch_size", 0)) * world_size)


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
        self.out_dir = self.store_dir / "tui" / self.run_id
        self._tail = MetricsTail(rd.metrics_file)
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
            status, self._tail.read(), series, self._sampler.static(), list(self._sampler.notices)
        )

    def plugins(self) -> list[PluginRecord]:
        return load_all()

    def diagnose(self, names: Sequence[str], limit: int) -> Iterator[DiagnosisResult]:
        from tunekit.observe.breakdown import Breakdown
        from tunekit.orchestrator import observe_static
        from tunekit.store import Store

        records = {r.name: r for r in load_all()}
        store = Store.open_default(self.store_dir)
        try:
            static = observe_static(self.workload, self.nproc, self.device, None, store)
            metrics = self._tail.read()
            baseline = live_baseline(metrics, self.nproc)
            obs = static.observation(self.nproc, baseline, store)
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
            for name in names:
                rec = records.get(name)
                if rec is None or not rec.ok:
                    yield DiagnosisResult(
                        name, error=rec.error if rec else "not installed", baseline=against
                    )
                    continue
                tuner = rec.tuner
                try:
                    diag = tuner.diagnose(obs)
                    plan = tuner.plan(obs, limit) if diag.applies else []
                    defaults = tuner.defaults()
                    cands = tuple(
                        candidate_view(
                            name, {**asdict(c), "knobs": tuner.validate(c.knobs)}, defaults
                        )
                        for c in plan
                    )
                except Exception as exc:  # a broken plugin is a notification, not a crash
                    yield DiagnosisResult(
                        name, error=f"{type(exc).__name__}: {exc}", baseline=against
                    )
                    continue
                yield DiagnosisResult(
                    name, diag.applies, diag.summary, diag.expected_gain, cands, baseline=against
                )
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

    def apply(self, config: Mapping[str, Any]) -> dict[str, Any]:
        from tunekit.cli.run import apply_to_run

        return apply_to_run(self.rd, TuningConfig.from_dict(dict(config)))

    def rollback(self) -> dict[str, Any]:
        reply = client(self.rd).request("rollback")
        return {**reply, "message": f"rolled back at step {reply.get('step')}"}

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
