"""The tunekit app: six screens over one state, fed by workers that never block the UI.

State lives in the app's reactive attributes (``live_view``, ``profile_view``,
``tuner_views``, ``study_view``, ``apply_view`` ...); each screen follows the ones
it renders. Everything slow runs in a worker thread — polling the job,
diagnosing, profiling, the tuning itself (``run_auto`` on its own event loop),
applying — and hands results back with ``call_from_thread``. A worker that
fails becomes a notification, never a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.reactive import var
from textual.screen import Screen
from textual.worker import Worker, WorkerState, get_current_worker

from tunekit.errors import TunekitError
from tunekit.events import Event, Notice, Observed, PluginProblem, StudyFinished, TrialFinished
from tunekit.runtime.client import ApplyOutcome
from tunekit.tui.backend import Backend, DiagnosisResult, LiveSnapshot, PluginInfo, TuneRequest
from tunekit.tui.formatting import describe_config
from tunekit.tui.screens.apply import ApplyScreen
from tunekit.tui.screens.confirm import ConfirmScreen
from tunekit.tui.screens.help import HelpScreen
from tunekit.tui.screens.live import LiveScreen
from tunekit.tui.screens.profile import ProfileScreen
from tunekit.tui.screens.trials import TrialsScreen, TrialTable
from tunekit.tui.screens.tuners import TunersScreen, TunerTable
from tunekit.tui.state import (
    ApplyTarget,
    ApplyView,
    BaselineView,
    HotSpots,
    LiveView,
    ProfileView,
    StudyView,
    TunerView,
    baseline_from_observed,
    best_target,
    diagnosis_over,
    end_study,
    fold_study,
    fold_tuners,
    hotspots,
    live_view,
    profile_from_observed,
    profile_from_report,
    replace_tuner,
    start_diagnosis,
    trial_target,
    tuner_views,
)

SCREENS = {
    "live": ("Live", LiveScreen),
    "profile": ("Profile", ProfileScreen),
    "tuners": ("Tuners", TunersScreen),
    "trials": ("Trials", TrialsScreen),
    "apply": ("Apply", ApplyScreen),
    "help": ("Help", HelpScreen),
}

STYLES = Path(__file__).parent

QUIT, DETACH = "quit", "detach"
"""What :meth:`App.run` returns: stop a job the app started, or leave it running."""


def prepare_process() -> None:
    """Start multiprocessing's resource tracker while ``sys.stderr`` is still the real one.

    Core code the workers call may start processes with multiprocessing (the
    hardware probe's ranks). The tracker it needs is started on first use
    with ``sys.stderr.fileno()`` among the descriptors to pass, and inside a
    running app that is Textual's print capture, whose ``fileno()`` is -1:
    starting it now avoids "bad value(s) in fds_to_keep".
    """
    from multiprocessing import resource_tracker

    try:
        resource_tracker.ensure_running()
    except Exception:  # a platform without it: nothing to prepare
        pass


def start_profiler() -> None:
    """torch.profiler's first start, in the main thread (kineto complains from another);
    only when a diagnosis needs it: it imports torch, which the idle app does without."""
    from tunekit.observe.kineto import start_profiler_in_main_thread

    start_profiler_in_main_thread()


def one_line(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, TunekitError) else f"{type(exc).__name__}: {exc}"


class TunekitApp(App[str]):
    """See the module docstring. ``backend`` is the job and the core (:class:`LiveBackend`, or fixed data in tests)."""

    TITLE = "tunekit"
    # Absolute: Textual resolves relative paths against the module of the (sub)class that runs.
    CSS_PATH = [
        STYLES / f"{name}.tcss" for name in ("app", "live", "profile", "tuners", "trials", "apply")
    ]
    MODES = {mode: cls for mode, (_, cls) in SCREENS.items()}
    # Classes each screen carries for the terminal's size (its stylesheet lays it out by them):
    # one column below 100 columns, whole configs from 160; taller charts from 32 and 50 rows,
    # less room for text below 22.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-medium"), (160, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-tiny"), (22, "-short"), (32, "-tall"), (50, "-taller")]
    DEFAULT_MODE = "live"
    # Help and Quit before the screens: a narrow footer cuts from the right, and these two
    # must stay in sight at 80 columns (each screen's own keys come first, see the tests).
    BINDINGS = [
        Binding("question_mark,f1", "show('help')", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        Binding("1", "show('live')", "Live"),
        Binding("2", "show('profile')", "Profile"),
        Binding("3", "show('tuners')", "Tuners"),
        Binding("4", "show('trials')", "Trials"),
        Binding("5", "show('apply')", "Apply"),
        Binding("t", "tune", "Tune", show=False),
    ]

    live_view: var[LiveView] = var(LiveView())
    live_hotspots: var[tuple[HotSpots, ...]] = var(())
    profile_view: var[ProfileView | None] = var(None)
    profile_stage: var[str] = var("")
    tuner_views: var[tuple[TunerView, ...]] = var(())
    diagnosis_stage: var[str] = var("")
    """What a diagnosis started with d does before any tuner runs (loading, tracing, timing)."""
    tuner_baseline: var[BaselineView | None] = var(None)
    """What the tuners' predictions on show are against (a diagnosis's or a tuning's baseline)."""
    study_view: var[StudyView] = var(StudyView())
    apply_view: var[ApplyView] = var(ApplyView())

    def __init__(
        self,
        backend: Backend,
        tune_request: TuneRequest | None = None,
        *,
        poll_s: float = 1.0,
        plan_limit: int = 5,
    ):
        super().__init__()
        prepare_process()
        self.backend = backend
        self.tune_request = tune_request or TuneRequest()
        self.poll_s = poll_s
        self.plan_limit = plan_limit
        self._target_pinned = False  # the user picked a trial: a new best does not replace it
        self._polling = False
        self._pyspy_seen: tuple[int, float | None] = (0, None)
        self.clock = time.monotonic
        """When trials start and end (their wall times give the tuning's time left)."""
        self._said: set[str] = set()  # notices shown once already (no GPU ...): never repeated

    # -- start-up ----------------------------------------------------------------------------

    def on_mount(self) -> None:
        # The run id first: a narrow header cuts from the right, and it must stay in sight.
        self.sub_title = f"run {self.backend.run_id} · {self.backend.workload}"
        self.live_view = LiveView(
            run_id=self.backend.run_id,
            workload=self.backend.workload,
            attached=not self.backend.owns_job,
        )
        if self.backend.owns_job:
            self.notify(
                f"q checkpoints and stops it. If this terminal closes, the job keeps running: "
                f"`tunekit tui --attach {self.backend.run_id}` watches it again.",
                title=f"run {self.backend.run_id} was started by this app",
                timeout=15,
            )
        for notice in self.backend.start():
            self._said.add(notice)
            self.notify(notice, title="telemetry", severity="warning", timeout=10)
        self.load_plugins()
        self.poll()
        self.set_interval(self.poll_s, self.poll)

    @work(thread=True, exclusive=True, group="plugins", exit_on_error=False, name="loading plugins")
    def load_plugins(self) -> None:
        records = self.backend.plugins()
        self.call_from_thread(self._plugins_loaded, records)

    def _plugins_loaded(self, records: Sequence[PluginInfo]) -> None:
        enabled = self.tune_request.plugins
        self.tuner_views = tuner_views(records, enabled)
        for r in records:
            if not r.ok:
                self.notify(
                    f"{r.name} ({r.package}) {r.status}: {r.error}",
                    title="plugin did not load",
                    severity="warning",
                    timeout=10,
                )

    # -- the live job ------------------------------------------------------------------------

    def poll(self) -> None:
        if not self._polling:
            self._polling = True
            self._poll()

    @work(thread=True, group="poll", exit_on_error=False, name="polling the job")
    def _poll(self) -> None:
        try:
            snap = self.backend.poll()
            view = live_view(
                self.backend.run_id,
                self.backend.workload,
                snap.status,
                snap.metrics,
                snap.series,
                snap.static,
                snap.notices,
                attached=not self.backend.owns_job,
                events=snap.events,
                applied=snap.applied,
            )
            spots = self._hotspots(snap)
        except Exception as exc:  # an unreadable run directory: say so once, keep polling
            self._call_ui(self._poll_failed, one_line(exc))
        else:
            self._call_ui(self._polled, view, spots)
        finally:
            self._polling = False

    def _hotspots(self, snap: LiveSnapshot) -> tuple[HotSpots, ...] | None:
        """The live job's hot spots when its py-spy samples changed, else None. Changed is
        a new last sample, not a new count: the series is capped, its count stops growing."""
        spy = snap.series.get("pyspy") or []
        seen = (len(spy), spy[-1].get("t") if spy else None)
        if seen == self._pyspy_seen:
            return None
        self._pyspy_seen = seen
        return hotspots(spy)

    def _poll_failed(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            self.notify(message, title="cannot read the job", severity="error", timeout=10)

    def _polled(self, view: LiveView, spots: tuple[HotSpots, ...] | None) -> None:
        self.live_view = view
        if spots is not None:
            self.live_hotspots = spots

    # -- screens, the command palette --------------------------------------------------------

    def action_show(self, mode: str) -> None:
        self.switch_mode(mode)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield SystemCommand(
            "Start tuning", "Trials of the enabled tuners' candidates (t)", self.action_tune
        )
        yield SystemCommand(
            "Cancel tuning",
            "Stop the running tuning; the study stays resumable (x)",
            self.action_cancel_tuning,
        )
        yield SystemCommand(
            "Diagnose tuners",
            "Each enabled tuner's diagnosis and plan, no trials (d)",
            self.action_diagnose,
        )
        yield SystemCommand(
            "Profile the job",
            "A profiled run: breakdown, layers, hot spots (p)",
            self.action_profile,
        )
        yield SystemCommand(
            "Apply…",
            "Apply the chosen config to the live job, with confirmation (a)",
            self.action_apply,
        )
        yield SystemCommand(
            "Roll back…", "Back to the config before the last apply (r)", self.action_rollback
        )
        for mode, (title, _) in SCREENS.items():
            yield SystemCommand(
                f"Show {title}",
                f"Switch to the {title.lower()} screen",
                lambda mode=mode: self.action_show(mode),
            )
        yield SystemCommand(
            "Detach",
            "Quit and leave the job running (attach again with --attach)",
            self.action_detach,
        )
        yield SystemCommand(
            "Screenshot",
            "Save an SVG of this screen in the working directory",
            # After the palette has closed, so that it is not in the picture.
            lambda: self.set_timer(0.1, self.action_screenshot),
        )
        # Textual's own Screenshot saves to ~/Downloads (and fails where there is none): ours
        # replaces it.
        yield from (c for c in super().get_system_commands(screen) if c.title != "Screenshot")

    async def action_quit(self) -> None:
        self.exit(QUIT)

    def action_detach(self) -> None:
        self.exit(DETACH)

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        """Palette → Screenshot: an SVG of the screen, saved where the backend says (the
        working directory), not in a Downloads folder that may not exist."""
        folder = Path(path) if path else self.backend.screenshot_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.notify(f"cannot create {folder}: {exc}", title="Screenshot", severity="error")
            return
        self.deliver_screenshot(filename, str(folder))

    # -- tuners: enable, diagnose ------------------------------------------------------------

    def on_tuner_table_toggled(self, message: TunerTable.Toggled) -> None:
        tuner = next((t for t in self.tuner_views if t.name == message.plugin), None)
        if tuner is None:
            return
        if not tuner.loaded:
            self.notify(
                f"{tuner.name} did not load ({tuner.status}); it cannot be enabled",
                severity="warning",
            )
            return
        self.tuner_views = replace_tuner(self.tuner_views, tuner.name, enabled=not tuner.enabled)

    def _enabled(self) -> list[str]:
        return [t.name for t in self.tuner_views if t.enabled and t.loaded]

    def action_diagnose(self) -> None:
        names = self._enabled()
        if not names:
            self.notify(
                "enable at least one tuner first (space on the tuners screen)", severity="warning"
            )
            return
        if any(t.state in ("waiting", "diagnosing") for t in self.tuner_views):
            self.notify("a diagnosis is in progress")
            return
        self.tuner_views = start_diagnosis(self.tuner_views, names)
        self.diagnosis_stage = "starting"
        self._diagnose(names)

    @work(thread=True, exclusive=True, group="diagnose", exit_on_error=False, name="diagnosing")
    def _diagnose(self, names: list[str]) -> None:
        try:
            # The tuners profile from this thread: torch.profiler starts in the main one first.
            self.call_from_thread(start_profiler)
            for result in self.backend.diagnose(names, self.plan_limit, self._diagnosis_progress):
                self.call_from_thread(self._diagnosed, result)
        finally:
            self._call_ui(self._diagnosis_over)

    def _diagnosis_progress(self, name: str | None, what: str) -> None:
        """From the worker: what the diagnosis does now (the shared observation, or a tuner's hook)."""
        self._call_ui(self._diagnosis_at, name, what)

    def _diagnosis_at(self, name: str | None, what: str) -> None:
        if name is None:
            self.diagnosis_stage = what
            return
        self.diagnosis_stage = ""
        self.tuner_views = replace_tuner(self.tuner_views, name, state="diagnosing", activity=what)

    def _diagnosed(self, r: DiagnosisResult) -> None:
        if r.baseline is not None:
            self.tuner_baseline = r.baseline
        if r.error:
            self.tuner_views = replace_tuner(
                self.tuner_views, r.name, state="failed", summary=r.error, activity=""
            )
            self.notify(f"{r.name}: {r.error}", title="diagnosis failed", severity="error")
            return
        self.tuner_views = replace_tuner(
            self.tuner_views,
            r.name,
            state="diagnosed",
            activity="",
            applies=r.applies,
            summary=r.summary,
            headline=r.headline,
            expected_gain=r.expected_gain,
            candidates=r.candidates,
        )

    def _diagnosis_over(self) -> None:
        self.diagnosis_stage = ""
        self.tuner_views = diagnosis_over(self.tuner_views)

    # -- profile -----------------------------------------------------------------------------

    def action_profile(self) -> None:
        if self.profile_stage:
            self.notify("a profiled run is already in progress")
            return
        self.profile_stage = "starting"
        self._profile()

    @work(thread=True, exclusive=True, group="profile", exit_on_error=False, name="profiling")
    def _profile(self) -> None:
        try:
            report, spy = self.backend.profile(
                lambda stage: self.call_from_thread(setattr, self, "profile_stage", stage)
            )
            view = profile_from_report(report, spy)
            self.call_from_thread(setattr, self, "profile_view", view)
        finally:
            self.call_from_thread(setattr, self, "profile_stage", "")

    # -- tuning ------------------------------------------------------------------------------

    def action_tune(self) -> None:
        if self.study_view.running:
            self.notify("a tuning is already running (x cancels it)")
            return
        names = self._enabled()
        if not names:
            self.notify(
                "enable at least one tuner first (space on the tuners screen)", severity="warning"
            )
            return
        request = dataclasses.replace(self.tune_request, plugins=names)
        self.study_view = StudyView(
            state="running", message=f"starting {request.describe()} with {', '.join(names)}"
        )
        self._tune(request)

    def action_cancel_tuning(self) -> None:
        if not self.study_view.running:
            self.notify("no tuning is running")
            return
        for w in self.workers:
            if w.group == "tune":
                w.cancel()
        self.notify("cancelling the tuning: the trial in flight is stopped")

    @work(thread=True, exclusive=True, group="tune", exit_on_error=False, name="tuning")
    async def _tune(self, request: TuneRequest) -> None:
        """``run_auto`` on this thread's own event loop; each event goes to the UI as it comes."""
        worker = get_current_worker()
        study_id: list[int] = []

        async def pump() -> None:
            async for ev in self.backend.tune(request):
                config = None
                if getattr(ev, "study_id", None) is not None and not study_id:
                    study_id.append(ev.study_id)
                if isinstance(ev, TrialFinished) and study_id:
                    config = await asyncio.to_thread(
                        self.backend.trial_config, study_id[0], ev.trial_id
                    )
                self.call_from_thread(self._tuning_event, ev, config)

        task = asyncio.ensure_future(pump())
        while not task.done():
            if worker.is_cancelled or not self.is_running:  # cancelled, or the app is gone
                task.cancel()
                break
            await asyncio.wait({task}, timeout=0.2)
        try:
            await task
        except asyncio.CancelledError:
            self._call_ui(
                self._tuning_ended,
                "cancelled",
                "cancelled; `tunekit auto --resume` continues the study",
            )
        except Exception as exc:  # bad settings, a failed baseline: one line, the app goes on
            self._call_ui(self._tuning_ended, "failed", one_line(exc))

    def _call_ui(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the app is closing: nothing left to update
            self.call_from_thread(fn, *args)

    def _tuning_event(self, ev: Event, config: Mapping[str, Any] | None) -> None:
        if isinstance(ev, Notice) and ev.message in self._said:
            return  # the trials' telemetry says "no GPU" again: it was said once
        self.study_view = fold_study(self.study_view, ev, config, self.clock())
        self.tuner_views = fold_tuners(self.tuner_views, ev)
        if isinstance(ev, PluginProblem):
            self.notify(
                f"{ev.plugin} {ev.status}: {ev.error}", title="plugin problem", severity="warning"
            )
        elif isinstance(ev, Notice) and ev.level == "warning":
            self.notify(ev.message, severity="warning")
        elif isinstance(ev, TrialFinished) and ev.status not in ("ok", "skipped"):
            self.notify(
                f"trial {ev.seq} {ev.description}: {ev.status} — {ev.error or 'no error message'}",
                title="trial failed",
                severity="error",
            )
        elif isinstance(ev, Observed):
            self.tuner_baseline = baseline_from_observed(ev.summary) or self.tuner_baseline
            if self.profile_view is None or self.profile_view.source.startswith("baseline"):
                self.profile_view = profile_from_observed(ev.summary)
        elif isinstance(ev, StudyFinished):
            self.notify(f"tuning finished: {self.study_view.message}", title=f"winner: {ev.winner}")
        self._offer_best()

    def _offer_best(self) -> None:
        """The study's best becomes the config to apply, unless the user picked a trial; until
        a new study has one, the last study's stays on offer (its label names its study)."""
        target = best_target(self.study_view)
        if not self._target_pinned and target is not None:
            self.apply_view = dataclasses.replace(self.apply_view, target=target)

    def _tuning_ended(self, state: str, message: str) -> None:
        self.study_view = end_study(self.study_view, state, message)
        self.tuner_views = diagnosis_over(self.tuner_views)
        self.notify(
            f"tuning {state}: {message}", severity="error" if state == "failed" else "warning"
        )

    # -- apply, roll back --------------------------------------------------------------------

    def on_trial_table_apply_requested(self, message: TrialTable.ApplyRequested) -> None:
        trial = self.study_view.trial(message.trial_id)
        target = trial_target(trial) if trial else None
        if target is None:
            self.notify("this trial has no measured config to apply", severity="warning")
            return
        self._target_pinned = True
        self.apply_view = dataclasses.replace(self.apply_view, target=target)
        if message.confirm_now:
            self.action_apply()
        else:
            self.switch_mode("apply")

    def action_target_best(self) -> None:
        self._target_pinned = False
        self._offer_best()

    def action_apply(self) -> None:
        target = self.apply_view.target
        if target is None:
            self.notify("nothing to apply yet: run a tuning, or pick a trial", severity="warning")
            return
        if self.apply_view.state == "applying":
            self.notify("an apply is in progress")
            return
        detail = Text(f"{describe_config(target.config)}\n({target.label})")
        if target.caveat:
            detail.append(f"\nThe decision: {target.caveat}.", style="bold yellow")
        if not target.significant:
            detail.append(
                "\nNot a significant win over the baseline: the watch window will judge it."
            )

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.apply_view = dataclasses.replace(self.apply_view, state="applying", message="")
                self._apply(target)

        self.push_screen(ConfirmScreen(f"Apply to run {self.backend.run_id}?", detail), confirmed)

    @work(thread=True, exclusive=True, group="apply", exit_on_error=False, name="applying")
    def _apply(self, target: ApplyTarget) -> None:
        try:
            result = self.backend.apply(target.config)
        except TunekitError as exc:
            self.call_from_thread(self._applied, "failed", str(exc), None)
            return
        state = (
            "rolled_back" if result.rolled_back else "relaunched" if result.relaunching else "kept"
        )
        self.call_from_thread(self._applied, state, result.message, result)

    def _applied(
        self, state: str, message: str, result: ApplyOutcome | None, requested: bool = False
    ) -> None:
        """An apply's or a rollback's outcome. A rollback that was asked for and done is good
        news; one the watch made after an apply is a warning; only a failure is an error."""
        self.apply_view = dataclasses.replace(
            self.apply_view, state=state, message=message, result=result
        )
        if state == "failed":
            severity, title = "error", "rollback failed" if requested else "apply failed"
        elif state == "rolled_back" and not requested:
            severity, title = "warning", "apply: rolled back by the watch"
        else:
            severity, title = "information", "rolled back" if requested else f"apply: {state}"
        self.notify(message, title=title, severity=severity)

    def action_rollback(self) -> None:
        if not self.live_view.applied:
            self.notify(
                f"nothing to roll back: no config applied to run {self.backend.run_id} "
                "is left to undo",
                severity="warning",
            )
            return
        if self.apply_view.state in ("applying", "rolling_back"):
            self.notify("an apply or a rollback is in progress")
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.apply_view = dataclasses.replace(
                    self.apply_view, state="rolling_back", message=""
                )
                self._rollback()

        self.push_screen(
            ConfirmScreen(
                f"Roll run {self.backend.run_id} back to its config before the last apply?"
            ),
            confirmed,
        )

    @work(thread=True, exclusive=True, group="apply", exit_on_error=False, name="rolling back")
    def _rollback(self) -> None:
        try:
            result = self.backend.rollback()
        except TunekitError as exc:
            self.call_from_thread(self._applied, "failed", str(exc), None, True)
            return
        self.call_from_thread(self._applied, "rolled_back", result.message, result, True)

    # -- failures ----------------------------------------------------------------------------

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A worker that raised: a notification, and the state it left behind undone."""
        if event.state != WorkerState.ERROR:
            return
        worker = event.worker
        message = one_line(worker.error) if worker.error is not None else "failed"
        self.notify(message, title=f"{worker.name} failed", severity="error", timeout=10)
        if worker.group == "apply":
            self.apply_view = dataclasses.replace(self.apply_view, state="failed", message=message)
