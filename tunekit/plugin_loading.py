"""Finding tuner plugins, loading them, and saying what state each is in.

Three separate steps, as flake8 and mkdocs keep them:

* :func:`discover` lists entry points in the ``tunekit.plugins`` group,
  sorted by name so that every process sees the same order;
* :func:`load` imports one and instantiates its tuner class;
* :func:`classify` checks the result against the contract.

A plugin that fails any step is reported with its package name and the
error; the others still load — also when its import calls ``sys.exit``. Each
import is timed: one that is slow costs every rank of every trial and relaunch
as much, and is reported (:func:`slow_imports`). The clock starts after the
core's own imports (:data:`CORE_MODULES`: torch and what ``tunekit.api``
brings), so a plugin is charged only for what it adds.

Discovery never looks in the working directory that ``python -m`` and ``-c``
put first on the import path: ranks are started that way, and a ``*.dist-info``
folder lying there would be loaded by every rank while ``tunekit plugins`` (a
console script, without that entry) never showed it. Every process sees the
plugins installed on its configured path, the same ones.
(This module cannot be called ``plugins``: that name is the mapped
``tunekit.plugins`` package of built-in tuners.)
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, distributions
from typing import Protocol

from tunekit import API_VERSION
from tunekit.contract import Aspect, Tuner
from tunekit.errors import PluginError

GROUP = "tunekit.plugins"
SLOW_IMPORT_S = 3.0
"""An import slower than this is reported: every rank and relaunch pays it again."""

_import_s: dict[str, float] = {}
"""Seconds each plugin module took to import, measured once per process (later loads hit
Python's module cache)."""

OK = "ok"
FAILED = "failed"  # raised while importing or instantiating
INCOMPATIBLE = "incompatible"  # written for another major version of the contract
INVALID = "invalid"  # loaded, but does not honour the contract


@dataclass
class PluginRecord:
    name: str
    package: str
    """Distribution that registered the entry point, with its version."""
    value: str
    """``module:Class`` the entry point points at."""
    status: str
    error: str = ""
    tuner: Tuner | None = None
    import_s: float = 0.0
    """How long importing it took in this process (the first time), after the core's own
    imports (torch): what the plugin itself adds."""
    traceback: str = ""
    """The traceback, when importing or instantiating it raised."""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def title(self) -> str:
        return getattr(self.tuner, "title", "") if self.tuner else ""

    @property
    def aspect(self) -> str:
        return str(getattr(self.tuner, "aspect", "")) if self.tuner else ""


def search_path() -> list[str]:
    """``sys.path`` without the entry ``python -m``/``-c`` add for the working directory.

    A process tunekit forked from a server started with ``PYTHONSAFEPATH``
    (:mod:`tunekit.trials.warm_start`) has the server's ``sys.flags.safe_path`` but its
    folder first, as ``python -m`` would: under that flag the working directory leads the
    path only where ``PYTHONPATH`` names it (then it stays) or where such a fork put it.
    """
    path = list(sys.path)
    cwd = os.getcwd()
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    if path and path[0] in ("", cwd) and not (sys.flags.safe_path and cwd in named):
        path = path[1:]
    return path


def discover() -> list[EntryPoint]:
    """Entry points of the group, one per name (first registration wins), sorted."""
    found: list[EntryPoint] = []
    dists_seen: set[str] = set()
    for dist in distributions(path=search_path()):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in dists_seen:  # a distribution shadowed by one earlier on the path
            continue
        dists_seen.add(name)
        found += [ep for ep in dist.entry_points if ep.group == GROUP]
    seen: dict[str, EntryPoint] = {}
    for ep in sorted(found, key=lambda e: (e.name, e.value)):
        seen.setdefault(ep.name, ep)
    return list(seen.values())


def _package(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else ep.value.split(":")[0]


def _failure(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


def load(ep: EntryPoint) -> PluginRecord:
    """Import and instantiate one plugin; never raises (Ctrl-C aside)."""
    rec = PluginRecord(ep.name, _package(ep), ep.value, status=FAILED)
    module = ep.value.split(":")[0]
    _import_core()
    started = time.perf_counter()
    try:
        cls = ep.load()
    except (Exception, SystemExit) as exc:  # a plugin's exit must not end tunekit
        rec.error = f"import failed: {_failure(exc)}"
        rec.traceback = "".join(traceback.format_exception(exc))
        return rec
    finally:
        _import_s.setdefault(module, time.perf_counter() - started)
        rec.import_s = _import_s[module]
    return classify(rec, cls)


CORE_MODULES = ("tunekit.api",)
"""What plugins import from the core (torch above all): imported before a plugin's import
is timed, so that the first plugin loaded is not blamed for seconds that are the core's."""


def _import_core() -> None:
    for name in CORE_MODULES:
        importlib.import_module(name)


def slow_imports(records: list[PluginRecord]) -> list[str]:
    """One line for each plugin whose import took longer than ``SLOW_IMPORT_S``."""
    return [
        f"plugin {r.name} ({r.package}) took {r.import_s:.1f} s to import; every rank of every trial "
        "and relaunch pays that again"
        for r in records
        if r.import_s > SLOW_IMPORT_S
    ]


def classify(rec: PluginRecord, cls: object) -> PluginRecord:
    """Check a loaded object against the contract and fill in ``rec``."""
    if not (inspect.isclass(cls) and issubclass(cls, Tuner)):
        rec.status, rec.error = INVALID, f"{rec.value} is not a tunekit.contract.Tuner subclass"
        return rec
    major = getattr(cls, "api_version", None)
    if major != API_VERSION[0]:
        rec.status = INCOMPATIBLE
        rec.error = (
            f"written for tuner API {major}, this tunekit speaks {API_VERSION[0]}; "
            f"install a tunekit with API {major} or update the plugin"
        )
        return rec
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        rec.status, rec.error = INVALID, f"does not implement {', '.join(missing)}"
        return rec
    for attr in ("name", "title", "aspect"):
        if not getattr(cls, attr, None):
            rec.status, rec.error = INVALID, f"does not declare {attr!r}"
            return rec
    if not isinstance(cls.aspect, Aspect):
        rec.status, rec.error = INVALID, f"aspect {cls.aspect!r} is not a tunekit.contract.Aspect"
        return rec
    if cls.name != rec.name:
        rec.status = INVALID
        rec.error = f"registered as {rec.name!r} but names itself {cls.name!r}"
        return rec
    try:
        tuner = cls()
        knobs = list(tuner.knobs())
    except (Exception, SystemExit) as exc:
        rec.status, rec.error = FAILED, _failure(exc)
        rec.traceback = "".join(traceback.format_exception(exc))
        return rec
    names = [k.name for k in knobs]
    if len(set(names)) != len(names):
        rec.status, rec.error = INVALID, "declares a knob name twice"
        return rec
    rec.status, rec.tuner = OK, tuner
    return rec


def load_all() -> list[PluginRecord]:
    """Every installed plugin, loaded and classified, in name order."""
    return [load(ep) for ep in discover()]


def load_named(names: list[str]) -> list[PluginRecord]:
    """Load only the plugins called ``names`` (a trial worker needs no others)."""
    wanted = set(names)
    return [load(ep) for ep in discover() if ep.name in wanted]


def available_tuners(records: list[PluginRecord] | None = None) -> dict[str, Tuner]:
    """Name -> tuner for the plugins that loaded cleanly."""
    records = load_all() if records is None else records
    # (an ok record always has its tuner: load() sets both together)
    return {r.name: r.tuner for r in records if r.ok and r.tuner is not None}


class Loaded(Protocol):
    """What :func:`check_names` reads of a plugin: a :class:`PluginRecord`, or the same facts
    as data (the TUI lists the plugins in a child process)."""

    name: str
    package: str
    status: str
    error: str

    @property
    def ok(self) -> bool: ...


def check_names(records: Sequence[Loaded], names: list[str]) -> None:
    """Every name installed and loading, or one line (PluginError) on the first that is not."""
    by_name = {r.name: r for r in records}
    for name in names:
        rec = by_name.get(name)
        if rec is None:
            raise _unknown(name, by_name)
        if not rec.ok:
            raise PluginError(f"plugin {name!r} from {rec.package} is {rec.status}: {rec.error}")


def check_installed(names: list[str]) -> None:
    """Every name installed, or the line :func:`check_names` gives, from the entry points
    alone: a mistyped name is refused before any plugin (and torch, which they import) loads."""
    installed = {ep.name for ep in discover()}
    for name in names:
        if name not in installed:
            raise _unknown(name, installed)


def _unknown(name: str, installed: Iterable[str]) -> PluginError:
    known = ", ".join(sorted(installed)) or "none installed"
    return PluginError(f"unknown plugin {name!r} (installed: {known})")


def select(records: list[PluginRecord], names: list[str] | None) -> dict[str, Tuner]:
    """The tuners named (all working ones when ``names`` is None); unknown names are errors."""
    if names is None:
        return available_tuners(records)
    check_names(records, names)
    by_name = {r.name: r for r in records}
    chosen: dict[str, Tuner] = {}
    for name in names:
        tuner = by_name[name].tuner
        assert tuner is not None  # ok: load() set it
        chosen[name] = tuner
    return chosen
