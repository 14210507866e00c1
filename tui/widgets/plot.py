"""Predicted against measured step time, one point per trial, with the diagonal where they agree."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

Point = tuple[float, float, str, str]
"""(predicted seconds, measured seconds, marker, role)."""

ROLE_STYLE = {
    "baseline": "bold cyan",
    "candidate": "bold green",
    "combined": "bold magenta",
    "confirm": "bold green",
    "search": "bold yellow",
}


def scale(value: float, low: float, high: float, cells: int) -> int:
    if high <= low:
        return cells // 2
    return min(cells - 1, max(0, round((value - low) / (high - low) * (cells - 1))))


class PredictedVsMeasured(Widget):
    """A scatter plot in text cells: x = predicted, y = measured, both in ms on one scale.

    Points on the dotted diagonal were predicted exactly; above it the trial
    ran slower than predicted. Each point is drawn with its trial's number.
    """

    DEFAULT_CSS = """
    PredictedVsMeasured { height: 1fr; min-height: 8; }
    """

    points: reactive[tuple[Point, ...]] = reactive(())

    def render(self) -> Text:
        pts = [p for p in self.points if p[0] and p[1]]
        if not pts:
            return Text("predicted vs measured: no trial with both yet", style="dim")
        label_w = 9
        width = max(self.size.width - label_w - 1, 8)
        height = max(self.size.height - 3, 3)
        values = [v for p in pts for v in p[:2]]
        low, high = min(values), max(values)
        pad = (high - low) * 0.1 or high * 0.05
        low, high = max(0.0, low - pad), high + pad
        grid: list[list[tuple[str, str]]] = [[(" ", "")] * width for _ in range(height)]
        for col in range(width):  # the diagonal: measured == predicted
            x = low + (high - low) * col / max(width - 1, 1)
            row = height - 1 - scale(x, low, high, height)
            grid[row][col] = ("·", "dim")
        for predicted, measured, marker, role in pts:
            col = scale(predicted, low, high, width)
            row = height - 1 - scale(measured, low, high, height)
            grid[row][col] = (marker[-1:] or "●", ROLE_STYLE.get(role, "bold"))
        text = Text("measured ↑", style="dim")
        text.append("\n")
        for r, cells in enumerate(grid):
            value = high - (high - low) * r / max(height - 1, 1)
            label = f"{value * 1e3:.0f} ms" if r in (0, height - 1) else ""
            text.append(f"{label:>{label_w}}│", style="dim")
            for ch, style in cells:
                text.append(ch, style=style)
            text.append("\n")
        text.append(" " * label_w + "└" + "─" * width + "\n", style="dim")
        left, right = f"{low * 1e3:.0f} ms", f"{high * 1e3:.0f} ms  predicted →"
        gap = max(1, width - len(left) - len(right))
        text.append(" " * (label_w + 1) + left + " " * gap + right, style="dim")
        return text
