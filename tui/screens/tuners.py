"""Tuners: every installed plugin — loaded?, enabled?, applies?, its diagnosis, gain and planned candidates."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Label, Static

from tunekit.diagnosis_text import body_points, headline_of
from tunekit.tui.formatting import duration, ms, number, size, speedup
from tunekit.tui.screens.base import TunekitScreen
from tunekit.tui.state import BaselineView, CandidateView, StudyView, TunerView
from tunekit.tui.widgets.table import Column, FitTable


def applies_cell(t: TunerView) -> Text:
    if not t.loaded:
        return Text(t.status, style="red")
    if t.state == "waiting":
        return Text("waiting", style="dim yellow")
    if t.state == "diagnosing":
        return Text("diagnosing…", style="yellow")
    if t.state == "failed":
        return Text("failed", style="red")
    if t.applies is None:
        return Text("—", style="dim")
    return Text("yes", style="green") if t.applies else Text("no", style="dim")


def headline_cell(t: TunerView) -> str:
    """The diagnosis in one line (the loader's or the hook's error for a tuner that failed)."""
    if not t.loaded:
        return t.error
    if t.state == "failed":
        return t.summary
    if t.state in ("waiting", "diagnosing"):
        return t.activity
    return t.headline or (headline_of(t) if t.summary else "")


class TunerTable(FitTable):
    """One row per plugin; space toggles whether the next tuning uses it."""

    BINDINGS = [Binding("space", "toggle", "On/off")]
    COLUMNS = (
        Column("use", "use"),
        Column("tuner", "tuner"),
        Column("applies", "applies"),
        Column("predicted", "best predicted", priority=1),
        Column("headline", "diagnosis", priority=2, grow=True, min_width=12),
        Column("aspect", "aspect", priority=3),
    )

    class Toggled(Message):
        """The user asked to enable or disable ``plugin``."""

        def __init__(self, plugin: str):
            super().__init__()
            self.plugin = plugin

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", **kwargs)

    def show(self, tuners: tuple[TunerView, ...], baseline: BaselineView | None = None) -> None:
        self.set_rows(
            [
                (
                    t.name,
                    {
                        "use": Text("[x]", style="bold green")
                        if t.enabled
                        else Text("[ ]", style="dim"),
                        "tuner": Text(t.name, style="bold" if t.enabled else "dim"),
                        "aspect": t.aspect or "—",
                        "applies": applies_cell(t),
                        "predicted": predicted_rate(t.best(baseline), baseline),
                        "headline": headline_cell(t),
                    },
                )
                for t in tuners
            ]
        )

    def action_toggle(self) -> None:
        if self.row_count:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
            self.post_message(self.Toggled(str(key.value)))


class CandidateTable(FitTable):
    """The highlighted tuner's planned candidates, in the tuner's own order."""

    COLUMNS = (
        Column("#", "#"),
        Column("config", "config", grow=True, min_width=20),
        Column("predicted", "predicted"),
        Column("step", "step", priority=1),
        Column("peak", "peak/rank", priority=1, when_filled=True),
        Column("why", "why", priority=2, grow=True, min_width=16),
    )

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)

    def show(self, tuner: TunerView | None, baseline: BaselineView | None = None) -> None:
        candidates = tuner.candidates if tuner else ()
        peaks = any(c.predicted_peak_bytes is not None for c in candidates)  # else no column
        self.set_rows(
            [
                (
                    str(i),
                    {
                        "#": str(i),
                        "config": c.description,
                        "predicted": predicted_rate(c, baseline),
                        "step": candidate_step(c, baseline),
                        **({"peak": size(c.predicted_peak_bytes)} if peaks else {}),
                        "why": c.rationale,
                    },
                )
                for i, c in enumerate(candidates, 1)
            ]
        )


def predicted_rate(c: CandidateView | None, baseline: BaselineView | None) -> str:
    """``306.2 samples/s (1.11x)``: the predicted throughput and, against a measured
    baseline, the speed-up over the job. Samples/s whatever the batch: one measure."""
    if c is None:
        return "—"
    rate = c.samples_per_s(baseline)
    if rate is None:
        return "no prediction"
    sp = c.speedup(baseline)
    return f"{number(rate)} samples/s" + (f" ({speedup(sp)})" if sp else "")


def candidate_step(c: CandidateView, baseline: BaselineView | None) -> str:
    """The predicted step and its samples: ``209.0 ms × 64``."""
    batch = c.global_batch or (baseline.global_batch if baseline else None)
    return ms(c.predicted_s) + (f" × {batch}" if batch and c.predicted_s else "")


def baseline_text(baseline: BaselineView | None) -> Text:
    """What the predictions are against."""
    text = Text("predictions against: ", style="bold")
    if baseline is None:
        text.append("not diagnosed yet", style="dim")
    elif baseline.step_s is None:
        text.append(baseline.source, style="yellow")
    else:
        text.append(
            f"{number(baseline.samples_per_s)} samples/s ({ms(baseline.step_s)}/step × {baseline.global_batch}),"
            f" {baseline.source}"
        )
    return text


def detail_text(t: TunerView | None) -> Text:
    """The highlighted tuner: its headline, then its diagnosis's body as points."""
    if t is None:
        return Text("no plugins installed", style="dim")
    text = Text(t.name, style="bold")
    text.append(f" — {t.title or '?'} · aspect {t.aspect or '?'} · {t.package}\n", style="dim")
    if not t.loaded:
        text.append(f"{t.status}: {t.error}", style="red")
        return text
    if t.state == "failed":
        text.append(t.summary, style="red")
    elif t.state in ("waiting", "diagnosing"):
        text.append(
            f"{t.activity or 'diagnosing'} …" if t.state == "diagnosing" else "waiting its turn",
            style="yellow",
        )
    elif t.summary or t.headline:
        text.append(headline_cell(t), style="bold green" if t.applies else "bold yellow")
        for point in body_points(t.summary):
            text.append("\n • ")
            text.append(point)
    else:
        text.append("not diagnosed yet: press d, or start a tuning with t", style="dim")
    return text


def tune_line(
    study: StudyView,
    settings: str,
    enabled: int,
    pauses_job: bool = False,
    stage: str = "",
    tuners: tuple[TunerView, ...] = (),
    time_left_s: float | None = None,
) -> Text:
    """The tuning's state (with its time left), or the diagnosis's progress, or what t does."""
    text = Text("tuning: ", style="bold")
    if study.running:
        trial = f"trial {study.index} of {study.total} · " if study.total else ""
        left = f"about {duration(time_left_s)} left · " if time_left_s is not None else ""
        text.append(f"running · {trial}{left}{study.message}", style="yellow")
        text.append(" · 4 shows the trials, x cancels", style="dim")
        return text
    busy = [t for t in tuners if t.state in ("waiting", "diagnosing")]
    if busy or stage:
        text = Text("diagnosing: ", style="bold")
        now = next((t for t in tuners if t.state == "diagnosing"), None)
        if now is not None:
            text.append(f"{now.name}: {now.activity or 'diagnosing'}", style="yellow")
            if len(busy) > 1:
                text.append(f" · {len(busy) - 1} more to go", style="dim")
        else:
            text.append(stage or "starting", style="yellow")
            text.append(f" · then {len(busy)} tuner(s) in turn", style="dim")
        return text
    text.append(f"{study.state} · " if study.state != "idle" else "")
    text.append(
        f"t starts {settings} with the {enabled} enabled tuner(s)"
        f"{', the job paused meanwhile' if pauses_job else ''} · d diagnoses them now",
        style="dim",
    )
    return text


class TunersScreen(TunekitScreen):
    """See the module docstring."""

    BINDINGS = [
        Binding("d", "app.diagnose", "Diagnose"),
        Binding("t", "app.tune", "Tune"),
        Binding("x", "app.cancel_tuning", "Cancel"),
    ]
    FOLLOWS = (
        ("tuner_views", "show_tuners"),
        ("study_view", "show_study"),
        ("tuner_baseline", "show_baseline"),
        ("diagnosis_stage", "show_stage"),
    )

    def compose_body(self) -> ComposeResult:
        yield Static(id="tune-line")
        yield Static(id="tuner-baseline")
        yield TunerTable(id="tuners")
        with VerticalScroll(id="tuner-detail-box"):
            yield Static(id="tuner-detail")
        yield Label("planned candidates", classes="section")
        yield CandidateTable(id="candidates")

    def on_mount(self) -> None:  # (TunekitScreen's on_mount runs too: Textual calls each class's)
        self.set_interval(1.0, self._tick)  # the time left counts down between events

    def _tick(self) -> None:
        if self.tk.study_view.running:
            self.show_study(self.tk.study_view)

    def highlighted(self) -> TunerView | None:
        table = self.query_one(TunerTable)
        tuners = self.tk.tuner_views
        if not tuners or not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return next((t for t in tuners if t.name == key), None)

    def show_tuners(self, tuners: tuple[TunerView, ...]) -> None:
        self.query_one(TunerTable).show(tuners, self.tk.tuner_baseline)
        self._show_detail()
        self.show_study(self.tk.study_view)

    def show_baseline(self, baseline: BaselineView | None) -> None:
        self.query_one("#tuner-baseline", Static).update(baseline_text(baseline))
        self.show_tuners(self.tk.tuner_views)

    def show_stage(self, stage: str) -> None:
        self.show_study(self.tk.study_view)

    def show_study(self, study: StudyView) -> None:
        enabled = sum(t.enabled for t in self.tk.tuner_views)
        self.query_one("#tune-line", Static).update(
            tune_line(
                study,
                self.tk.tune_request.describe(),
                enabled,
                self.tk.tune_request.pause_job,
                self.tk.diagnosis_stage,
                self.tk.tuner_views,
                study.time_left_s(self.tk.clock()),
            )
        )

    def _show_detail(self) -> None:
        t = self.highlighted()
        self.query_one("#tuner-detail", Static).update(detail_text(t))
        self.query_one(CandidateTable).show(t, self.tk.tuner_baseline)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "tuners":
            self._show_detail()
