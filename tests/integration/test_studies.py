"""Studies cannot be mixed: a plan written whole (issue 18, item 12).

One runner per study (item 11) is checked on the study that
tests/integration/test_auto.py interrupts and resumes: while it runs, a second runner of it,
resuming it or starting a fresh one of the same key, is refused and told who runs it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest
from support import WORKLOADS, chaos_pythonpath

from tunekit.store import Store

pytestmark = pytest.mark.slow

FAST = ["--steps", "6", "--warmup", "1", "--no-probe"]


def auto(workdir, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tunekit",
        "auto",
        f"{WORKLOADS}:tiny",
        "--plugins",
        "chaos",
        *args,
        *FAST,
    ]


def test_a_plan_interrupted_while_written_is_planned_again_whole(workdir):
    env = {**os.environ, **chaos_pythonpath()}
    db = workdir / ".tunekit" / "tunekit.db"
    Store(db).close()
    conn = sqlite3.connect(db)
    # The third row of the plan cannot be written: as if tunekit died right after the second.
    conn.execute(
        "CREATE TRIGGER cut AFTER INSERT ON trials WHEN NEW.seq = 3 "
        "BEGIN SELECT RAISE(ABORT, 'power cut while the plan was written'); END"
    )
    conn.commit()
    res = subprocess.run(
        auto(workdir, "--trials", "3", "--json"),
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 2 and "power cut" in res.stderr, res.stdout + res.stderr
    conn.execute("DROP TRIGGER cut")
    conn.commit()
    assert [r[:3] for r in conn.execute("SELECT seq, role, status FROM trials ORDER BY seq")] == [
        (0, "baseline", "ok")
    ]
    # The resume plans again: every diagnosis and every candidate (a budget already spent
    # skips the trials themselves, which are not under test).
    res = subprocess.run(
        auto(workdir, "--resume", "--budget", "1s", "--json"),
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    assert any(e["event"] == "Diagnosed" and e["plugin"] == "chaos" for e in events)
    planned = next(e for e in events if e["event"] == "Planned")
    rows = conn.execute("SELECT role FROM trials WHERE role = 'candidate'").fetchall()
    assert len(rows) == len(planned["candidates"]) == 4
    conn.close()
