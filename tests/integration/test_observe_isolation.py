"""The workload's code runs in its own process, never in tunekit's: a workload that dies or
hangs while it is observed, or a tuner that does while it diagnoses, fails in one line,
and tunekit and its study store live on."""

import json
import re
import sqlite3
from types import SimpleNamespace

import psutil
import pytest
from support import RAISER_PLUGIN, WORKLOADS, chaos_pythonpath

from tunekit.cli.main import main
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


def in_process(capsys, *args: str) -> SimpleNamespace:
    """``tunekit ARGS`` through the entry point's ``main`` in this process: what a child process
    would have printed, without its start-up (its Python, tunekit's and the tuners' imports)."""
    code = main(list(args))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


# hangs_building never finishes building its model: any --timeout ends it, and the shortest
# that reads as a trial timeout costs the least waiting.
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
            ["--timeout", "3s"],
            "hang",
            r"no result within 3 s \(the trial timeout\)",
        ),
    ],
)
def test_a_workload_that_dies_or_hangs_while_observed_fails_in_one_line_and_keeps_the_store(
    workdir, capsys, workload, args, status, what
):
    db = workdir / ".tunekit" / "tunekit.db"
    before = Store(db)
    before.cache_put("kept", {"from": "an earlier study"})
    before.close()

    # In this process (the entry point's own main): tunekit itself lives on, and an exception
    # escaping it would fail the test. The workload's code runs in a child process, as always.
    res = in_process(
        capsys, "auto", f"{WORKLOADS}:{workload}", "--trials", "1", "--no-probe", *args
    )

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


RAISED = r"KeyError: 'used_mb' \(at tk_raiser\.py:\d+ in _used_mb\)"


def test_a_tuner_whose_diagnose_kills_its_process_is_a_plugin_problem_and_the_study_goes_on(
    cli, workdir
):
    # chaos's diagnose segfaults, raiser's raises; the tuners after chaos diagnose and plan in
    # a fresh process, the log keeps what all said, and the report names both failures. The
    # ranks' threads fill the cores, so the tuners share one workload process (two would share
    # them out by which is free first, and overlap_chunking could miss the fresh one).
    res = cli(
        "auto",
        f"{WORKLOADS}:tiny",
        "--plugins",
        "chaos,raiser,overlap_chunking",
        "--trials",
        "0",
        "--no-probe",
        "--json",
        *FAST,
        env_extra={
            **chaos_pythonpath(RAISER_PLUGIN),
            "TUNEKIT_CHAOS_DIAGNOSE": "segfault",
            "RAISER_DIAGNOSE": "raise",
            "OMP_NUM_THREADS": str(psutil.cpu_count(logical=False) or 1),
        },
        timeout=500,
    )

    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    crashed, raised = [e for e in events if e["event"] == "PluginProblem"]
    assert (crashed["plugin"], crashed["status"]) == ("chaos", "diagnose failed")
    assert re.match(
        r"the workload's process died of SIGSEGV \(segmentation fault\) at tunekit_chaos\.py:\d+ in "
        r"diagnose while running chaos's diagnose; its output is in .*observe(-\d+)?\.log$",
        crashed["error"],
    )
    assert (raised["plugin"], raised["status"]) == ("raiser", "diagnose failed")
    assert re.fullmatch(RAISED, raised["error"])
    assert 'tk_raiser.py", line' in raised["traceback"]
    assert [e["plugin"] for e in events if e["event"] == "Diagnosed"] == ["overlap_chunking"]
    assert not (workdir / ".tunekit" / "observe-2.log").exists()
    log = (workdir / ".tunekit" / "observe.log").read_text()
    assert "[tunekit: a fresh process for the workload; the one before it ended]" in log
    assert "plugin raiser's diagnose raised:\nTraceback" in log and "in _used_mb" in log
    assert any(e["event"] == "StudyFinished" for e in events)
    conn = sqlite3.connect(workdir / ".tunekit" / "tunekit.db")
    assert conn.execute("SELECT status FROM studies").fetchall() == [("finished",)]
    (logged,) = conn.execute(
        "SELECT payload FROM events WHERE kind='plugin_failed' AND payload LIKE '%raiser%'"
    ).fetchone()
    assert "in _used_mb" in json.loads(logged)["traceback"]
    assert not _workload_processes(workdir)

    # No tuner silently missing: both failures are in the report, the traceback with them.
    report = json.loads((workdir / "tunekit-out" / "report.json").read_text())
    assert [(p["plugin"], p["what"]) for p in report["problems"]] == [
        ("chaos", "diagnose failed"),
        ("raiser", "diagnose failed"),
    ]
    assert re.fullmatch(r"tk_raiser\.py:\d+ in _used_mb", report["problems"][1]["where"])
    markdown = (workdir / "tunekit-out" / "report.md").read_text()
    problems = markdown[markdown.index("## Problems") :]
    assert "| chaos | diagnose failed | the workload's process died of SIGSEGV" in problems
    assert "| raiser | diagnose failed | KeyError: 'used_mb' |" in problems
    assert 'tk_raiser.py", line' in problems and 'return memory["used_mb"]' in problems


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
            ["--timeout", "3s"],
            "hang",
            r"no result within 3 s \(the trial timeout\)",
        ),
    ],
)
def test_tunekit_profile_of_a_workload_that_dies_or_hangs_while_observed_fails_in_one_line(
    workdir, capsys, workload, args, status, what
):
    res = in_process(capsys, "profile", f"{WORKLOADS}:{workload}", "--out", "prof", *args)

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


def test_tunekit_plan_observes_and_runs_the_tuner_in_the_workloads_process(
    cli, workdir, capsys, chaos_env
):
    # The built-in tuner in this process; a plugin installed for one command (on the
    # PYTHONPATH of a child process) through the installed command.
    ok = in_process(capsys, "plan", "overlap_chunking", f"{WORKLOADS}:tiny", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["plugin"] == "overlap_chunking"

    dies = in_process(capsys, "plan", "overlap_chunking", f"{WORKLOADS}:segfaults_building")
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

    # A diagnose that raises: one line with where in the plugin; the traceback in the log.
    env = {**chaos_pythonpath(RAISER_PLUGIN), "RAISER_DIAGNOSE": "raise"}
    raised = cli("plan", "raiser", f"{WORKLOADS}:tiny", env_extra=env, timeout=300)
    assert raised.returncode == 2, (raised.returncode, raised.stderr)
    assert re.fullmatch(
        r"error: raiser's diagnose failed: KeyError: 'used_mb' \(at tk_raiser\.py:\d+ in "
        r"_used_mb; traceback in \.tunekit/observe\.log\)",
        raised.stderr.strip(),
    )
    log = (workdir / ".tunekit" / "observe.log").read_text()
    assert "plugin raiser's diagnose raised:" in log and "KeyError: 'used_mb'" in log

    # A diagnosis that does not apply: its candidates on request, marked so.
    shown = cli(
        "plan", "raiser", f"{WORKLOADS}:tiny", "--json", "--always-plan",
        env_extra=chaos_pythonpath(RAISER_PLUGIN), timeout=300,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    plan = json.loads(shown.stdout)
    assert plan["applies"] is False
    assert [(c["config"]["plugins"], c["status"]) for c in plan["candidates"]] == [
        ({"raiser": {"level": 1}}, "not applying")
    ]
    assert not _workload_processes(workdir)
