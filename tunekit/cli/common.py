"""Shared CLI pieces: the console, tables, duration and name parsing."""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar, cast

import click
import rich.table
from rich.console import Console
from rich.text import Text

from tunekit.errors import TunekitError

F = TypeVar("F", bound=Callable[..., Any])

PIPE_WIDTH = 240
"""Columns tables may use when the output is not a terminal (a file, a pipe, a CI log):
rich would assume 80 and squeeze numbers; a log line may be long."""


def _width(stream) -> int | None:
    """None (rich asks the terminal) on a terminal or with COLUMNS set; otherwise :data:`PIPE_WIDTH`."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH


# markup=False: a string is printed as it is. Messages quote logs, errors and user input
# ("[/__w/pytorch/…/pair.cc:545]", "[rank0]:"), which rich would read as markup, lose or die on
# (MarkupError). Styling is explicit: :func:`styled`.
console = Console(highlight=False, soft_wrap=True, markup=False, width=_width(sys.stdout))
err_console = Console(
    stderr=True, highlight=False, soft_wrap=True, markup=False, width=_width(sys.stderr)
)


_SLOT = re.compile("\ue000(\\d+)\ue001")


def styled(template: str, *values: object) -> Text:
    """``template``'s rich markup with each ``{}`` filled by a value taken literally.

    The values never pass through the markup parser (escaping them would still double a
    trailing backslash): the template is parsed with a placeholder in each slot, and each
    placeholder is replaced by its value in the style the template gave that slot."""
    marked = Text.from_markup(template.format(*(f"\ue000{i}\ue001" for i in range(len(values)))))
    out = Text(end=marked.end)
    at = 0
    for m in _SLOT.finditer(marked.plain):
        out.append_text(marked[at : m.start()])
        value = Text(str(values[int(m.group(1))]))
        for span in marked[m.start() : m.end()].spans:
            value.stylize(span.style)
        out.append_text(value)
        at = m.end()
    out.append_text(marked[at:])
    return out


class Table(rich.table.Table):
    """A rich table whose cells wrap instead of ending in "…": a number or a config the
    user must read or copy is never cut (issue 19)."""

    def add_column(self, *args, **kwargs) -> None:
        kwargs.setdefault("overflow", "fold")
        super().add_column(*args, **kwargs)


class Interrupted(TunekitError):
    """Ctrl-C (or SIGTERM): said in one line with the command that continues the work."""

    exit_code = 130

    @classmethod
    def saying(cls, what_now: str) -> Interrupted:
        """``interrupted; WHAT_NOW`` (exit 130), or ``interrupted by SIGTERM; ...`` (exit 143)."""
        said, code = interruption()
        exc = cls(f"{said}; {what_now}")
        exc.exit_code = code
        return exc


_terminated: list[int] = []
"""SIGTERMs received by this process (see :func:`stops_on_sigterm`)."""


def interruption() -> tuple[str, int]:
    """``("interrupted", 130)``, or ``("interrupted by SIGTERM", 143)`` when SIGTERM did it."""
    return ("interrupted by SIGTERM", 143) if _terminated else ("interrupted", 130)


def stops_on_sigterm(command: F) -> F:
    """Make SIGTERM stop ``command`` as Ctrl-C does (the same cleanup and the same one line).

    SIGTERM is what `timeout`, SLURM, systemd and a bare `kill` send first. Left to its default
    it ends the process at once: `tunekit run` would leave its job training with nobody
    supervising it, `tunekit auto` a study marked running. Here it calls whatever handles
    SIGINT now (asyncio's, inside ``asyncio.run``: the running task is cancelled), and SIGINT
    gets Python's handler even where the shell that started us ignored it (``cmd &``).
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return command(*args, **kwargs)

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            _terminated.append(signum)
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)
            else:
                raise KeyboardInterrupt

        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        if not callable(before[0]):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            return command(*args, **kwargs)
        finally:
            for signum, handler in zip((signal.SIGINT, signal.SIGTERM), before, strict=True):
                if handler is not None:
                    signal.signal(signum, handler)

    return cast(F, wrapper)


def ensure_writable(folder: Path, what: str) -> Path:
    """Make ``folder`` (with its parents) and check that files can be created in it.

    Before long work, not after it: a read-only working directory fails in one line.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise TunekitError(
            f"cannot write {what} {folder}: {reason} (give another folder, or run from a "
            "writable working directory)"
        ) from None
    return folder


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(h|m|s|ms)?")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, None: 1.0}


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '1h30m', '2.5m' -> seconds. Raises ValueError on anything else."""
    text = text.strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if not text or pos != len(text):
        raise ValueError(f"{text!r} is not a duration like 90s, 5m or 1h30m")
    if total <= 0:
        raise ValueError(f"{text!r} is no time at all: give more than 0, like 90s or 5m")
    return total


class Duration(click.ParamType):
    name = "DURATION"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = Duration()


class Size(click.ParamType):
    """A memory size: 2GiB, 512MiB, 1.5GB, 300M, or bytes."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from tunekit.memory import parse_size

        try:
            return parse_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


MEMORY_CAP_OPTION = click.option(
    "--memory-cap",
    "memory_cap",
    type=Size(),
    default=None,
    help="Per-rank memory cap (2GiB, 512MiB): a step whose measured peak goes over it fails "
    "as out of memory, and planners treat it as each device's memory.",
)


def split_names(values: tuple[str, ...], option: str = "--plugins") -> list[str] | None:
    """``--plugins a,b --plugins c`` -> [a, b, c]; not given -> None (every tuner).

    Given but naming nothing (``--plugins ''``) is an error, not "every tuner".
    """
    if not values:
        return None
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    if not names:
        raise click.BadParameter(
            f"{option} {values[0]!r} names no tuner; leave {option} out to use every tuner "
            "(`tunekit plugins` lists them)"
        )
    return names


STORE_OPTION = click.option(
    "--store",
    "store_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".tunekit"),
    show_default=True,
    help="Study store folder (studies, cached probes and profiles, runs/).",
)


def marked_headline(headline: str, applies: bool, muted: str = "dim") -> Text:
    """A diagnosis's headline, its verdict coloured (green where the tuner applies, ``muted``
    where not), the rest taken literally."""
    verdict, sep, rest = headline.partition(" · ")
    style = "green" if applies else muted
    return styled(f"[{style}]{{}}[/]{{}}{{}}", verdict, sep, rest)


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f} ms"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def trials_table(rows: list[dict], title: str = "trials") -> Table:
    """Every trial: its prediction, raw and corrected by the trials before it, what was
    measured (per step, and samples/s: what the decision compares) and the error of each (rows from ``tunekit.report.data.report_data``)."""
    table = Table(
        title=title + " (per step; error = |prediction − measured| / measured)",
        title_justify="left",
    )
    for col in (
        "#",
        "role",
        "config",
        "status",
        "steps",
        "predicted",
        "corrected",
        "measured",
        "samples/s",
        "error",
        "note",
    ):
        table.add_column(col)
    for t in rows:
        med = "—" if t["median_s"] is None else f"{_ms(t['median_s'])} ± {_ms(t['spread_s'])}"
        err = _pct(t.get("prediction_error"))
        if t.get("corrected_prediction_error") is not None:
            err += f" → {_pct(t['corrected_prediction_error'])}"
        table.add_row(
            str(t["seq"]),
            t["role"],
            t["description"],
            t["status"],
            t.get("steps_run") or "—",
            _ms(t["predicted_s"]),
            _ms(t.get("corrected_s")),
            med,
            "—" if not t.get("samples_per_s") else f"{t['samples_per_s']:,.1f}",
            err,
            (t.get("note") or t.get("error") or "")[:160],
        )
    return table
