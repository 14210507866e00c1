"""A plugin's exception as each reader needs it: one line for the console, the file and
line in the plugin where it was raised, and the whole traceback for the log and the report.

The console keeps its one line per failure; the traceback goes where an author looks
when that line is not enough (the workload process's log, the report's problems, the
conformance harness's message).
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Failure:
    """An exception raised by a plugin's hook, as plain data (it crosses processes as JSON)."""

    line: str
    """``KeyError: 'used_mb'``: the type and the message."""
    where: str = ""
    """``tunekit_act_ckpt/plugin.py:42 in diagnose``: the innermost frame in the plugin's own
    package (else the innermost frame); empty when unknown."""
    traceback: str = ""

    @classmethod
    def of(cls, exc: BaseException, owner: type | None = None) -> Failure:
        return cls(
            f"{type(exc).__name__}: {exc}",
            raised_at(exc, owner),
            "".join(traceback.format_exception(exc)),
        )

    def one_line(self) -> str:
        """The line with where it was raised, for the console."""
        return f"{self.line} (at {self.where})" if self.where else self.line


def _package_root(owner: type) -> Path | None:
    """The folder of the package that defines ``owner`` (the module's file for a module that
    is not in a package)."""
    module = sys.modules.get(owner.__module__)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    return path.parent if "." in owner.__module__ else path


def raised_at(exc: BaseException, owner: type | None = None) -> str:
    """``file:line in function`` of the innermost frame of ``exc`` inside the package that
    defines ``owner`` (a plugin's tuner class), with the file relative to the folder that
    holds the package; the innermost frame of all when none is in it."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    root = _package_root(owner) if owner is not None else None
    chosen, base = frames[-1], None
    if root is not None:
        inside = [f for f in frames if Path(f.filename).resolve().is_relative_to(root)]
        if inside:
            chosen, base = inside[-1], root.parent
    path = Path(chosen.filename)
    shown = path.resolve().relative_to(base) if base is not None else path
    return f"{shown}:{chosen.lineno} in {chosen.name}"
