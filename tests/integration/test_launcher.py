"""Relaunch trials for real: torchrun, gloo, 2 ranks."""

import json
import os
import re
import time

import pytest
from support import WORKLOADS, chaos_pythonpath, live_rank_pids

from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync

# Classification and clean-up, not timings: these hold on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.busy_ok]


def test_ok_trial_reports_every_rank_and_progress_though_it_prints_out_of_memory(tmp_path):
    # Every forward pass prints "out of memory" and "OutOfMemoryError": words, not an error.
    # (The tiny MLP otherwise: one trial carries both claims.)
    seen = []
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:says_out_of_memory", warmup=1, steps=5),
        LaunchOptions(nproc=2, timeout_s=120),
        tmp_path,
        on_progress=seen.append,
    )
    assert out.status == "ok", out.error
    assert [r["rank"] for r in out.ranks] == [0, 1]
    assert all(len(r["step_s"]) == 5 and r["status"] == "ok" for r in out.ranks)
    assert out.measurement.median_s > 0 and len(out.measurement.step_s) == 5
    assert out.measurement.samples_per_s == pytest.approx(16 / out.measurement.median_s)
    assert [p["index"] for p in seen if p["phase"] == "measure"] == [1, 2, 3, 4, 5]
    assert (tmp_path / "spec.json").exists() and (tmp_path / "agent0.log").exists()
    assert "out of memory" in (tmp_path / "agent0.log").read_text()


def test_a_raising_workload_is_a_crash_with_its_message(tmp_path):
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:raises", warmup=1, steps=4),
        LaunchOptions(nproc=2, timeout_s=120),
        tmp_path,
    )
    assert out.status == "crash"
    assert "workload exploded on purpose" in out.error
    assert not live_rank_pids(tmp_path)


def test_a_workload_whose_steps_stop_is_killed_as_a_hang_without_waiting_for_the_timeout(tmp_path):
    start = time.monotonic()
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:hangs", warmup=1, steps=4),
        LaunchOptions(nproc=2, timeout_s=300, stall_s=2),
        tmp_path,
    )
    assert out.status == "hang"
    # Its third forward pass never returns: the last step line was measure step 1. The stall
    # caught it (the timeout says "no result within 300 s"), before the timeout.
    assert out.error.startswith("no step finished for ") and "after measure step 1/4" in out.error
    assert time.monotonic() - start < 300
    assert not live_rank_pids(tmp_path)  # the whole process group is gone


def test_a_trial_past_its_timeout_is_killed_as_a_hang(tmp_path):
    # It never finishes a step, however fast its ranks start: a hang, not a slow trial.
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:hangs_building", warmup=1, steps=4),
        LaunchOptions(nproc=2, timeout_s=3, stall_s=None),
        tmp_path,
    )
    assert out.status == "hang"
    assert out.error == "no result within 3 s; killed the trial's processes"
    assert not live_rank_pids(tmp_path)


def test_out_of_memory_is_classified(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", chaos_pythonpath()["PYTHONPATH"])
    spec = TrialSpec(
        "example:cnn", config={"plugins": {"chaos": {"mode": "oom"}}}, warmup=1, steps=3
    )
    out = run_trial_sync(spec, LaunchOptions(nproc=2, timeout_s=120), tmp_path)
    assert out.status == "oom"
    assert "out of memory" in out.error


def test_two_loopback_nodes_form_one_job(tmp_path):
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:tiny", warmup=1, steps=3),
        LaunchOptions(nproc=1, loopback_nodes=2, timeout_s=120),
        tmp_path,
    )
    assert out.status == "ok", out.error
    assert sorted(r["rank"] for r in out.ranks) == [0, 1]
    assert all(r["world_size"] == 2 for r in out.ranks)
    assert (tmp_path / "agent0.log").exists() and (tmp_path / "agent1.log").exists()
    assert os.path.getsize(tmp_path / "rank1.json") > 0


def test_a_trial_whose_steps_finish_but_outlast_the_timeout_is_too_slow_not_a_hang(
    tmp_path, monkeypatch
):
    # 1 s steps, 31 of them: they keep coming, but not all within 20 s (start-up included).
    # The timeout leaves start-up (about 4 s here, 3-4x that on a loaded machine) room for a
    # step or more; the pace itself comes from the workload's sleep, not the machine.
    monkeypatch.setenv("PYTHONPATH", chaos_pythonpath()["PYTHONPATH"])
    spec = TrialSpec(
        f"{WORKLOADS}:tiny",
        config={"plugins": {"chaos": {"mode": "slow", "sleep_s": 1.0}}},
        warmup=1,
        steps=30,
    )
    out = run_trial_sync(spec, LaunchOptions(nproc=2, timeout_s=20, stall_s=60), tmp_path)
    assert out.status == "too_slow", (out.error, out.startup_s)
    pace = re.fullmatch(
        r"too slow: (\d+\.\d) s per step, (\d+) of 31 steps done when the 20 s timeout came; "
        r"killed the trial's processes",
        out.error,
    )
    assert pace and float(pace[1]) >= 1.0 and 1 <= int(pace[2]) < 31
    assert 0 < out.startup_s < 20 and out.measurement is None
    assert not live_rank_pids(tmp_path)


def test_a_segfaulting_rank_is_a_crash_that_names_its_signal_and_where(tmp_path):
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:segfaults", warmup=1, steps=4),
        LaunchOptions(nproc=2, timeout_s=120),
        tmp_path,
    )
    assert out.status == "crash"
    assert re.fullmatch(
        r"rank [01] died of SIGSEGV \(segmentation fault\) at workloads\.py:\d+ in _segfault",
        out.error,
    ), out.error
    assert "error_file" not in out.error
    assert not live_rank_pids(tmp_path)


def test_a_trial_that_prints_without_limit_keeps_a_capped_log_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNEKIT_TEST_CHATTER_MIB", "8")  # per rank: 16 MiB through one agent
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:chatty", warmup=1, steps=3),
        LaunchOptions(nproc=2, timeout_s=120),
        tmp_path,
    )
    assert out.status == "ok", out.error
    log = tmp_path / "agent0.log"
    assert log.stat().st_size < 2 * 2**20

    from tunekit.orchestrator import _trial_result
    from tunekit.trials.output import HEAD_BYTES, TAIL_BYTES

    assert log.stat().st_size <= HEAD_BYTES + TAIL_BYTES + 200
    text = log.read_text()
    assert text.startswith("chatty: first line") and "of output dropped here" in text
    assert "chatty: last line" in text[-TAIL_BYTES:]
    (record,) = _trial_result(out)["output"]  # what the study store keeps of the trial
    assert record["log"] == "agent0.log" and record["bytes"] >= 16 * 2**20
    assert record["kept_bytes"] == HEAD_BYTES + TAIL_BYTES
    assert record["dropped_bytes"] == record["bytes"] - record["kept_bytes"]


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_ranks_fork_from_their_agent_unless_asked_and_run_their_exit_hooks(
    tmp_path, monkeypatch, start
):
    report = tmp_path / "report"
    report.mkdir()
    monkeypatch.setenv("TUNEKIT_TEST_REPORT_DIR", str(report))
    monkeypatch.setenv("TUNEKIT_RANK_START", start)
    out = run_trial_sync(
        TrialSpec(f"{WORKLOADS}:reports_its_start", warmup=1, steps=2),
        LaunchOptions(nproc=2),
        tmp_path / "trial",
    )
    assert out.status == "ok", out.error
    facts = [json.loads((report / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Forked, a rank finds what its agent imported; spawned, it imports torch._dynamo itself.
    assert [f["dynamo_loaded"] for f in facts] == [start == "fork"] * 2
    assert facts[0]["ppid"] == facts[1]["ppid"]  # both the one agent's children
    assert not any(f["holds_agents_port"] for f in facts)
    assert [(report / f"rank{r}.exit").read_text() for r in (0, 1)] == ["ran", "ran"]
