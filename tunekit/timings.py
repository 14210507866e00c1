"""Where a study's time goes: wall and CPU seconds per stage.

``tunekit auto`` records each stage (loading the plugins, observing the model, the probe,
each trial, each tuner's diagnosis and plan, deciding and writing the report) as it runs
them one after another, so the stages' wall times add up to the study's. CPU seconds say
what a stage cost apart from the machine's load: this process's own and its children's
that ended in the stage (a trial's torchrun agent and ranks, imports included; the probe's
ranks), plus the workload process's for the requests it answered (a tuner's diagnose).
The table goes to report.json (``timings``) and ``tunekit auto -v``.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Stage:
    stage: str
    """What ran: ``observe``, ``probe``, ``diagnose cgdp``, ``trial 3 candidate`` ..."""
    wall_s: float
    cpu_s: float | None = None
    """CPU seconds of every process that worked on it, as far as they are known."""
    detail: str = ""
    part_of: str = ""
    """The stage this one ran within, beside others (a tuner's diagnose in one of two workload
    processes): its time is in that stage's already, so totals leave it out."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def own_cpu_s() -> float:
    """CPU seconds of this process (all its threads) and of the children it has waited for
    (with theirs: a trial's agent and the ranks it waited for)."""
    mine = resource.getrusage(resource.RUSAGE_SELF)
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + ended.ru_utime + ended.ru_stime


class Timings:
    """The stages of one run, in the order they ended."""

    def __init__(self, earlier: list[dict[str, Any]] | None = None):
        self.stages = [Stage(**row) for row in earlier or []]

    @contextlib.contextmanager
    def stage(self, name: str, detail: str = "", part_of: str = "") -> Iterator[Stage]:
        """Time the ``with`` block; the caller adds the CPU of other processes to the stage it
        gets. ``part_of``: see :attr:`Stage.part_of` (its CPU is then only what the caller adds)."""
        wall, cpu = time.monotonic(), own_cpu_s()
        row = Stage(name, 0.0, 0.0, detail, part_of)
        try:
            yield row
        finally:
            row.wall_s = time.monotonic() - wall
            if not part_of:  # this process's CPU belongs to the enclosing stage then
                row.cpu_s = (row.cpu_s or 0.0) + own_cpu_s() - cpu
            self.stages.append(row)

    def add(self, name: str, wall_s: float, cpu_s: float | None, detail: str = "") -> None:
        self.stages.append(Stage(name, wall_s, cpu_s, detail))

    def to_list(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.stages]


def total(stages: list[dict[str, Any]]) -> tuple[float, float]:
    """Wall and CPU seconds of the stages, those within another counted once, in it."""
    top = [s for s in stages if not s.get("part_of")]
    return sum(s["wall_s"] for s in top), sum(s.get("cpu_s") or 0.0 for s in top)
