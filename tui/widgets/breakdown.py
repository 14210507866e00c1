"""The step breakdown as one stacked bar: compute, exposed communication, data, optimizer, idle."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tunekit.tui.formatting import ms, pct

COLORS = {
    "compute": "green",
    "comm_exposed": "red",
    "data": "yellow",
    "optimizer": "magenta",
    "idle": "bright_black",
}
LABELS = {"comm_exposed": "exposed comm"}


def bar_widths(fractions: list[float], width: int) -> list[int]:
    """Cells per part, summing to ``width`` (largest remainders get the leftover cells)."""
    total = sum(fractions) or 1.0
    exact = [f / total * width for f in fractions]
    cells = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in order[: width - sum(cells)]:
        cells[i] += 1
    return cells


class BreakdownBar(Widget):
    """A stacked bar over the widget's width and a legend with seconds and shares."""

    DEFAULT_CSS = """
    BreakdownBar { height: auto; }
    """

    parts: reactive[tuple[tuple[str, float, float], ...]] = reactive(())
    """(part, seconds, fraction) as :class:`tunekit.tui.state.ProfileView` holds them."""

    def render(self) -> Text:
        if not self.parts:
            return Text("no breakdown yet", style="dim")
        width = max(self.size.width, 10)
        text = Text()
        for (part, _s, _f), cells in zip(
            self.parts, bar_widths([f for _, _, f in self.parts], width), strict=True
        ):
            text.append("█" * cells, style=COLORS.get(part, "white"))
        text.append("\n")
        for i, (part, seconds, fraction) in enumerate(self.parts):
            if i:
                text.append("  ")
            text.append("■ ", style=COLORS.get(part, "white"))
            text.append(f"{LABELS.get(part, part)} {pct(fraction)} ({ms(seconds)})")
        return text
