"""The footer, recomposed only when what it shows changes."""

from __future__ import annotations

from textual.screen import Screen
from textual.widgets import Footer


class BindingsFooter(Footer):
    """Textual's footer, without its redundant recomposes.

    Textual's footer recomposes (a new widget per key, each restyled) on every
    "bindings updated" signal, and a screen sends several while it is first composed
    and focused: six recomposes of ten keys on a first visit, half of the switch's CPU
    time. This one recomposes when the keys it would show, their state or their tooltips
    differ from the last ones it composed or has a recompose scheduled for.
    """

    _shown: tuple | None = None

    def bindings_changed(self, screen: Screen) -> None:
        shown = self._what_it_shows(screen)
        if shown == self._shown:  # composed, or about to be, with these keys
            return
        if screen.app.app_focus and self.is_attached and screen is self.screen:
            self._shown = shown  # Footer.bindings_changed recomposes now
        super().bindings_changed(screen)

    @staticmethod
    def _what_it_shows(screen: Screen) -> tuple:
        return tuple(
            (binding.key, binding.action, binding.description, binding.group, enabled, tooltip)
            for _node, binding, enabled, tooltip in screen.active_bindings.values()
            if binding.show or binding.action == "command_palette"
        )
