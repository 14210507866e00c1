"""Requests that meet a live job on its way to a relaunch (a new world size): a stop stops the run,
the others say the job is relaunching and to try again; nothing the run had is lost."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import DATA, live_rank_pids, run_cli

from tunekit.errors import ControlError
from tunekit.runtime.control import TRY_AGAIN
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, prepare_resume, wait_for

pytestmark = pytest.mark.slow

GATED = f"{DATA / 'gated_workloads.py'}:gated_cnn"


def tunekit(cwd: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """``tunekit ARGS`` in the background, its output to a file (see :func:`said`)."""
    log = cwd / f"tunekit-{args[0]}-{time.monotonic_ns()}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tunekit", *args],
            cwd=cwd,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    proc.log_path = log
    return proc


def said(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    code = proc.wait(timeout=timeout)
    return code, proc.log_path.read_text()


def until(what: str, check, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)
    return value


def queued(rd: RunDir) -> int:
    return client(rd, timeout_s=30).request("status")["queued"]


def test_a_stop_queued_behind_a_relaunch_stops_the_run_and_other_requests_say_try_again(
    tmp_path,
):
    gate = tmp_path / "gate"
    env = {**os.environ, "TUNEKIT_TEST_GATE": str(gate)}
    sup = tunekit(tmp_path, env, "run", GATED, "--name", "hop", "--checkpoint-every", "0")
    clients: list[subprocess.Popen] = []
    try:
        rd = until("the run folder", lambda: _found(tmp_path, "hop"))
        wait_for(rd, lambda s: s.get("status") == "running" and s.get("step", 0) >= 3, 180)
        # Hold the ranks before their next step, then queue, in this order: a relaunch to one
        # rank, a trial and a stop. The relaunch is carried out at the boundary; the job exits
        # with the other two still queued.
        gate.touch()
        # Held: a rank past the gate's check when it appeared finishes that step first.
        until("both ranks held", lambda: len(list(tmp_path.glob("gate.held-rank*"))) == 2)
        clients.append(tunekit(tmp_path, env, "apply", "hop", "{}", "--nproc", "1", "--no-wait"))
        until("the apply to queue", lambda: queued(rd) == 1)
        clients.append(tunekit(tmp_path, env, "trial", "hop", "{}", "--window", "2"))
        until("the trial to queue", lambda: queued(rd) == 2)
        clients.append(tunekit(tmp_path, env, "stop", "hop"))
        until("the stop to queue", lambda: queued(rd) == 3)
        apply_, trial, stop = clients
        sup.send_signal(signal.SIGSTOP)  # the supervisor will relaunch only when let go
        gate.unlink()

        code, out = said(apply_)
        assert code == 0 and "relaunching with 1 rank(s)" in out, out
        relaunch_step = wait_for(rd, lambda s: s.get("status") == "relaunching")["step"]
        code, out = said(trial)
        assert code == TRY_AGAIN, out
        assert out.strip() == "error: the job is relaunching (to 1 rank(s)); try again in a moment"
        # The queued stop is handed to the supervisor, which has not relaunched yet.
        until("the stop request", rd.stop_request_file.exists)
        assert stop.poll() is None

        # In the gap between the launches (the old job is gone, no new one serves):
        until("the old job to exit", lambda: not rd.socket_file().exists())
        res = run_cli("rollback", "hop", cwd=tmp_path, env_extra=env)
        assert res.returncode == TRY_AGAIN, res.stdout + res.stderr
        assert "the job is relaunching (to 1 rank(s)); try again in a moment" in res.stderr
        assert "Traceback" not in res.stderr and "not running" not in res.stderr
        res = run_cli("status", "hop", cwd=tmp_path, env_extra=env)
        assert res.returncode == 0, res.stderr
        assert f"relaunching at step {relaunch_step} on 2 rank(s), to 1 rank(s)" in res.stdout

        sup.send_signal(signal.SIGCONT)
        code, out = said(stop)
        assert code == 0, out
        assert f"stopped at step {relaunch_step} instead of relaunching with 1 rank(s)" in out
        assert "`tunekit run --resume hop` relaunches it" in out
        code, out = said(sup)
        assert code == 0, out
        assert f"run hop stopped at step {relaunch_step} before its relaunch with 1 rank(s)" in out
    finally:
        for p in (*clients, sup):
            if p.poll() is None:
                p.kill()
                p.wait()
        for pid in live_rank_pids(tmp_path):  # a failed test leaves no job training
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)

    assert not live_rank_pids(rd.path)
    st = rd.read_status()
    assert st["status"] == "stopped" and st["step"] == relaunch_step
    events = rd.read_events()
    assert events[-1]["kind"] == "stopped" and events[-1]["pending_relaunch"] == 1
    assert "crashed" not in [e["kind"] for e in events]
    assert not rd.stop_request_file.exists()
    # Nothing is lost: the relaunch's checkpoint is the newest, and its plan stays for
    # `tunekit run --resume`, which carries it out (one rank, from that checkpoint).
    ckpt = rd.latest_checkpoint()
    assert ckpt.name == f"step-{relaunch_step:08d}.pt"
    steps = [m["step"] for m in rd.read_metrics()]
    assert steps == list(range(relaunch_step))
    assert prepare_resume(rd) == ckpt
    spec = rd.read_run()
    assert spec["nproc"] == 1 and spec["resume"] == str(ckpt)
    assert spec["watch"]["state"] == "watching" and spec["watch"]["prev_nproc"] == 2


def _found(cwd: Path, name: str) -> RunDir | None:
    try:
        return RunDir.find(name, cwd / ".tunekit")
    except ControlError:
        return None
