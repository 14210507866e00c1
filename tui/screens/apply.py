"""Apply: the config running now beside the one to apply; apply with confirmation, the watch verdict, roll back."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Static

from tunekit.tui.formatting import per_sample_rate, speedup
from tunekit.tui.screens.base import TunekitScreen
from tunekit.tui.state import ApplyView, LiveView
from tunekit.tui.widgets import ConfigPanel

STATE_STYLE = {
    "kept": "bold green",
    "rolled_back": "bold red",
    "failed": "bold red",
    "applying": "bold yellow",
    "rolling_back": "bold yellow",
    "relaunched": "bold cyan",
    "idle": "dim",
}


def result_text(view: ApplyView, live: LiveView) -> Text:
    """The last apply's outcome and the live watch window: before vs after."""
    text = Text("last apply: ", style="bold")
    text.append(view.state.replace("_", " "), style=STATE_STYLE.get(view.state, "bold"))
    if view.message:
        text.append(f" — {view.message}")
    w = live.watch
    if w:
        text.append("\nwatch window: ", style="bold")
        text.append(watch_verdict(w))
    return text


def watch_verdict(w) -> str:
    """The watch window in words. A rollback on request says so, and the verdict the watch
    had given before it (it read as if the watch had rolled back a speed-up)."""
    rates = (
        f"before {per_sample_rate(w.get('before_s_per_sample'))}"
        f" → after {per_sample_rate(w.get('after_s_per_sample'))}"
    )
    measured = ""
    if w.get("speedup"):
        ci = w.get("ci") or [None, None]
        measured = f"{speedup(w['speedup'])} the samples/s of before"
        if ci[0] is not None:
            measured += f" (95% CI {ci[0]:.2f}–{ci[1]:.2f})"
    if rolled_back_on_request(w):
        had = f"; the watch had measured it at {measured}" if measured else ""
        return f"rolled back on request, not by the watch{had} · {rates}"
    state = w.get("state", "").replace("_", " ")
    return f"{state} · {rates}" + (f" · {measured}" if measured else "")


def rolled_back_on_request(w) -> bool:
    """A rollback asked for (r, `tunekit rollback`), as the job records it, not the watch's own."""
    return w.get("state") == "rolled_back" and w.get("reason") == ROLLED_BACK_ON_REQUEST


ROLLED_BACK_ON_REQUEST = "rolled back on request"
"""The reason the live job writes into its watch for a requested rollback (tunekit/runtime/live.py)."""


class ApplyScreen(TunekitScreen):
    """See the module docstring."""

    BINDINGS = [
        Binding("a", "app.apply", "Apply…"),
        Binding("r", "app.rollback", "Roll back…"),
        Binding("b", "app.target_best", "Use best"),
    ]
    FOLLOWS = (("apply_view", "show_apply"), ("live_view", "show_live"))

    def compose_body(self) -> ComposeResult:
        yield Static(id="apply-line")
        with Horizontal(id="configs"):
            yield ConfigPanel(id="current", classes="config-box")
            yield ConfigPanel(id="target", classes="config-box")
        yield Static(id="apply-result")

    def on_mount(self) -> None:
        self.query_one("#current").border_title = "running now"
        self.query_one("#target").border_title = "to apply"

    def show_apply(self, view: ApplyView) -> None:
        for state in STATE_STYLE:
            self.set_class(view.state == state, f"-{state.replace('_', '-')}")
        self.set_class(view.target is None, "-no-target")
        line = Text()
        if view.target is None:
            line.append(
                "nothing to apply yet: start a tuning (3, t) or pick a trial on the trials screen (4, enter)",
                style="dim",
            )
        else:
            line.append("to apply: ", style="bold")
            line.append(view.target.label, style="" if view.target.significant else "yellow")
            if view.target.caveat:
                line.append(f"\nthe decision: {view.target.caveat}", style="bold yellow")
            line.append(
                "  a applies (asks first) · r rolls back · b takes the best again", style="dim"
            )
        self.query_one("#apply-line", Static).update(line)
        self.show_live(self.tk.live_view)

    def show_live(self, live: LiveView) -> None:
        view = self.tk.apply_view
        target = view.target.config if view.target else None
        self.query_one("#current", ConfigPanel).show(live.config, target)
        panel = self.query_one("#target", ConfigPanel)
        if target is None:
            panel.update(Text("—", style="dim"))
        else:
            panel.show(target, live.config)
        self.query_one("#apply-result", Static).update(result_text(view, live))
