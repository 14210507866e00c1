"""A live job's metric lines (``metrics.jsonl``) read from outside it: the latest ones, and
the baseline they measure while the job runs the untuned config."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunekit.config import TuningConfig

if TYPE_CHECKING:
    from tunekit.observe.observation import Measurement


class MetricsTail:
    """The last ``keep`` lines of ``metrics.jsonl``, read incrementally (a poll reads only what was added)."""

    def __init__(self, path: Path, keep: int):
        self.path = path
        self.lines: deque[dict[str, Any]] = deque(maxlen=keep)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return list(self.lines)
        if size < self._offset:  # rewritten (a resume truncates it): start over
            self.lines.clear()
            self._offset, self._partial = 0, b""
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        data = self._partial + chunk
        *complete, self._partial = data.split(b"\n")
        for line in complete:
            if line.strip():
                try:
                    self.lines.append(json.loads(line))
                except ValueError:
                    continue
        return list(self.lines)


def live_baseline(
    metrics: Sequence[Mapping[str, Any]], world_size: int, min_steps: int = 8
) -> Measurement | None:
    """The live job's recent steps as a baseline :class:`Measurement`, when it runs the untuned config.

    The first steps after a config change or a relaunch are left out (warm-up).
    """
    from tunekit.trials.stats import summarize  # here: reading metrics must not import torch

    base_id = TuningConfig().config_id
    run: list[Mapping[str, Any]] = []
    for m in metrics:  # the trailing run of baseline steps at this world size
        if m.get("config_id") == base_id and m.get("world_size") == world_size:
            run.append(m)
        else:
            run = []
    steps = [m["step_s"] for m in run[3:] if m.get("step_s")]
    if len(steps) < min_steps:
        return None
    return summarize(steps, int(run[-1].get("batch_size", 0)) * world_size)
