"""Background sampling of every telemetry source into one JSON-able time series.

:class:`TelemetrySampler` runs one daemon thread that, every ``interval_s``,
reads the ranks' pids and samples NVML and the host, and every
``pyspy_interval_s`` dumps the ranks' Python stacks. Samples go into a
:class:`TimeSeries` (bounded per source) that the TUI polls while the job runs
and reports read afterwards (:meth:`TimeSeries.to_dict`, :meth:`TelemetrySampler.summary`).

A source that cannot run says so once in :attr:`TelemetrySampler.notices`; a
sample that raises is counted in ``errors`` and skipped. Sampling never
raises into the caller.

Ranks' pids come from a :data:`PidSource`: a mapping ``rank -> pid``, a
callable returning one, or a directory with one file per rank (``rank<R>``,
holding the pid) — a trial directory's ``pids/`` folder, or the trial
directory itself.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tunekit.observe.telemetry.host import HostSource, summarize_host
from tunekit.observe.telemetry.nvml import NvmlSource, summarize_nvml
from tunekit.observe.telemetry.pyspy import PySpySource, summarize_pyspy

PidSource = Mapping[int, int] | Callable[[], Mapping[int, int]] | str | Path
"""Where the ranks' pids come from (see the module docstring)."""


def read_pid_dir(path: str | Path) -> dict[int, int]:
    """``{rank: pid}`` from ``rank<R>`` files in ``path`` (or in ``path/pids``)."""
    path = Path(path)
    if (path / "pids").is_dir():
        path = path / "pids"
    out: dict[int, int] = {}
    if not path.is_dir():
        return out
    for f in path.glob("rank*"):
        suffix = f.name.removeprefix("rank")
        if not suffix.isdigit():
            continue
        try:
            out[int(suffix)] = int(f.read_text().strip())
        except (OSError, ValueError):
            continue  # being written: read it next time
    return dict(sorted(out.items()))


def resolve_pids(source: PidSource) -> dict[int, int]:
    if isinstance(source, str | Path):
        return read_pid_dir(source)
    if callable(source):
        return {int(k): int(v) for k, v in dict(source()).items()}
    return {int(k): int(v) for k, v in source.items()}


class TimeSeries:
    """Samples per source, each ``{"t": unix time, "data": {...}}``; thread-safe, bounded."""

    def __init__(self, max_samples: int = 10_000):
        self.max_samples = max_samples
        self._series: dict[str, deque] = {}
        self._lock = threading.Lock()

    def add(self, source: str, t: float, data: dict[str, Any]) -> None:
        with self._lock:
            q = self._series.setdefault(source, deque(maxlen=self.max_samples))
            q.append({"t": t, "data": data})

    def samples(self, source: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._series.get(source, ()))

    def latest(self, source: str) -> dict[str, Any] | None:
        with self._lock:
            q = self._series.get(source)
            return q[-1] if q else None

    def sources(self) -> list[str]:
        with self._lock:
            return sorted(self._series)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            return {name: list(q) for name, q in self._series.items()}

    @classmethod
    def from_dict(
        cls, d: Mapping[str, list[dict[str, Any]]], max_samples: int = 10_000
    ) -> TimeSeries:
        ts = cls(max_samples)
        for name, samples in d.items():
            for s in samples:
                ts.add(name, s["t"], s["data"])
        return ts


class TelemetrySampler:
    """Samples NVML, host and py-spy in a background thread (see the module docstring).

    Use as a context manager around the job, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        pids: PidSource,
        *,
        interval_s: float = 0.5,
        pyspy_interval_s: float = 2.0,
        nvml: bool = True,
        host: bool = True,
        pyspy: bool = True,
        pyspy_exe: str | None = None,
        max_samples: int = 10_000,
    ):
        if interval_s <= 0 or pyspy_interval_s <= 0:
            raise ValueError("sampling intervals must be positive")
        self.pid_source = pids
        self.interval_s = interval_s
        self.pyspy_interval_s = pyspy_interval_s
        self.series = TimeSeries(max_samples)
        self.notices: list[str] = []
        self.errors: dict[str, int] = {}
        self.sources: dict[str, Any] = {}
        factories = (
            (nvml, NvmlSource),
            (host, HostSource),
            (pyspy, lambda: PySpySource(exe=pyspy_exe)),
        )
        for wanted, factory in factories:
            if not wanted:
                continue
            try:
                src = factory()
            except Exception as exc:  # a source that cannot even start is a notice, not a crash
                self.notices.append(
                    f"a telemetry source could not start ({type(exc).__name__}: {exc})"
                )
                continue
            if src.available:
                self.sources[src.name] = src
            elif src.notice:
                self.notices.append(src.notice)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at: float | None = None
        self.stopped_at: float | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> TelemetrySampler:
        if self._thread is None:
            self.started_at = time.time()
            self._thread = threading.Thread(target=self._run, name="tunekit-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(10.0, 3 * self.interval_s))
            self._thread = None
        self.stopped_at = time.time()
        for src in self.sources.values():
            try:
                src.close()
            except Exception:
                pass

    def __enter__(self) -> TelemetrySampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- sampling ----------------------------------------------------------------------

    def sample_once(self, include_pyspy: bool = True) -> None:
        """Take one sample of every source now (the thread's body; usable directly)."""
        try:
            pids = resolve_pids(self.pid_source)
        except Exception:
            self.errors["pids"] = self.errors.get("pids", 0) + 1
            pids = {}
        for name, src in list(self.sources.items()):
            if name == "pyspy" and (not include_pyspy or not pids):
                continue
            t = time.time()
            try:
                data = src.sample(pids)
            except Exception:
                self.errors[name] = self.errors.get(name, 0) + 1
                continue
            if not src.available:  # it found out it cannot run (py-spy denied)
                if src.notice and src.notice not in self.notices:
                    self.notices.append(src.notice)
                del self.sources[name]
                continue
            if data is not None:
                self.series.add(name, t, data)

    def _run(self) -> None:
        next_spy = time.monotonic()
        while not self._stop.is_set():
            begin = time.monotonic()
            spy = begin >= next_spy
            if spy:
                next_spy = begin + self.pyspy_interval_s
            self.sample_once(include_pyspy=spy)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - begin)))

    # -- results -----------------------------------------------------------------------

    def static(self) -> dict[str, Any]:
        """What the sources learnt once: GPUs and topology, host sizes, py-spy settings."""
        out = {name: dict(src.static) for name, src in self.sources.items()}
        nv = self.sources.get("nvml")
        if nv is not None:
            out["nvml"]["unsupported"] = nv.unsupported()
        return out

    def summary(self) -> dict[str, Any]:
        """Per source summaries (host, nvml, pyspy), notices and error counts."""
        out: dict[str, Any] = {
            "interval_s": self.interval_s,
            "duration_s": (self.stopped_at or time.time()) - (self.started_at or time.time()),
            "notices": list(self.notices),
            "errors": dict(self.errors),
            "samples": {name: len(self.series.samples(name)) for name in self.series.sources()},
        }
        host = self.series.samples("host")
        if host:
            out["host"] = summarize_host(host)
        nvml = self.series.samples("nvml")
        if nvml:
            out["nvml"] = summarize_nvml(nvml)
        spy = self.series.samples("pyspy")
        if spy:
            out["pyspy"] = summarize_pyspy(spy)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-able: settings, notices, static facts, the time series, summary."""
        return {
            "interval_s": self.interval_s,
            "pyspy_interval_s": self.pyspy_interval_s,
            "notices": list(self.notices),
            "static": self.static(),
            "series": self.series.to_dict(),
            "summary": self.summary(),
        }
