"""`tunekit auto` for real: torchrun trials on 2 gloo ranks, the store, the report."""

import json
import signal
import sqlite3
import subprocess
import sys

import pytest
from support import WORKLOADS

pytestmark = pytest.mark.slow

FAST = ["--steps", "6", "--warmup", "1"]


def _trials(workdir):
    conn = sqlite3.connect(workdir / ".tunekit" / "tunekit.db")
    conn.row_factory = sqlite3.Row
    return [dict(r) for r in conn.execute("SELECT * FROM trials ORDER BY seq")]


def test_auto_on_the_demo_writes_a_report_and_keeps_only_real_winners(cli, workdir):
    res = cli("auto", "example:cnn", "--nproc", "2", "--trials", "3", "--plugins", "overlap_chunking")
    assert res.returncode == 0, res.stderr + res.stdout
    out = workdir / "tunekit-out"
    for name in ("report.md", "report.json", "best_config.json", "best_config.md", "trials.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "trials.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "report.json").read_text())
    rows = _trials(workdir)
    assert len([r for r in rows if r["role"] in ("candidate", "confirm")]) >= 3
    assert sum(r["role"] == "baseline" for r in rows) >= 2  # interleaved baselines
    assert all(r["status"] == "ok" and r["median_s"] > 0 for r in rows)
    decision = report["decision"]
    if decision["winner"] != "baseline":
        winner = next(c for c in decision["candidates"] if c["description"] == decision["winner"])
        assert winner["comparison"]["ci_low"] > 1 + decision["min_effect"]
        assert winner["runs"] >= 2  # confirmed by a second run
    best = json.loads((out / "best_config.json").read_text())
    assert best["plugins"] == decision["winner_config"]["plugins"]
    assert "baseline vs best" in res.stdout
    snippet = (out / "best_config.md").read_text()
    assert "torchrun --standalone --nproc-per-node 2" in snippet
    # The report re-prints from the store alone.
    again = cli("report")
    assert again.returncode == 0 and "trials" in again.stdout


def test_failing_trials_are_recorded_and_the_study_completes(cli, workdir, chaos_env):
    res = cli("auto", "example:cnn", "--plugins", "chaos", "--trials", "3", "--timeout", "25s", *FAST,
              env_extra=chaos_env)
    assert res.returncode == 0, res.stderr + res.stdout
    status = {json.loads(r["config"])["plugins"]["chaos"]["mode"]: r for r in _trials(workdir) if r["role"] != "baseline"}
    assert status["raise"]["status"] == "crash" and "injected failure" in status["raise"]["error"]
    assert status["hang"]["status"] == "hang"
    assert status["oom"]["status"] == "oom"
    report = json.loads((workdir / "tunekit-out" / "report.json").read_text())
    assert report["decision"]["winner"] == "baseline"
    assert report["study"]["status"] == "finished"


def test_a_workload_that_raises_fails_its_baseline_clearly(cli, workdir):
    res = cli("auto", f"{WORKLOADS}:raises", "--trials", "1", *FAST)
    assert res.returncode == 2
    assert "the baseline trial failed (crash): RuntimeError: workload exploded on purpose" in res.stderr
    assert "Traceback" not in res.stderr
    assert _trials(workdir)[0]["status"] == "crash"


def test_resume_after_an_interrupted_study_reruns_nothing_finished(workdir):
    args = [sys.executable, "-m", "tunekit", "auto", f"{WORKLOADS}:tiny", "--plugins", "overlap_chunking",
            "--trials", "3", "--json", *FAST]
    proc = subprocess.Popen(args, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finished = 0
    for line in proc.stdout:
        if json.loads(line)["event"] == "TrialFinished":
            finished += 1
            if finished == 2:
                proc.send_signal(signal.SIGKILL)  # as hard as an interruption gets
                break
    proc.wait(timeout=60)
    before = {r["seq"]: r for r in _trials(workdir) if r["status"] == "ok"}
    assert len(before) >= 2

    res = subprocess.run([*args[:-len(FAST) - 1], "--resume", *FAST], cwd=workdir, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    started = next(e for e in events if e["event"] == "StudyStarted")
    assert started["resumed"] and started["finished_trials"] >= 2
    rerun = {e["seq"] for e in events if e["event"] == "TrialStarted"}
    assert not rerun & set(before)  # nothing finished runs again
    after = {r["seq"]: r for r in _trials(workdir)}
    for seq, row in before.items():
        assert after[seq]["finished"] == row["finished"] and after[seq]["id"] == row["id"]
    assert all(r["status"] in ("ok", "skipped") for r in after.values())
    conn = sqlite3.connect(workdir / ".tunekit" / "tunekit.db")
    assert conn.execute("SELECT count(*), min(status) FROM studies").fetchone() == (1, "finished")
