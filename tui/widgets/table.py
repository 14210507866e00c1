"""A data table that fits its columns to its width: numbers whole, text clipped, columns dropped last-first.

A terminal of 80 columns cannot show every column of the trials table, and one of
200 should not cut a config at 40 characters. Each column says how much it matters
(``priority``: lower is placed first) and whether it holds text that may be clipped
(``grow``: a config, a note, a headline). Columns that hold numbers are always
drawn at their full width or not at all; a text column takes its whole content where
it fits and is clipped with an ellipsis only where it does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.widgets import DataTable

Cell = str | Text


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    priority: int = 0
    """Columns with the largest priority are dropped first when the width runs out."""
    grow: bool = False
    """Text that may be clipped (with an ellipsis) and that takes the width left over."""
    min_width: int = 8
    """The narrowest a ``grow`` column is drawn (below it, it is dropped)."""
    from_width: int = 0
    """Drawn only in a table at least this wide (a column that would cost a config its end)."""
    when_filled: bool = False
    """Drawn only when some row has a cell for it (a figure only some tuners give)."""


def cell_width(cell: Cell) -> int:
    return Text(cell).cell_len if isinstance(cell, str) else cell.cell_len


def clip_cell(cell: Cell, width: int) -> Cell:
    """``cell`` cut to ``width`` cells, with an ellipsis when cut (styles kept)."""
    if cell_width(cell) <= width:
        return cell
    text = Text(cell) if isinstance(cell, str) else cell.copy()
    text.truncate(width, overflow="ellipsis")
    return text


def fit_columns(
    columns: Sequence[Column],
    natural: Mapping[str, int],
    width: int,
    padding: int = 1,
) -> dict[str, int]:
    """Column key -> drawn width for a table ``width`` cells wide, in ``columns``' order.

    ``natural`` is each column's widest cell (header included). Columns are placed by
    priority (at equal priority, numbers before text): a fixed column at its natural
    width or not at all; a ``grow`` column at its natural width, or at what is left if
    that is at least ``min_width``. A column that does not fit is left out.
    """
    extra = 2 * padding
    order = sorted(
        (c for c in columns if width >= c.from_width),
        key=lambda c: (c.priority, c.grow, columns.index(c)),
    )
    placed: dict[str, int] = {}
    left = width
    for c in order:
        floor = min(c.min_width, natural[c.key]) if c.grow else natural[c.key]
        if floor + extra > left:
            continue
        placed[c.key] = min(natural[c.key], left - extra) if c.grow else floor
        left -= placed[c.key] + extra
    return {c.key: placed[c.key] for c in columns if c.key in placed}


class FitTable(DataTable):
    """A :class:`DataTable` whose columns follow :func:`fit_columns` at its current width.

    Subclasses set :attr:`COLUMNS`; :meth:`set_rows` gives every row's cells by column key
    (a missing key is an empty cell). The layout is redone when the width changes.
    """

    COLUMNS: tuple[Column, ...] = ()
    SCROLLBAR_ROOM = 2
    """Cells kept free for a vertical scrollbar."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._rows: list[tuple[str, Mapping[str, Cell]]] = []
        self._headers: dict[str, Cell] = {}
        self._layout: dict[str, int] | None = None
        self._laid_width = -1

    @property
    def shown_columns(self) -> list[str]:
        """Keys of the columns drawn at the current width."""
        return list(self._layout or {})

    def set_rows(
        self, rows: Sequence[tuple[str, Mapping[str, Cell]]], headers: Mapping[str, Cell] = {}
    ) -> None:
        """Replace every row (``(row key, {column key: cell})``), keeping the cursor's row."""
        self._rows = list(rows)
        self._headers = dict(headers)
        self._refill()

    def available_width(self) -> int:
        width = self.size.width or (self.app.size.width if self.is_attached else 80)
        return max(width - self.SCROLLBAR_ROOM, 10)

    def on_resize(self) -> None:
        if self.available_width() != self._laid_width:
            self._refill()

    def _header(self, c: Column) -> Cell:
        return self._headers.get(c.key, c.header)

    def _refill(self) -> None:
        width = self.available_width()
        natural = {
            c.key: max(
                [cell_width(self._header(c))]
                + [cell_width(cells.get(c.key, "")) for _, cells in self._rows]
            )
            for c in self.COLUMNS
        }
        columns = [
            c
            for c in self.COLUMNS
            if not c.when_filled or any(c.key in cells for _, cells in self._rows)
        ]
        layout = fit_columns(columns, natural, width, self.cell_padding)
        row = self.cursor_row
        before = self.shown_columns
        # The cursor stays on its column (by key: the columns shown may change with the width).
        key = before[self.cursor_column] if self.cursor_column < len(before) else None
        column = list(layout).index(key) if key in layout else self.cursor_column
        self._laid_width = width
        self._layout = layout
        self.clear(columns=True)
        for c in self.COLUMNS:
            if c.key in layout:
                self.add_column(
                    clip_cell(self._header(c), layout[c.key]), key=c.key, width=layout[c.key]
                )
        for key, cells in self._rows:
            self.add_row(
                *(clip_cell(cells.get(k, ""), w) for k, w in layout.items()),
                key=key,
            )
        if self._rows:
            self.move_cursor(row=min(row, len(self._rows) - 1), column=min(column, len(layout) - 1))
