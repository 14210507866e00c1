"""What the CLI prints through rich is printed as it is (issue 34, item 7).

A gloo error quotes its source (``[/__w/pytorch/…/pair.cc:545]``), a rank's log line starts
``[rank0]:``, a plugin's error may hold anything: rich would read these as markup and drop them,
or end the command with a MarkupError. Styling is explicit (``tunekit.cli.common.styled``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tunekit.cli.common import console, err_console, styled, trials_table

GLOO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] "
    "Connection closed by peer [127.0.0.1]:29500 [bold]x[/bold] [rank0]: \\"
)
ROOT = Path(__file__).resolve().parents[2]


def test_a_message_quoting_a_log_is_printed_as_it_is(monkeypatch):
    from tunekit.cli.auto import _ProgressView
    from tunekit.events import Notice, PluginProblem, TrialFinished

    # Wide enough that no line wraps inside the quoted path, whatever ran before in this
    # process (the count below is of whole paths).
    monkeypatch.setattr(console, "width", 400)
    view = _ProgressView()
    with console.capture() as out:
        view.handle(Notice(GLOO, "warning"))
        view.handle(Notice(GLOO))
        view.handle(PluginProblem("p[red]", "pkg", "failed", GLOO))
        view.handle(
            TrialFinished(1, 1, "candidate", "p", "p(x=[1])", "crashed", None, None, 0.1, GLOO)
        )
        console.print(trials_table([_row(GLOO)]))
        console.print(styled("[bold]run {}[/] {}", "[/x]", GLOO))
    text = out.get()
    assert text.count("pair.cc:545]") == 6, text
    assert "[bold]x[/bold] [rank0]:" in text and "p(x=[1])" in text and "p[red]" in text
    assert "\\\\" not in text  # a quoted trailing backslash is printed once, not doubled
    with err_console.capture() as err:
        err_console.print(GLOO)
    assert err.get().strip() == GLOO


def _row(error: str) -> dict:
    return {
        "seq": 1,
        "role": "candidate",
        "description": "p(x=[1])",
        "status": "crashed",
        "median_s": None,
        "spread_s": None,
        "predicted_s": None,
        "error": error,
    }


MARKUP = re.compile(r"\[/?(bold|red|green|yellow|dim|italic|cyan|magenta|blue)\b|\[/\]")


@pytest.mark.parametrize(
    "path", sorted([*(ROOT / "tunekit" / "cli").glob("*.py"), ROOT / "tui" / "cli.py"]), ids=str
)
def test_markup_is_written_only_through_styled(path):
    """A console prints strings as they are (markup=False): a tag written anywhere but in a
    ``styled(...)`` template would be printed literally."""
    tree = ast.parse(path.read_text())
    allowed = {
        id(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "styled" and node.args
    }
    allowed |= {  # the pieces of a template built from parts: styled("  {}: " + mark + ...)
        id(part)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "styled"
        for part in ast.walk(node.args[0])
    }
    names_fed_to_styled = {
        part.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "styled"
        for part in ast.walk(node.args[0])
        if isinstance(part, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) in names_fed_to_styled for t in node.targets
        ):
            allowed |= {id(part) for part in ast.walk(node.value)}
    stray = [
        f"line {node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and MARKUP.search(node.value)
        and id(node) not in allowed
    ]
    assert not stray, stray
