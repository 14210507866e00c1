"""Studies several tests read: run once per session, asserted on by each.

A session-scoped fixture is computed once per xdist worker; the root conftest.py
puts every test that uses one in the xdist group named after it
(``conftest.demo_study``), so the study runs once for all of them. Tests that
use a shared study read it and never change it (its working folder, its store);
a test that needs to change a study runs its own.

* :func:`demo_study` — ``tunekit auto example:cnn`` as a user runs it: every
  installed tuner diagnoses (the built-in ones and the third-party
  ``examples/tunekit-dataloader``, found on ``PYTHONPATH`` the real way), this
  machine's collectives are probed, the first-ranked candidate (a trial, or a
  tuner's in-job search of 8 steps) runs between baselines, a leader is
  measured once more and confirmed, and the report is written. One candidate
  slot: the decision, the feedback and the interleaving are the same with
  more, and each slot costs two torchrun trials or more.
  Trials are short (``--steps 6 --warmup 1``): what the tests check is what the
  study does with its measurements, not how fast the CNN trains. No paired rounds
  after the confirmation (``--measure-rounds 0``): on a noise-dominated demo they
  ran whenever the leader's interval held no gain, two trials each, and no test
  reads them; what a decision says after them is tested on recorded trials
  (tests/unit/test_usability.py).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
    args = ["auto", "example:cnn", "--nproc", "2", "--trials", str(slots), "--search-steps", "8"]
    args += ["--steps", "6", "--warmup", "1", "--measure-rounds", "0"]
    env = dataloader_on_path(workdir)
    return Study(workdir, run_cli(*args, cwd=workdir, env_extra=env, timeout=900), slots)


def dataloader_on_path(root: Path) -> dict[str, str]:
    """examples/tunekit-dataloader, a third-party tuner that writes no headline, found the real way:
    its entry point in a ``*.dist-info`` on PYTHONPATH (trial workers inherit it)."""
    info = root / "site" / "tunekit_dataloader-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tunekit-dataloader\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[tunekit.plugins]\ndataloader = tunekit_dataloader.plugin:DataLoaderTuner\n"
    )
    path = [
        str(root / "site"),
        str(EXAMPLES / "tunekit-dataloader"),
        os.environ.get("PYTHONPATH", ""),
    ]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), "COLUMNS": "300"}
