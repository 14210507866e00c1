"""A config's knobs, plugin by plugin, with the ones that differ from another config marked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.text import Text
from textual.widgets import Static

from tunekit.tui.formatting import knob_lines


def render_config(config: Mapping[str, Any] | None, other: Mapping[str, Any] | None = None) -> Text:
    """Knobs as ``plugin.knob = value`` lines; a knob whose value differs in ``other`` is highlighted."""
    lines = knob_lines(config)
    if not lines:
        return Text.assemble(("baseline", "bold"), ("\nthe workload as written, plain DDP", "dim"))
    theirs = {(p, k): v for p, k, v in knob_lines(other)} if other is not None else None
    text = Text()
    plugin = None
    for p, knob, value in lines:
        if p != plugin:
            if plugin is not None:
                text.append("\n")
            text.append(p, style="bold")
            plugin = p
        changed = theirs is not None and theirs.get((p, knob), object()) != value
        text.append(f"\n  {knob} = ", style="dim")
        text.append(str(value), style="bold yellow" if changed else "")
    return text


class ConfigPanel(Static):
    """Shows a config; :meth:`show` takes the config and, optionally, one to compare with."""

    DEFAULT_CSS = """
    ConfigPanel { height: auto; }
    """

    def show(
        self, config: Mapping[str, Any] | None, other: Mapping[str, Any] | None = None
    ) -> None:
        self.update(render_config(config, other))
