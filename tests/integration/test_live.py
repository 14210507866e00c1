"""Live jobs for real: `tunekit run` on 2 gloo ranks, driven through its control socket."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import WORKLOADS, chaos_pythonpath, run_cli, rundir, start_run, wait_step

from tunekit.config import TuningConfig
from tunekit.errors import ControlError
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, wait_for
from tunekit.testing import assert_states_close

pytestmark = pytest.mark.slow

BUCKETS = '{"plugins": {"overlap_chunking": {"bucket_cap_mb": 1}}}'
# A regression no load can hide: half a second more per step (light_cnn's take ~0.1 s).
SLOWER = '{"plugins": {"chaos": {"mode": "slow", "sleep_s": 0.5}}}'
LIGHT = f"{WORKLOADS}:light_cnn"  # leaves the CPU to what the tests run beside the job


def final_params(rd: RunDir) -> dict[str, torch.Tensor]:
    return RunDir.load_checkpoint(rd.latest_checkpoint())["session"]["model"]


def steps_of(rd: RunDir) -> list[int]:
    return [m["step"] for m in rd.read_metrics()]


@pytest.mark.equivalence
def test_math_preserving_apply_matches_an_uninterrupted_run(tmp_path):
    steps = 14  # the apply lands at step 4 or a little later: steps after it carry the claim
    # Both jobs at once: same seeds, same maths, whatever else shares the CPU. In
    # float64, so that a change of bucket layout (another summation order) is
    # bounded tightly on any CPU (tunekit.testing.EQUIVALENCE_RTOL).
    spec = f"{WORKLOADS}:cnn_float64"
    plain = start_run(tmp_path, spec, "--steps", str(steps), "--name", "plain")
    changed = start_run(tmp_path, spec, "--steps", str(steps), "--name", "changed")
    rd = rundir(tmp_path, "changed")
    wait_step(rd, 4)
    reply = client(rd).request("apply", config=json.loads(BUCKETS))
    assert 4 <= reply["step"] < steps
    assert changed.wait(timeout=300) == 0, changed.stdout.read()
    assert plain.wait(timeout=300) == 0, plain.stdout.read()

    assert steps_of(rd) == list(range(steps))  # no step lost or repeated
    assert len({m["config_id"] for m in rd.read_metrics()}) == 2
    a, b = final_params(RunDir.find("plain", tmp_path / ".tunekit")), final_params(rd)
    assert_states_close(b, a, "parameters after the apply")


def test_relaunch_changes_world_size_and_resumes_at_the_same_step(tmp_path):
    # paced_cnn (the demo CNN, batch 32): light_cnn's batch of 8 makes step-to-step loss too
    # noisy for the check below; its batches wait for data, so the job does not train flat out
    # beside other tests. --min-effect 1: the relaunches are watched, and neither may be rolled
    # back whatever it measures.
    proc = start_run(
        tmp_path, f"{WORKLOADS}:paced_cnn", "--name", "elastic", "--min-effect", "1"
    )  # until stopped
    rd = rundir(tmp_path, "elastic")
    wait_step(rd, 4)
    for n in (1, 2):
        res = run_cli("apply", "elastic", '{"plugins": {}}', "--nproc", str(n), cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert f"relaunching with {n} rank(s)" in res.stdout
        at = wait_for(rd, lambda s, n=n: s.get("status") == "running" and s.get("world_size") == n)[
            "step"
        ]
        wait_step(rd, at + 3)
    holder, _ = hold_pause(tmp_path, "elastic")  # a stop goes through a pause
    try:
        assert run_cli("stop", "elastic", cwd=tmp_path).returncode == 0
    finally:
        holder.kill()
    assert proc.wait(timeout=300) == 0, proc.stdout.read()
    metrics = rd.read_metrics()
    assert [m["step"] for m in metrics] == list(range(len(metrics)))  # nothing lost or repeated
    sizes = [m["world_size"] for m in metrics]
    changes = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]
    assert [sizes[0], *(sizes[i] for i in changes)] == [2, 1, 2]
    for i in changes:  # the loss curve continues across relaunches
        assert abs(metrics[i]["loss"] - metrics[i - 1]["loss"]) < 0.5
    relaunches = [e for e in rd.read_events() if e["kind"] == "relaunch"]
    assert [e["nproc"] for e in relaunches] == [1, 2]
    assert [e["step"] for e in relaunches] == [
        metrics[i]["step"] for i in changes
    ]  # resumed at the same step


HOLD = """
import sys, time
from pathlib import Path
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client
with client(RunDir.find(sys.argv[1], Path(sys.argv[2]))).paused("held by a child") as reply:
    print(reply["paused_at"], flush=True)
    time.sleep(600)
"""


def hold_pause(cwd: Path, run: str) -> tuple[subprocess.Popen, int]:
    """A separate process that pauses ``run`` and holds the pause until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, run, str(cwd / ".tunekit")],
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, int(proc.stdout.readline())


def test_a_crash_leaves_the_run_resumable(tmp_path):
    proc = start_run(
        tmp_path, LIGHT, "--steps", "24", "--name", "fragile", "--checkpoint-every", "5"
    )
    rd = rundir(tmp_path, "fragile")
    st = wait_step(rd, 8)  # past the checkpoint at step 5: steps after it are lost and redone
    os.kill(st["pid"], signal.SIGKILL)  # rank 0 dies mid-training
    assert proc.wait(timeout=300) == 1
    st = rd.read_status()
    assert st["status"] == "crashed"
    json.loads(rd.run_file.read_text())  # still readable
    resumed = start_run(tmp_path, "--resume", "fragile")
    assert resumed.wait(timeout=300) == 0, resumed.stdout.read()
    assert steps_of(rd) == list(range(24))
    assert rd.read_status()["status"] == "finished"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One job that trains until stopped, with the fault-injection plugin installed.

    Tests that must not have it running beside them come before the first that uses it.
    """
    cwd = tmp_path_factory.mktemp("live")
    env = chaos_pythonpath()
    proc = start_run(cwd, LIGHT, "--name", "job", "--watch-window", "6", env_extra=env)
    rd = rundir(cwd, "job")
    wait_step(rd, 3)
    yield cwd, rd, env
    run_cli("stop", "job", cwd=cwd, env_extra=env)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_regression_after_apply_is_rolled_back(live):
    cwd, rd, env = live
    res = run_cli("apply", "job", SLOWER, cwd=cwd, env_extra=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rolled back" in res.stdout and "slower beyond noise" in res.stdout
    st = wait_for(rd, lambda s: s["config"]["plugins"] == {})
    assert st["status"] == "running"
    assert any(e["kind"] == "rolled_back" and "slower" in e["reason"] for e in rd.read_events())


def test_a_failing_hook_is_rolled_back_with_its_reason(live):
    cwd, rd, env = live
    before = rd.read_status()["config"]
    with pytest.raises(ControlError, match="chaos: the runtime hook failed; rolled back"):
        client(rd).request("apply", config={"plugins": {"chaos": {"mode": "bad_hook"}}})
    assert rd.read_status()["config"] == before


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "must be a JSON object"),
        ({"op": "apply", "config": {"plugins": {}}}, "wrong or missing token"),
        ({"token": "0" * 64, "op": "status"}, "wrong or missing token"),
        ({"op": "reboot"}, "unknown op 'reboot'"),
        (
            {"op": "apply", "config": {"plugins": {"overlap_chunking": {"nope": 1}}}},
            "unknown knob 'nope'",
        ),
        (
            {"op": "apply", "config": {"plugins": {"overlap_chunking": {"bucket_cap_mb": -3}}}},
            "out of range",
        ),
        ({"op": "apply", "config": {"plugins": {"not_installed": {}}}}, "not installed"),
        ({"op": "apply", "config": "fast please"}, "config must be an object"),
        ({"op": "apply", "config": {"plugins": {}}, "nproc": 0}, "nproc must be an integer"),
    ],
)
def test_bad_requests_are_refused_and_the_job_keeps_training(live, message, error):
    _, rd, _ = live
    c = client(rd)
    if isinstance(message, dict) and "token" not in message and "wrong" not in error:
        message = {"token": rd.token(), **message}
    step = rd.read_status()["step"]
    reply = c.raw(message)
    assert reply["ok"] is False and error in reply["error"]
    assert "\n" not in reply["error"]
    wait_step(rd, step + 2)  # still training


def test_the_socket_and_token_are_private(live):
    _, rd, _ = live
    sock = Path(rd.read_run()["socket"])
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    assert oct(rd.token_file.stat().st_mode & 0o777) == "0o600"


def test_an_in_job_trial_reports_and_leaves_the_chosen_config(live):
    cwd, rd, env = live
    res = run_cli("trial", "job", BUCKETS, "--window", "4", cwd=cwd, env_extra=env)
    assert res.returncode == 0, res.stderr
    assert "candidate" in res.stdout and "kept the" in res.stdout
    finished = [e for e in rd.read_events() if e["kind"] == "trial_finished"][-1]
    assert finished["candidate_samples_per_s"] > 0 and finished["current_samples_per_s"] > 0
    expected = {"overlap_chunking"} if finished["kept"] == "candidate" else set()
    assert set(rd.read_status()["config"]["plugins"]) == expected


def test_a_config_copied_from_plan_applies_to_the_live_job(live):
    """Issue 19: what `tunekit plan` prints is what `tunekit apply` takes, as it is."""
    cwd, rd, env = live
    # Every candidate comes apply-ready, fastest predicted (per sample) first.
    res = run_cli("plan", "batch_ps_sizing", LIGHT, "--json", cwd=cwd, env_extra=env)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    rates = [c["predicted_samples_per_s"] for c in plan["candidates"]]
    assert rates and rates == sorted(rates, reverse=True)
    first = plan["candidates"][0]
    assert first["apply"].startswith("tunekit apply RUN batch_ps_sizing.")

    # A long config is written to a file and named by its path; nothing is cut.
    res = run_cli("plan", "layer_split", LIGHT, cwd=cwd, env_extra=env)
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout
    assert "tunekit apply RUN tunekit-out/plan/layer_split-1.json" in res.stdout
    TuningConfig.load(cwd / "tunekit-out" / "plan" / "layer_split-1.json")

    # The batch range is the run's, checked before anything is sent.
    bad = run_cli("apply", "job", "batch_ps_sizing.batch_size=100000", cwd=cwd, env_extra=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert any("outside run job's batch range (2–64" in ln for ln in bad.stderr.splitlines())

    args = shlex.split(first["apply"])[3:]
    res = run_cli("apply", "job", *args, cwd=cwd, env_extra=env)
    # kept, or rolled back by the watch: applied either way
    assert res.returncode in (0, 1), res.stderr
    assert "applied at step" in res.stdout
    assert rd.read_events()[-1]["kind"] in ("applied", "watch_kept", "rolled_back")
    applied = next(e for e in reversed(rd.read_events()) if e["kind"] == "applied")
    assert (
        TuningConfig.from_dict(applied["config"]).plugins["batch_ps_sizing"]["batch_size"]
        == (TuningConfig.from_pairs(args).plugins["batch_ps_sizing"]["batch_size"])
    )

    status = run_cli("status", "job", cwd=cwd, env_extra=env)
    assert status.returncode == 0, status.stderr
    assert "samples/s (median of the last" in status.stdout
    assert "per rank (allowed 2–64)" in status.stdout


def test_auto_applies_its_winner_to_the_live_job(live):
    cwd, rd, env = live
    res = run_cli(
        "auto",
        LIGHT,
        "--plugins",
        "overlap_chunking",
        "--trials",
        "1",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--no-probe",
        # The claim is the apply (and the pause around the trials), not how sure the decision
        # is: no paired rounds after the confirmation.
        "--measure-rounds",
        "0",
        "--apply",
        "job",
        "--json",
        cwd=cwd,
        env_extra=env,
    )
    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    decision = next(e for e in events if e["event"] == "Decided")["decision"]
    applied = next(e for e in events if e["event"] == "Applied")
    running = rd.read_status()["config"]["plugins"]
    # The job was held while the trials measured the machine, and went on after.
    notices = [e["message"] for e in events if e["event"] == "Notice"]
    assert (
        any(n.startswith("run job paused at step") for n in notices)
        and "run job resumed" in notices
    )
    paused, resumed = [e for e in rd.read_events() if e["kind"] in ("paused", "resumed")][-2:]
    assert (paused["kind"], resumed["kind"]) == ("paused", "resumed") and paused["step"] == resumed[
        "step"
    ]
    if decision["winner"] == "baseline":
        assert applied["applied"] is False and "the baseline stays" in applied["message"]
    else:
        assert "applied at step" in applied["message"]
        if not applied.get("rolled_back"):
            assert running == decision["winner_config"]["plugins"]


def test_a_pause_holds_every_rank_until_its_holder_lets_go(live):
    cwd, rd, env = live
    c = client(rd)
    with c.paused("a test") as reply:
        at = reply["paused_at"]
        status = c.request("status")
        assert status["status"] == "paused" and status["paused"] == {"step": at, "reason": "a test"}
        time.sleep(1.0)  # about 8 steps of this job
        assert c.request("status")["step"] == at
        with pytest.raises(ControlError, match=r"the job is paused \(a test\); apply is refused"):
            c.request("apply", config={"plugins": {}})
        with pytest.raises(ControlError, match="pause is refused"), c.paused("a second holder"):
            pass
    assert wait_step(rd, at + 2)["paused"] is None
    kinds = [e["kind"] for e in rd.read_events()]
    assert kinds[-2:] == ["paused", "resumed"]

    # A holder that dies without a word (kill -9) lets go too: the pause lives on its connection.
    holder, at = hold_pause(cwd, "job")
    time.sleep(0.5)
    assert c.request("status")["step"] == at
    holder.kill()
    holder.wait()
    wait_step(rd, at + 2)


def test_subscribe_streams_metrics(live):
    _, rd, _ = live
    stream = client(rd).subscribe()
    first, second = next(stream), next(stream)
    assert second["step"] == first["step"] + 1 and second["loss"] > 0


# The tests below relaunch the job: they come last.


def test_a_relaunch_apply_is_watched_and_a_slower_one_rolled_back(live):
    cwd, rd, env = live
    before = rd.read_status()
    res = run_cli(
        "apply",
        "job",
        SLOWER,
        "--nproc",
        "1",
        cwd=cwd,
        env_extra=env,
        timeout=400,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "relaunching with 1 rank(s)" in res.stdout and "rolled back" in res.stdout
    assert "slower beyond noise" in res.stdout
    st = wait_for(
        rd, lambda s: s.get("status") == "running" and s.get("world_size") == before["world_size"]
    )
    assert st["config"]["plugins"] == before["config"]["plugins"]
    relaunches = [e for e in rd.read_events() if e["kind"] == "relaunch"][-2:]
    assert [(e["nproc"], e["source"]) for e in relaunches] == [
        (1, "user"),
        (before["world_size"], "watch"),
    ]


def test_a_relaunch_apply_can_be_rolled_back_by_hand(live):
    cwd, rd, env = live
    world = rd.read_status()["world_size"]
    # A watch too long to reach a verdict during the test: the rollback is the user's.
    res = run_cli(
        "apply",
        "job",
        "{}",
        "--nproc",
        "1",
        "--watch",
        "10000",
        "--no-wait",
        cwd=cwd,
        env_extra=env,
    )
    assert res.returncode == 0, res.stderr
    st = wait_step_on(rd, 1)
    assert st["watch"]["state"] == "watching" and st["watch"]["prev_nproc"] == world
    res = run_cli("rollback", "job", cwd=cwd, env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"relaunching with {world} rank(s)" in res.stdout
    st = wait_step_on(rd, world)
    assert st["watch"]["state"] == "rolled_back"


def wait_step_on(rd: RunDir, world: int) -> dict:
    at = wait_for(rd, lambda s: s.get("status") == "running" and s.get("world_size") == world)[
        "step"
    ]
    return wait_step(rd, at + 2)


def test_apply_reports_a_crash_under_the_new_config_at_once(live):
    cwd, rd, env = live
    before = rd.read_status()["config"]
    # Well within the 300 s apply once waited before giving up with an unrelated error.
    res = run_cli(
        "apply",
        "job",
        '{"plugins": {"chaos": {"mode": "raise"}}}',
        cwd=cwd,
        env_extra=env,
        timeout=250,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rolled back" in res.stdout and "the job crashed under the new config" in res.stdout
    assert "chaos: injected failure" in res.stdout
    st = wait_step(rd, rd.read_status().get("step", 0) + 2)
    assert st["config"] == before and st["watch"]["state"] == "rolled_back"
