"""A time series as bars in text cells, with its scale written beside it.

Replaces Textual's Sparkline, which scales every series to its own minimum and
maximum and says neither: a CPU pinned at 100% drew as the lowest bar, ±0.02 of
loss noise filled the height. Here a quantity with a scale of its own (a
percentage) is drawn on it; any other says its range (``min–max`` on one line, the
maximum at the top and the minimum at the bottom of a taller chart). Columns where
the job's config changed carry a marker (▲ an apply, ↺ a rollback), and each
config's stretch of the series has its own colour: a step time at batch 32 and one
at batch 64 are not one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tunekit.tui.formatting import scale_numbers

BARS = " ▁▂▃▄▅▆▇█"
SEGMENT_COLORS = ("green", "cyan", "magenta", "yellow", "blue")
MARKS = {"apply": ("▲", "bold yellow"), "rollback": ("↺", "bold magenta")}


@dataclass(frozen=True)
class Series:
    """What a :class:`Chart` draws: values oldest first, and how to read them."""

    values: tuple[float, ...] = ()
    lo: float | None = None
    """A fixed bottom of the scale (0 for a percentage); None: the values' minimum."""
    hi: float | None = None
    """A fixed top (100 for a percentage); None: the values' maximum."""
    unit: str = ""
    """Written after the scale's numbers (``%``, ``ms``)."""
    segments: tuple[int, ...] = ()
    """Per value, which config it ran under (0, 1, 2 …); empty: one config."""
    marks: tuple[tuple[int, str], ...] = ()
    """(index of the first value after a change, ``apply`` or ``rollback``)."""


def buckets(n: int, width: int) -> list[range]:
    """Value indices per column, over the whole width: ``width`` even runs of values (their
    mean is drawn), or, with fewer values than columns, each value over as many columns."""
    if n < width:
        return [range(i * n // width, i * n // width + 1) for i in range(width)]
    edges = [round(i * n / width) for i in range(width + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def scale_of(series: Series) -> tuple[float, float]:
    values = series.values
    lo = series.lo if series.lo is not None else min(values)
    hi = series.hi if series.hi is not None else max(values)
    hi = max(hi, max(values))  # a fixed top never cuts a value (a process above 100% CPU)
    lo = min(lo, min(values))
    return lo, hi


GUTTER = 10
"""Cells a one-line chart's scale takes at least, so that the charts of a column line up."""


def render_chart(series: Series, width: int, height: int) -> Text:
    """The chart as ``height`` lines of ``width`` cells (a scale gutter on the left)."""
    if not series.values:
        return Text("no data yet", style="dim")
    lo, hi = scale_of(series)
    low, high = scale_numbers(lo, hi)
    if height <= 1:
        gutter = f"{low}–{high}{series.unit}"
        label_w = max(len(gutter), min(GUTTER, width // 3))
        lines_labels = [gutter]
    else:
        top, bottom = f"{high}{series.unit}", f"{low}{series.unit}"
        label_w = max(len(top), len(bottom))
        lines_labels = [top] + [""] * (height - 2) + [bottom]
    plot_w = max(width - label_w - 1, 1)
    cols = buckets(len(series.values), plot_w)
    levels = height * (len(BARS) - 1)
    marks = dict(series.marks)
    span = hi - lo
    rows = max(height, 1)
    lines: list[list[tuple[str, str]]] = []
    for row in range(rows):
        cells = [(f"{lines_labels[row]:>{label_w}}" + ("┤" if lines_labels[row] else "│"), "dim")]
        row_floor = (rows - 1 - row) * (len(BARS) - 1)  # sub-levels below this row
        drawn: set[int] = set()
        for col in cols:
            mean = sum(series.values[i] for i in col) / len(col)
            level = levels if span <= 0 else round((mean - lo) / span * levels)
            level = max(level, 1)  # the minimum still draws: an empty column means no data
            seg = series.segments[col[-1]] if series.segments else 0
            style = SEGMENT_COLORS[seg % len(SEGMENT_COLORS)]
            # A change is marked once, in the first column that shows its value.
            mark = next((marks[i] for i in col if i in marks and i not in drawn), None)
            fill = min(max(level - row_floor, 0), len(BARS) - 1)
            if mark and row == 0:
                cells.append(MARKS[mark])
            elif mark and fill == 0:
                cells.append(("┊", MARKS[mark][1]))
            else:
                cells.append((BARS[fill], style))
            drawn.update(col)
        lines.append(cells)
    return styled_lines(lines)


def styled_lines(lines: Sequence[Sequence[tuple[str, str]]]) -> Text:
    """Lines of (characters, style) cells as one Text, each run of one style one span: a
    chart is thousands of cells, and a span per cell makes every repaint slow."""
    text = Text()
    for n, cells in enumerate(lines):
        if n:
            text.append("\n")
        run, style = "", None
        for chars, cell_style in cells:
            if cell_style != style and run:
                text.append(run, style=style or "")
                run = ""
            run += chars
            style = cell_style
        if run:
            text.append(run, style=style or "")
    return text


class Chart(Widget):
    """Draws a :class:`Series` over the widget's size (one line or more)."""

    DEFAULT_CSS = """
    Chart { width: 1fr; height: 1fr; }
    """

    series: reactive[Series] = reactive(Series)

    def render(self) -> Text:
        return render_chart(self.series, self.size.width, self.size.height)


def segments_of(ids: Sequence[str]) -> tuple[int, ...]:
    """Per value, the ordinal of its config among those seen, in order of first appearance."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(i, len(seen)) for i in ids)
