"""What every screen shares: the header, the footer, and following the app's state."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Header

from tunekit.tui.widgets.footer import BindingsFooter

if TYPE_CHECKING:
    from tunekit.tui.app import TunekitApp


class TunekitScreen(Screen):
    """A screen that renders parts of the app's state.

    Subclasses compose their body in :meth:`compose_body` and list in
    :attr:`FOLLOWS` the app's reactive attributes they render, each with the
    method that shows it (called now and on every change).
    """

    FOLLOWS: tuple[tuple[str, str], ...] = ()

    @property
    def tk(self) -> TunekitApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        yield from self.compose_body()
        yield BindingsFooter()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_mount(self) -> None:
        for attribute, method in self.FOLLOWS:
            self.watch(self.app, attribute, getattr(self, method), init=True)
        self.watch(self.app, "study_view", self._mark_tuning, init=True)
        # The screen's widgets live as long as the app: out of the collector's way. A full
        # collection walks every object, and over a composed app's it took 300-400 ms, in
        # the middle of whichever screen switch it fell on.
        self.call_after_refresh(gc.freeze)

    def _mark_tuning(self, study) -> None:
        self.set_class(study.running, "-tuning")
