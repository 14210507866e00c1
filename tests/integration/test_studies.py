"""Studies cannot be mixed: one runner per study, and a plan written whole (issue 18, items 11, 12)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

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


def test_a_second_runner_of_a_study_is_refused_and_told_who_runs_it(workdir):
    env = {**os.environ, **chaos_pythonpath()}
    # The chaos tuner's second candidate hangs: the first runner stays in the middle of its study.
    first = subprocess.Popen(
        auto(workdir, "--trials", "3", "--stall", "10m", "--timeout", "10m", "--json"),
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in first.stdout:
            event = json.loads(line)
            if event["event"] == "TrialStarted" and "hang" in event["description"]:
                break
        else:
            pytest.fail(f"the first runner ended early: {first.stderr.read()}")
        while not any(t[2] == "running" for t in _trials(workdir)):  # the row follows the event
            time.sleep(0.1)
        before = _trials(workdir)
        for extra in (["--resume"], []):  # the same study again, or a fresh one of the same key
            second = subprocess.run(
                auto(workdir, "--trials", "3", *extra),
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert second.returncode == 2, second.stdout + second.stderr
            assert (
                f"(pid {first.pid})" in second.stderr
                and "is being run by tunekit auto" in second.stderr
            )
            assert "Traceback" not in second.stderr
        after = _trials(workdir)
        assert after == before  # nothing reset, re-run or added by the refused runners
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def _trials(workdir) -> list[tuple]:
    conn = sqlite3.connect(workdir / ".tunekit" / "tunekit.db")
    try:
        return conn.execute(
            "SELECT id, seq, status, started, finished FROM trials ORDER BY seq"
        ).fetchall()
    finally:
        conn.close()


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
