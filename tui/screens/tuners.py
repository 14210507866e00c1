"""Tuners: every installed plugin — loaded?, enabled?, applies?, its diagnosis, gain and planned candidates."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable, Label, Static

from tunekit.tui.formatting import ms, number, pct, size, speedup
from tunekit.tui.screens.base import TunekitScreen
from tunekit.tui.state import BaselineView, CandidateView, StudyView, TunerView


def applies_cell(t: TunerView) -> Text:
    if not t.loaded:
        return Text(t.status, style="red")
    if t.state == "diagnosing":
        return Text("…", style="yellow")
    if t.state == "failed":
        return Text("failed", style="red")
    if t.applies is None:
        return Text("—", style="dim")
    return Text("yes", style="green") if t.applies else Text("no", style="dim")


class TunerTable(DataTable):
    """One row per plugin; space toggles whether the next tuning uses it."""

    BINDINGS = [Binding("space", "toggle", "On/off")]

    class Toggled(Message):
        """The user asked to enable or disable ``plugin``."""

        def __init__(self, plugin: str):
            super().__init__()
            self.plugin = plugin

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", **kwargs)

    def on_mount(self) -> None:
        for col in ("use", "tuner", "aspect", "applies", "gain", "best predicted", "diagnosis"):
            self.add_column(col, key=col)

    def show(self, tuners: tuple[TunerView, ...], baseline: BaselineView | None = None) -> None:
        row = self.cursor_row
        self.clear()
        for t in tuners:
            mark = Text("[x]", style="bold green") if t.enabled else Text("[ ]", style="dim")
            top = t.best(baseline)
            summary = t.summary or (t.error if not t.loaded else "")
            self.add_row(
                mark,
                Text(t.name, style="bold" if t.enabled else "dim"),
                t.aspect or "—",
                applies_cell(t),
                pct(t.expected_gain),
                predicted_rate(top, baseline),
                summary[:90] + ("…" if len(summary) > 90 else ""),
                key=t.name,
            )
        if tuners:
            self.move_cursor(row=min(row, len(tuners) - 1))

    def action_toggle(self) -> None:
        if self.row_count:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
            self.post_message(self.Toggled(str(key.value)))


class CandidateTable(DataTable):
    """The highlighted tuner's planned candidates, in the tuner's own order."""

    def __init__(self, **kwargs):
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)

    def on_mount(self) -> None:
        for col in ("#", "config", "predicted", "step", "peak/rank", "why"):
            self.add_column(col, key=col)

    def show(self, tuner: TunerView | None, baseline: BaselineView | None = None) -> None:
        self.clear()
        for i, c in enumerate(tuner.candidates if tuner else (), 1):
            self.add_row(
                str(i),
                c.description,
                predicted_rate(c, baseline),
                candidate_step(c, baseline),
                size(c.predicted_peak_bytes),
                c.rationale,
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
    if t is None:
        return Text("no plugins installed", style="dim")
    text = Text(t.name, style="bold")
    text.append(f" — {t.title or '?'} · aspect {t.aspect or '?'} · {t.package}\n", style="dim")
    if not t.loaded:
        text.append(f"{t.status}: {t.error}", style="red")
        return text
    if t.state == "failed":
        text.append(t.summary, style="red")
    elif t.summary:
        text.append(
            ("applies: " if t.applies else "does not apply: "),
            style="green" if t.applies else "yellow",
        )
        text.append(t.summary)
    else:
        text.append("not diagnosed yet: press d, or start a tuning with t", style="dim")
    return text


def tune_line(study: StudyView, settings: str, enabled: int, pauses_job: bool = False) -> Text:
    if study.running:
        text = Text("tuning: ", style="bold")
        trial = f"trial {study.index} of {study.total} · " if study.total else ""
        text.append(f"running · {trial}{study.message}", style="yellow")
        text.append(" · 4 shows the trials, x cancels", style="dim")
        return text
    text = Text("tuning: ", style="bold")
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
    )

    def compose_body(self) -> ComposeResult:
        yield Static(id="tune-line")
        yield Static(id="tuner-baseline")
        yield TunerTable(id="tuners")
        yield Static(id="tuner-detail")
        yield Label("planned candidates", classes="section")
        yield CandidateTable(id="candidates")

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

    def show_study(self, study: StudyView) -> None:
        enabled = sum(t.enabled for t in self.tk.tuner_views)
        self.query_one("#tune-line", Static).update(
            tune_line(
                study, self.tk.tune_request.describe(), enabled, self.tk.tune_request.pause_job
            )
        )

    def _show_detail(self) -> None:
        t = self.highlighted()
        self.query_one("#tuner-detail", Static).update(detail_text(t))
        self.query_one(CandidateTable).show(t, self.tk.tuner_baseline)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "tuners":
            self._show_detail()
