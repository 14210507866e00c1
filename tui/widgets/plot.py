"""Every trial of a tuning, measured and predicted, in samples/s, each labelled by its number.

x: the trials in the order they ran (their numbers under the axis); y: samples per
second, the measure the decision compares. A measured trial is ●, its prediction ○
(the dotted stretch between them is the prediction's error); a trial that failed
is ✕ on the axis; the baseline's samples/s is a dashed line across.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tunekit.tui.formatting import scale_numbers
from tunekit.tui.widgets.chart import styled_lines

ROLE_STYLE = {
    "baseline": "bold cyan",
    "candidate": "bold green",
    "combined": "bold magenta",
    "confirm": "bold green",
    "search": "bold yellow",
}


@dataclass(frozen=True)
class TrialPoint:
    seq: int
    role: str
    measured: float | None
    """Samples/s measured (None: not measured, or not yet)."""
    predicted: float | None = None
    """Samples/s predicted (None: no prediction, a baseline)."""
    failed: bool = False


def row_of(value: float, lo: float, hi: float, rows: int) -> int:
    """The row (0 at the top) where ``value`` is drawn on a scale from ``lo`` to ``hi``."""
    if hi <= lo:
        return rows // 2
    return rows - 1 - min(rows - 1, max(0, round((value - lo) / (hi - lo) * (rows - 1))))


def render_trials(
    points: tuple[TrialPoint, ...], baseline: float | None, width: int, height: int
) -> Text:
    values = [v for p in points for v in (p.measured, p.predicted) if v]
    if baseline:
        values.append(baseline)
    if not points or not values:
        return Text("trials: none measured yet", style="dim")
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.08 or hi * 0.05
    lo, hi = max(0.0, lo - pad), hi + pad
    low, high = scale_numbers(lo, hi)
    label_w = max(len(low), len(high))
    plot_w = max(width - label_w - 1, 4)
    rows = max(height - 3, 3)  # a legend above, the axis and the trial numbers below
    slot = max(plot_w // max(len(points), 1), 3)
    shown = points[-(plot_w // slot) :]  # as many trials as fit, the newest
    grid: list[list[tuple[str, str]]] = [[(" ", "")] * plot_w for _ in range(rows)]
    if baseline:
        r = row_of(baseline, lo, hi, rows)
        grid[r] = [("┄", "cyan dim")] * plot_w
    for i, p in enumerate(shown):
        col = i * slot + slot // 2
        style = ROLE_STYLE.get(p.role, "bold")
        m = row_of(p.measured, lo, hi, rows) if p.measured else None
        q = row_of(p.predicted, lo, hi, rows) if p.predicted else None
        if m is not None and q is not None:
            for r in range(min(m, q) + 1, max(m, q)):
                grid[r][col] = ("┆", "dim")
        if q is not None:
            grid[q][col] = ("○", "dim")
        if m is not None:
            grid[m][col] = ("◉" if m == q else "●", style)
        elif p.failed:
            grid[rows - 1][col] = ("✕", "bold red")
    lines: list[list[tuple[str, str]]] = [
        [
            ("samples/s per trial  ", "bold"),
            ("● measured  ○ predicted  ┄ baseline  ✕ failed", "dim"),
        ]
    ]
    for r, cells in enumerate(grid):
        label = high if r == 0 else low if r == rows - 1 else ""
        lines.append([(f"{label:>{label_w}}" + ("┤" if label else "│"), "dim"), *cells])
    lines.append([(" " * label_w + "└" + "─" * plot_w, "dim")])
    numbers = [" "] * plot_w
    for i, p in enumerate(shown):
        label = str(p.seq)
        start = i * slot + slot // 2 - (len(label) - 1) // 2
        if (
            start >= 0
            and start + len(label) <= plot_w
            and all(c == " " for c in numbers[max(start - 1, 0) : start + len(label)])
        ):
            numbers[start : start + len(label)] = list(label)
    lines.append([(" " * (label_w + 1) + "".join(numbers), "dim")])
    return styled_lines(lines)


class TrialsPlot(Widget):
    """Draws :func:`render_trials` over the widget's size."""

    DEFAULT_CSS = """
    TrialsPlot { height: 1fr; min-height: 7; }
    """

    points: reactive[tuple[TrialPoint, ...]] = reactive(())
    baseline: reactive[float | None] = reactive(None)

    def render(self) -> Text:
        return render_trials(self.points, self.baseline, self.size.width, self.size.height)
