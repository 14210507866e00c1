"""Trials: the running tuning's progress, every trial's prediction and measurement, the best so far."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Label, ProgressBar, Static

from tunekit.tui.formatting import duration, ms, number, pct, size, speedup
from tunekit.tui.screens.base import TunekitScreen
from tunekit.tui.state import StudyView, TrialView, TunerView
from tunekit.tui.widgets import Column, FitTable, TrialPoint, TrialsPlot

STATUS_STYLE = {
    "ok": "green",
    "running": "yellow",
    "crash": "red",
    "oom": "red",
    "hang": "red",
    "too_slow": "red",
    "skipped": "dim",
    "cancelled": "yellow",
}


class TrialTable(FitTable):
    """One row per trial; ``a`` applies the highlighted trial's config, enter makes it the apply target.

    Times are per step of the trial's own batch; samples/s is what the decision compares;
    error = |prediction - measured| / measured, raw -> corrected by earlier trials; peak/rank:
    memory per rank, predicted -> measured. On a narrow terminal the columns that matter least go first (numbers are never cut); on a
    wide one the config and the note are whole."""

    BINDINGS = [
        Binding("a", "apply", "Apply…"),
        Binding("enter", "pick", "Pick for apply", show=False),
    ]
    COLUMNS = (
        Column("#", "#"),
        Column("role", "role", priority=5),
        Column("config", "config", grow=True, min_width=14),
        Column("predicted", "predicted step", priority=2),
        Column("corrected", "corrected", priority=5),
        Column("measured", "measured step"),
        Column("samples", "samples/s"),
        Column("error", "error", priority=4),
        Column("peak", "peak/rank", priority=4),
        Column("status", "status"),
        Column("note", "note", priority=3, grow=True, min_width=12),
    )

    class ApplyRequested(Message):
        """The user wants trial ``trial_id``'s config on the live job; ``confirm_now``: ask right away."""

        def __init__(self, trial_id: int, confirm_now: bool):
            super().__init__()
            self.trial_id = trial_id
            self.confirm_now = confirm_now

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)

    def show(self, trials: tuple[TrialView, ...]) -> None:
        self.set_rows(
            [
                (
                    str(t.trial_id),
                    {
                        "#": str(t.seq),
                        "role": t.role,
                        "config": t.description,
                        "predicted": ms(t.predicted_s),
                        "corrected": ms(t.corrected_s),
                        "measured": "—"
                        if t.median_s is None
                        else f"{ms(t.median_s)} ± {ms(t.spread_s)}",
                        "samples": number(t.samples_per_s),
                        "error": prediction_errors(t),
                        "peak": peaks(t),
                        "status": Text(t.status, style=STATUS_STYLE.get(t.status, "red")),
                        "note": t.error or "",
                    },
                )
                for t in trials
            ]
        )

    def _request(self, confirm_now: bool) -> None:
        if self.row_count:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
            self.post_message(self.ApplyRequested(int(key.value), confirm_now))

    def action_apply(self) -> None:
        self._request(True)

    def action_pick(self) -> None:
        self._request(False)


def prediction_errors(t: TrialView) -> str:
    """``12%`` or ``31% → 4%`` (raw, then corrected by the trials before it)."""
    if t.prediction_error is None:
        return "—"
    text = pct(t.prediction_error)
    return text if t.corrected_error is None else f"{text} → {pct(t.corrected_error)}"


def peaks(t: TrialView) -> str:
    """``38.0 MiB → 40.1 MiB``: predicted, then measured peak memory per rank."""
    if t.predicted_peak_bytes is None and t.peak_bytes is None:
        return "—"
    return f"{size(t.predicted_peak_bytes)} → {size(t.peak_bytes)}"


def study_line(study: StudyView, time_left_s: float | None = None) -> Text:
    style = {"running": "yellow", "finished": "green", "failed": "red", "cancelled": "red"}.get(
        study.state, "dim"
    )
    text = Text(f"tuning {study.state}", style=f"bold {style}")
    if study.study_id is not None:
        text.append(f" · study {study.study_id}")
    if study.running and time_left_s is not None:
        text.append(f" · about {duration(time_left_s)} left", style="bold")
    if study.running and study.current is not None:
        t = study.trial(study.current)
        text.append(
            f" · trial {study.index} of {study.total}: {t.role} {t.description}" if t else ""
        )
        if study.phase:
            text.append(
                f" · {study.phase} {study.step}/{study.steps} {ms(study.step_s)}", style="dim"
            )
    if study.message:
        text.append(f"\n{study.message}", style="dim")
    if study.state == "idle":
        text.append(" · start one from the tuners screen (3, then t)", style="dim")
    return text


def best_text(study: StudyView, tuners: tuple[TunerView, ...] = ()) -> Text:
    """The baseline and the best candidate in samples/s, the measure the decision uses
    (per step would favour a smaller batch; a larger one makes steps longer by design)."""
    best = study.best
    text = Text("best so far (samples/s: higher is better)\n", style="bold")
    text.append(f"baseline {number(study.baseline_samples_per_s)} samples/s")
    text.append(f" · {ms(study.baseline_median_s)}/step\n", style="dim")
    if best is None:
        text.append("no candidate measured yet", style="dim")
        return text
    text.append(f"{best.description}: {number(best.samples_per_s)} samples/s", style="green")
    sp = study.speedup(best)
    if sp:
        text.append(f" ({speedup(sp)} the baseline's)")
    text.append(f" · {ms(best.median_s)}/step", style="dim")
    d = study.decision
    if d:
        text.append(f"\ndecision: {d.get('winner')} — {d.get('reason', '')}", style="bold")
        why = measured_over_model(study, tuners)
        if why:
            text.append(f"\n{why}", style="yellow")
    return text


def measured_over_model(study: StudyView, tuners: tuple[TunerView, ...]) -> str:
    """Why a tuner that said "does not apply" won anyway, where it did: the verdict came
    from its model, the win from a measurement (its trial, or the in-job search)."""
    d = study.decision or {}
    trial = study.trial(d["winner_trial"]) if d.get("winner_trial") is not None else None
    if trial is None or trial.plugin is None:
        return ""
    tuner = next((t for t in tuners if t.name == trial.plugin), None)
    if tuner is None or tuner.applies is not False:
        return ""
    how = "its in-job search" if trial.role == "search" else f"trial {trial.seq}"
    return (
        f"{tuner.name}'s model said it does not apply; {how} measured otherwise, and the "
        "decision goes by the measurement"
    )


def trial_points(study: StudyView) -> tuple[TrialPoint, ...]:
    """Every trial that ran or failed, for the plot: measured and predicted samples/s."""
    return tuple(
        TrialPoint(
            t.seq,
            t.role,
            t.samples_per_s,
            t.predicted_samples_per_s,
            failed=t.done and t.status not in ("ok", "skipped", "cancelled"),
        )
        for t in study.trials
        if t.samples_per_s or (t.done and t.status not in ("skipped", "cancelled"))
    )


class TrialsScreen(TunekitScreen):
    """See the module docstring."""

    BINDINGS = [
        Binding("t", "app.tune", "Tune"),
        Binding("x", "app.cancel_tuning", "Cancel"),
    ]
    FOLLOWS = (("study_view", "show_study"), ("tuner_views", "show_tuners"))

    def compose_body(self) -> ComposeResult:
        yield Static(id="study-line")
        with Horizontal(id="progress-row"):
            yield Label("trials", classes="progress-label")
            yield ProgressBar(id="study-progress", show_eta=False)
            yield Label("steps", classes="progress-label")
            yield ProgressBar(id="trial-progress", show_eta=False)
        yield TrialTable(id="trials")
        with Horizontal(id="trials-bottom"):
            yield TrialsPlot(id="plot")
            with VerticalScroll(id="best-box"):
                yield Static(id="best")

    def on_mount(self) -> None:  # (TunekitScreen's on_mount runs too: Textual calls each class's)
        self.set_interval(1.0, self._tick)  # the time left counts down between events

    def _tick(self) -> None:
        if self.tk.study_view.running:
            self._show_line(self.tk.study_view)

    def _show_line(self, study: StudyView) -> None:
        self.query_one("#study-line", Static).update(
            study_line(study, study.time_left_s(self.tk.clock()))
        )

    def show_tuners(self, tuners: tuple[TunerView, ...]) -> None:
        self.query_one("#best", Static).update(best_text(self.tk.study_view, tuners))

    def show_study(self, study: StudyView) -> None:
        self._show_line(study)
        # Never an indeterminate bar: its animation would make the screen depend on the clock.
        # Trials over of the trials planned so far; a cancelled one is over, not done.
        done = (
            study.total
            if study.state == "finished"
            else sum(t.done and t.status != "cancelled" for t in study.trials)
        )
        self.query_one("#study-progress", ProgressBar).update(
            total=max(study.total, done, 1), progress=done
        )
        self.query_one("#trial-progress", ProgressBar).update(
            total=study.steps or 1, progress=study.step
        )
        self.query_one(TrialTable).show(study.trials)
        plot = self.query_one(TrialsPlot)
        plot.points = trial_points(study)
        plot.baseline = study.baseline_samples_per_s
        self.show_tuners(self.tk.tuner_views)
