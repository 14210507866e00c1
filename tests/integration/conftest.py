"""Studies several tests read: run once per session, asserted on by each.

A session-scoped fixture is computed once per xdist worker; the root conftest.py
puts every test that uses one in the xdist group named after it
(``conftest.demo_study``), so the study runs once for all of them. Tests that
use a shared study read it and never change it (its working folder, its store);
a test that needs to change a study runs its own.

* :func:`demo_study` — ``tunekit auto example:cnn`` as the README's demo runs it:
  every built-in tuner diagnoses, this machine's collectives are probed, the
  first-ranked candidate (a trial, or a tuner's in-job search) runs between
  baselines, a winner is confirmed, and the report is written. One candidate
  slot: the decision, the feedback and the interleaving are the same with
  more, and each slot costs two torchrun trials or more.
  Trials are short (``--steps 6 --warmup 1``): what the tests check is what the
  study does with its measurements, not how fast the CNN trains.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import run_cli


@dataclass
class Study:
    """A finished ``tunekit auto`` in its own working folder."""

    workdir: Path
    result: subprocess.CompletedProcess
    """The command's exit code and output."""
    slots: int
    """Candidate trials it was given (``--trials``)."""

    @property
    def out(self) -> Path:
        return self.workdir / "tunekit-out"

    def report(self) -> dict[str, Any]:
        return json.loads((self.out / "report.json").read_text())

    def trials(self) -> list[dict[str, Any]]:
        """The store's trial rows, in the order they ran."""
        conn = sqlite3.connect(self.workdir / ".tunekit" / "tunekit.db")
        conn.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in conn.execute("SELECT * FROM trials ORDER BY seq")]
        finally:
            conn.close()

    def cli(self, *args: str, env_extra: dict[str, str] | None = None):
        """``tunekit ARGS`` in the study's folder (commands that read the study, not change it)."""
        return run_cli(*args, cwd=self.workdir, env_extra=env_extra)


@pytest.fixture(scope="session")
def demo_study(tmp_path_factory) -> Study:
    workdir = tmp_path_factory.mktemp("demo_study")
    slots = 1
    args = ["auto", "example:cnn", "--nproc", "2", "--trials", str(slots)]
    args += ["--steps", "6", "--warmup", "1"]
    return Study(workdir, run_cli(*args, cwd=workdir, timeout=900), slots)
