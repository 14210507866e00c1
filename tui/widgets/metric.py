"""One metric: its name, a chart of its recent values with their scale, and the latest value in words."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Label

from tunekit.tui.widgets.chart import Chart, Series


class MetricRow(Widget):
    """``name  62–97%┤▁▂▃▅▇▆▅  value``: one line, or taller where the screen has the rows.

    The value is drawn whole (its label is as wide as its text); the chart takes what
    is left. The row's height is the screen's business (its stylesheet).
    """

    DEFAULT_CSS = """
    MetricRow { layout: horizontal; height: 1; }
    MetricRow > .metric-name { width: 14; color: $text-muted; }
    MetricRow > Chart { width: 1fr; height: 1fr; margin: 0 1; }
    MetricRow > .metric-value { width: auto; min-width: 8; text-align: right; }
    MetricRow.-empty > Chart { display: none; }
    MetricRow.-empty > .metric-value { width: 1fr; color: $text-muted; text-align: left; }
    """

    def __init__(
        self,
        label: str,
        *,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ):
        super().__init__(name=name, id=id, classes=classes)
        self.metric_name = label
        self._shown: tuple[Series, str] = (Series(), "—")

    def compose(self) -> ComposeResult:
        yield Label(self.metric_name, classes="metric-name")
        yield Chart()
        yield Label("—", classes="metric-value")

    def on_mount(self) -> None:
        self._draw()

    @property
    def series(self) -> Series:
        return self._shown[0]

    @property
    def value_text(self) -> str:
        return self._shown[1]

    def show(self, series: Series, text: str) -> None:
        """Chart ``series`` and print ``text`` beside it."""
        if self._shown == (series, text):
            return  # an unchanged poll redraws nothing
        self._shown = (series, text)
        if self.is_mounted:  # else on_mount draws it
            self._draw()

    def _draw(self) -> None:
        chart = next(self.query(Chart).results(Chart), None)
        if chart is None:  # removed before it composed (its screen or the app closing)
            return
        series, text = self._shown
        self.set_class(not series.values, "-empty")
        chart.series = series
        self.query_one(".metric-value", Label).update(text)
