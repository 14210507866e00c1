"""One metric: its name, a sparkline of its recent values, and the latest value in words."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Label, Sparkline


class MetricRow(Widget):
    """``name  ▁▂▃▅▇▆▅  value`` on one line."""

    DEFAULT_CSS = """
    MetricRow { layout: horizontal; height: 1; }
    MetricRow > .metric-name { width: 14; color: $text-muted; }
    MetricRow > Sparkline { width: 1fr; margin: 0 1; }
    MetricRow > .metric-value { width: 24; text-align: right; }
    MetricRow.-empty > Sparkline { display: none; }
    MetricRow.-empty > .metric-value { width: 1fr; color: $text-muted; }
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
        self._shown: tuple[list[float], str] = ([], "—")

    def compose(self) -> ComposeResult:
        yield Label(self.metric_name, classes="metric-name")
        yield Sparkline([], summary_function=max)
        yield Label("—", classes="metric-value")

    def on_mount(self) -> None:
        self.show(*self._shown)

    def show(self, values: Sequence[float], text: str) -> None:
        """Plot ``values`` (oldest first) and print ``text`` beside them."""
        self._shown = (list(values), text)
        if not self.is_mounted:
            return  # on_mount shows it
        self.set_class(not values, "-empty")
        self.query_one(Sparkline).data = list(values)
        self.query_one(".metric-value", Label).update(text)
