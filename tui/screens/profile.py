"""Profile: where a step's time goes — the breakdown bar, overlap R, per-layer times, py-spy hot spots."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import DataTable, Label, Static

from tunekit.tui.formatting import ms, number, pct, size
from tunekit.tui.screens.base import TunekitScreen
from tunekit.tui.state import HotSpots, LayerRow, ProfileView
from tunekit.tui.widgets import BreakdownBar, Column, FitTable

SORT_BY = {
    "layer": "name",
    "kind": "kind",
    "forward": "forward_s",
    "backward": "backward_s",
    "total": "total_s",
    "share": "total_s",
    "activations": "activation_bytes",
    "flops": "flops",
}
"""Column key -> the LayerRow attribute it sorts by."""


class LayerTable(FitTable):
    """Per-layer times. ``s`` sorts by the column under the cursor (←/→ move it), and again
    reverses; a click on a header does the same. The sorted column's header carries ▼
    (largest first) or ▲."""

    BINDINGS = [Binding("s", "sort", "Sort/reverse")]
    COLUMNS = (
        Column("layer", "layer", grow=True, min_width=12),
        Column("kind", "kind", priority=3),
        Column("forward", "forward", priority=1),
        Column("backward", "backward", priority=1),
        Column("total", "total"),
        Column("share", "share"),
        Column("activations", "activations", priority=2),
        Column("flops", "GFLOP fwd", priority=2),
    )

    def __init__(self, **kwargs):
        super().__init__(cursor_type="column", zebra_stripes=True, **kwargs)
        self.sort_key = "total"  # largest first
        self.descending = True
        self._layers: tuple[LayerRow, ...] = ()
        self._cursor_placed = False

    def show(self, layers: tuple[LayerRow, ...]) -> None:
        self._layers = layers
        self._fill()

    @property
    def sorted_by(self) -> str:
        """``total ▼``: the column the rows are sorted by, and which way."""
        header = next(c.header for c in self.COLUMNS if c.key == self.sort_key)
        return f"{header} {'▼' if self.descending else '▲'}"

    def _fill(self) -> None:
        attr = SORT_BY[self.sort_key]
        known = [r for r in self._layers if getattr(r, attr) is not None]
        rows = sorted(known, key=lambda r: getattr(r, attr), reverse=self.descending)
        rows += [r for r in self._layers if getattr(r, attr) is None]
        compute = sum(r.total_s for r in self._layers) or 1.0
        self.set_rows(
            [
                (
                    r.name,
                    {
                        "layer": r.name,
                        "kind": r.kind,
                        "forward": ms(r.forward_s, 2),
                        "backward": ms(r.backward_s, 2),
                        "total": ms(r.total_s, 2),
                        "share": pct(r.total_s / compute),
                        "activations": size(r.activation_bytes) if r.activation_bytes else "—",
                        "flops": number(r.flops / 1e9, 2) if r.flops else "—",
                    },
                )
                for r in rows
            ],
            headers={self.sort_key: Text(self.sorted_by, style="bold")},
        )
        if not self._cursor_placed and self.sort_key in self.shown_columns:
            self._cursor_placed = True  # the cursor starts on the sorted column: s reverses it
            self.move_cursor(column=self.shown_columns.index(self.sort_key))

    def sort_by(self, key: str) -> None:
        """Sort by column ``key``; the same column again flips the order."""
        if key == self.sort_key:
            self.descending = not self.descending
        else:
            self.sort_key, self.descending = key, key not in ("layer", "kind")
        self._fill()

    def action_sort(self) -> None:
        shown = self.shown_columns
        if shown:
            self.sort_by(shown[min(self.cursor_column, len(shown) - 1)])

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))


def hotspot_text(spots: tuple[HotSpots, ...], source: str) -> Text:
    text = Text(f"py-spy hot spots · {source}\n", style="bold")
    if not spots:
        text.append(
            "no stack samples yet (py-spy missing or not permitted: see the live screen)",
            style="dim",
        )
        return text
    for s in spots:
        text.append(f"\nrank {s.rank}", style="bold")
        text.append(f"  ({s.samples} samples)\n", style="dim")
        text.append(
            "  " + " · ".join(f"{c.replace('_', ' ')} {pct(f)}" for c, f in s.categories) + "\n"
        )
        for fn, f in s.top:
            text.append(f"  {pct(f):>4} ", style="cyan")
            text.append(f"{fn}\n")
        for flag in s.flags:
            text.append(f"  ⚑ {flag}\n", style="yellow")
    return text


def numbers_line(view: ProfileView) -> Text:
    text = Text(f"analysed step {ms(view.step_s)} · measured {ms(view.measured_step_s)} · ")
    text.append("overlap R ")
    text.append("—" if view.overlap_R is None else f"{view.overlap_R:.0f}", style="bold")
    text.append(
        f" (100 = communication fully hidden) · communication in flight {ms(view.comm_total_s)}"
    )
    return text


class ProfileScreen(TunekitScreen):
    """See the module docstring."""

    BINDINGS = [Binding("p", "app.profile", "Profile")]
    FOLLOWS = (
        ("profile_view", "show_profile"),
        ("live_hotspots", "show_hotspots"),
        ("profile_stage", "show_stage"),
    )

    def compose_body(self) -> ComposeResult:
        yield Static(id="profile-source")
        yield Label("step breakdown", classes="section")
        yield BreakdownBar(id="breakdown")
        yield Static(id="profile-numbers")
        with Horizontal(id="profile-body"):
            yield LayerTable(id="layers")
            with VerticalScroll(id="hotspots-box"):
                yield Static(id="hotspots")
        yield Static(id="profile-stage")

    def show_profile(self, view: ProfileView | None) -> None:
        self.set_class(view is None, "-empty")
        if view is None:
            self.query_one("#profile-source", Static).update(
                Text(
                    f"No profile yet. Press p to run a profiled trial ({self.tk.backend.nproc} ranks, 3 steps), "
                    "or start a tuning (t): its baseline trial is profiled.",
                    style="dim",
                )
            )
            return
        self.query_one("#profile-source", Static).update(Text(view.source, style="bold"))
        self.query_one(BreakdownBar).parts = view.parts
        self.query_one("#profile-numbers", Static).update(numbers_line(view))
        self.query_one(LayerTable).show(view.layers)
        self.show_hotspots(self.tk.live_hotspots)

    def show_hotspots(self, live: tuple[HotSpots, ...]) -> None:
        profile = self.tk.profile_view
        if live:
            n = max(s.samples for s in live)
            spots, source = live, f"live job, its last {n} samples per rank"
        else:
            spots, source = (profile.hotspots if profile else ()), "profiled run"
        self.query_one("#hotspots", Static).update(hotspot_text(spots, source))

    def show_stage(self, stage: str) -> None:
        self.set_class(bool(stage), "-busy")
        self.query_one("#profile-stage", Static).update(
            Text(f"profiling: {stage} …", style="yellow") if stage else ""
        )
