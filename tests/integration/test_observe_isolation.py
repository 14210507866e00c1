"""The workload's code runs in its own process, never in tunekit's: a workload that dies or
hangs while it is observed, or a tuner that does while it diagnoses, fails in one line,
and tunekit and its study store live on."""

import json
import re
import sqlite3

import psutil
import pytest
from support import WORKLOADS

from tunekit.store import Store

# Classification and clean-up, not timings: these hold on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.busy_ok]

FAST = ["--steps", "4", "--warmup", "1"]


def _workload_processes(workdir) -> list[int]:
    """Children running a workload's code for a tunekit started in ``workdir`` that are still alive."""
    alive = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = p.info["cmdline"] or []
        if "tunekit.observe.workload_child" in cmd and p.info["cwd"] == str(workdir):
            alive.append(p.pid)
    return alive


@pytest.mark.parametrize(
    ("workload", "args", "status", "what"),
    [
        (
            "segfaults_building",
            [],
            "crash",
            r"the workload's process died of SIGSEGV \(segmentation fault\) at workloads\.py:\d+ in _segfault",
        ),
        (
            "exits_building",
            [],
            "crash",
            r"the workload's process exited with code 0 without a result",
        ),
        (
            "hangs_building",
            ["--timeout", "8s"],
            "hang",
            r"no result within 8 s \(the trial timeout\)",
        ),
    ],
)
def test_a_workload_that_dies_or_hangs_while_observed_fails_in_one_line_and_keeps_the_store(
    cli, workdir, workload, args, status, what
):
    db = workdir / ".tunekit" / "tunekit.db"
    before = Store(db)
    before.cache_put("kept", {"from": "an earlier study"})
    before.close()

    res = cli("auto", f"{WORKLOADS}:{workload}", "--trials", "1", "--no-probe", *args, timeout=500)

    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert re.fullmatch(
        rf"error: could not observe .*:{workload} \({status}\): {what} while building and tracing "
        r"the model.*; its output is in \.tunekit/observe\.log",
        lines[0],
    ), lines[0]
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert conn.execute("SELECT value FROM cache WHERE key='kept'").fetchone() == (
        '{"from": "an earlier study"}',
    )
    (payload,) = conn.execute(
        "SELECT payload FROM events WHERE kind='observation_failed'"
    ).fetchone()
    assert json.loads(payload)["status"] == status
    assert conn.execute("SELECT count(*) FROM studies").fetchone() == (0,)
    assert not _workload_processes(workdir)


def test_a_tuner_whose_diagnose_kills_its_process_is_a_plugin_problem_and_the_study_goes_on(
    cli, workdir, chaos_env
):
    # chaos's diagnose segfaults; overlap_chunking then diagnoses and plans in a fresh process,
    # and the log keeps what both said.
    res = cli(
        "auto",
        f"{WORKLOADS}:tiny",
        "--plugins",
        "chaos,overlap_chunking",
        "--trials",
        "0",
        "--no-probe",
        "--json",
        *FAST,
        env_extra={**chaos_env, "TUNEKIT_CHAOS_DIAGNOSE": "segfault"},
        timeout=500,
    )

    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    (problem,) = [e for e in events if e["event"] == "PluginProblem"]
    assert (problem["plugin"], problem["status"]) == ("chaos", "diagnose failed")
    assert re.match(
        r"the workload's process died of SIGSEGV \(segmentation fault\) at tunekit_chaos\.py:\d+ in "
        r"diagnose while running chaos's diagnose; its output is in .*observe\.log$",
        problem["error"],
    )
    assert [e["plugin"] for e in events if e["event"] == "Diagnosed"] == ["overlap_chunking"]
    log = (workdir / ".tunekit" / "observe.log").read_text()
    assert "[tunekit: a fresh process for the workload; the one before it ended]" in log
    assert any(e["event"] == "StudyFinished" for e in events)
    conn = sqlite3.connect(workdir / ".tunekit" / "tunekit.db")
    assert conn.execute("SELECT status FROM studies").fetchall() == [("finished",)]
    assert not _workload_processes(workdir)


@pytest.mark.parametrize(
    ("workload", "args", "status", "what"),
    [
        (
            "segfaults_building",
            [],
            "crash",
            r"the workload's process died of SIGSEGV \(segmentation fault\) at workloads\.py:\d+ in _segfault",
        ),
        (
            "exits_building",
            [],
            "crash",
            r"the workload's process exited with code 0 without a result",
        ),
        (
            "hangs_building",
            ["--timeout", "8s"],
            "hang",
            r"no result within 8 s \(the trial timeout\)",
        ),
    ],
)
def test_tunekit_profile_of_a_workload_that_dies_or_hangs_while_observed_fails_in_one_line(
    cli, workdir, workload, args, status, what
):
    res = cli("profile", f"{WORKLOADS}:{workload}", "--out", "prof", *args, timeout=300)

    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert re.fullmatch(
        rf"error: could not observe .*:{workload} \({status}\): {what} while building and tracing "
        r"the model.*; its output is in prof/observe\.log",
        lines[0],
    ), lines[0]
    assert (workdir / "prof" / "observe.log").exists()
    assert not (workdir / "prof" / "trial").exists()  # nothing was launched
    assert not _workload_processes(workdir)


def test_tunekit_plan_observes_and_runs_the_tuner_in_the_workloads_process(cli, workdir, chaos_env):
    ok = cli("plan", "overlap_chunking", f"{WORKLOADS}:tiny", "--json", timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["plugin"] == "overlap_chunking"

    dies = cli("plan", "overlap_chunking", f"{WORKLOADS}:segfaults_building", timeout=300)
    assert dies.returncode == 2, (dies.returncode, dies.stderr)
    assert re.fullmatch(
        r"error: could not observe .*:segfaults_building \(crash\): the workload's process died of "
        r"SIGSEGV \(segmentation fault\) at workloads\.py:\d+ in _segfault while building and "
        r"tracing the model; its output is in \.tunekit/observe\.log",
        dies.stderr.strip(),
    )

    broken = cli(
        "plan",
        "chaos",
        f"{WORKLOADS}:tiny",
        env_extra={**chaos_env, "TUNEKIT_CHAOS_DIAGNOSE": "segfault"},
        timeout=300,
    )
    assert broken.returncode == 2, (broken.returncode, broken.stderr)
    assert re.fullmatch(
        r"error: chaos's diagnose failed: the workload's process died of SIGSEGV \(segmentation "
        r"fault\) at tunekit_chaos\.py:\d+ in diagnose while running chaos's diagnose; its output is "
        r"in \.tunekit/observe\.log",
        broken.stderr.strip(),
    )
    assert "Traceback" not in ok.stderr + dies.stderr + broken.stderr
    assert not _workload_processes(workdir)
