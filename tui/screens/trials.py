"""Trials: the running tuning's progress, every trial's prediction and measurement, the best so far."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import DataTable, Label, ProgressBar, Static

from tunekit.tui.formatting import ms, number, pct, size, speedup
from tunekit.tui.screens.base import TunekitScreen
from tunekit.tui.state import StudyView, TrialView
from tunekit.tui.widgets import PredictedVsMeasured

STATUS_STYLE = {
    "ok": "green",
    "running": "yellow",
    "crash": "red",
    "oom": "red",
    "hang": "red",
    "too_slow": "red",
    "skipped": "dim",
}


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, with an ellipsis when cut (the apply screen shows all)."""
    return text if len(text) <= width else text[: width - 1] + "…"


class TrialTable(DataTable):
    """One row per trial; ``a`` applies the highlighted trial's config, enter makes it the apply target."""

    BINDINGS = [
        Binding("a", "apply", "Apply…"),
        Binding("enter", "pick", "Pick for apply", show=False),
    ]

    class ApplyRequested(Message):
        """The user wants trial ``trial_id``'s config on the live job; ``confirm_now``: ask right away."""

        def __init__(self, trial_id: int, confirm_now: bool):
            super().__init__()
            self.trial_id = trial_id
            self.confirm_now = confirm_now

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)

    def on_mount(self) -> None:
        # Times per step of the trial's own batch; samples/s is what the decision compares.
        # error = |prediction - measured| / measured, raw -> corrected by earlier trials.
        for col in (
            "#",
            "role",
            "config",
            "predicted step",
            "corrected",
            "measured step",
            "samples/s",
            "error",
            "peak/rank",
            "status",
            "note",
        ):
            self.add_column(col, key=col)

    def show(self, trials: tuple[TrialView, ...]) -> None:
        row = self.cursor_row
        self.clear()
        for t in trials:
            measured = "—" if t.median_s is None else f"{ms(t.median_s)} ± {ms(t.spread_s)}"
            self.add_row(
                str(t.seq),
                t.role,
                clip(t.description, 40),
                ms(t.predicted_s),
                ms(t.corrected_s),
                measured,
                number(t.samples_per_s),
                prediction_errors(t),
                peaks(t),
                Text(t.status, style=STATUS_STYLE.get(t.status, "red")),
                (t.error or "")[:60],
                key=str(t.trial_id),
            )
        if trials:
            self.move_cursor(row=min(row, len(trials) - 1))

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


def study_line(study: StudyView) -> Text:
    style = {"running": "yellow", "finished": "green", "failed": "red", "cancelled": "red"}.get(
        study.state, "dim"
    )
    text = Text(f"tuning {study.state}", style=f"bold {style}")
    if study.study_id is not None:
        text.append(f" · study {study.study_id}")
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


def best_text(study: StudyView) -> Text:
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
    return text


class TrialsScreen(TunekitScreen):
    """See the module docstring."""

    BINDINGS = [
        Binding("t", "app.tune", "Tune"),
        Binding("x", "app.cancel_tuning", "Cancel"),
    ]
    FOLLOWS = (("study_view", "show_study"),)

    def compose_body(self) -> ComposeResult:
        yield Static(id="study-line")
        with Horizontal(id="progress-row"):
            yield Label("trials", classes="progress-label")
            yield ProgressBar(id="study-progress", show_eta=False)
            yield Label("steps", classes="progress-label")
            yield ProgressBar(id="trial-progress", show_eta=False)
        yield TrialTable(id="trials")
        with Horizontal(id="trials-bottom"):
            yield PredictedVsMeasured(id="plot")
            yield Static(id="best")

    def show_study(self, study: StudyView) -> None:
        self.query_one("#study-line", Static).update(study_line(study))
        # Never an indeterminate bar: its animation would make the screen depend on the clock.
        done = study.index - (1 if study.current is not None else 0)
        if study.state == "finished":
            done = study.total  # trials skipped at the end (the budget) never started
        self.query_one("#study-progress", ProgressBar).update(total=study.total or 1, progress=done)
        self.query_one("#trial-progress", ProgressBar).update(
            total=study.steps or 1, progress=study.step
        )
        self.query_one(TrialTable).show(study.trials)
        self.query_one(PredictedVsMeasured).points = tuple(
            (t.predicted_s, t.median_s, str(t.seq), t.role)
            for t in study.trials
            if t.predicted_s and t.median_s
        )
        self.query_one("#best", Static).update(best_text(study))
