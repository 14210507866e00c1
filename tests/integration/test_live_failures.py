"""A live job never loses or mixes a step, whatever is killed or made read-only (issue 18, items 6-8)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import WORKLOADS, limited, live_rank_pids, run_cli

from tunekit.errors import ControlError
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import wait_for

pytestmark = pytest.mark.slow

LIGHT = f"{WORKLOADS}:light_cnn"


def start(cwd: Path, *args: str, obey_file_modes: bool = False) -> subprocess.Popen:
    """``tunekit run ARGS`` in ``cwd``; its output goes to a file (read it with :func:`output`):
    a pipe nobody reads while the job trains fills up and blocks the supervisor."""
    cmd = [sys.executable, "-m", "tunekit", "run", *args]
    if obey_file_modes:
        cmd = limited(cmd, obey_file_modes=True)
    log = cwd / f"supervisor-{time.monotonic_ns()}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log
    return proc


def output(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()


def find(cwd: Path, name: str) -> RunDir:
    deadline = time.monotonic() + 60
    while True:
        try:
            return RunDir.find(name, cwd / ".tunekit")
        except ControlError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def running_at(rd: RunDir, step: int, world: int | None = None, timeout: float = 180) -> dict:
    return wait_for(
        rd,
        lambda s: (
            s.get("status") == "running"
            and s.get("step", 0) >= step
            and (world is None or s.get("world_size") == world)
        ),
        timeout,
    )


def contiguous(rd: RunDir) -> list[int]:
    steps = [m["step"] for m in rd.read_metrics()]
    assert steps == list(range(len(steps))), "a step was lost, repeated or interleaved"
    return steps


def kill_whole(sup: subprocess.Popen) -> None:
    """SIGKILL a supervisor and everything under it at once (its agents' server, the agent,
    the ranks): by design a job's agent and ranks outlive a supervisor killed alone."""
    job = [sup.pid]
    with contextlib.suppress(psutil.Error):
        job += [p.pid for p in psutil.Process(sup.pid).children(recursive=True)]
    for pid in job:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    sup.wait()


@contextlib.contextmanager
def reaped(*procs: subprocess.Popen):
    """Each supervisor still running at the end is killed with its job: a failed test must
    not leave it training beside the rest of the suite."""
    try:
        yield
    finally:
        for p in procs:
            if p.poll() is None:
                kill_whole(p)


def test_a_resume_is_refused_while_the_killed_supervisors_job_trains_on(tmp_path):
    sup = start(tmp_path, LIGHT, "--name", "orphan", "--checkpoint-every", "5")
    with reaped(sup):
        rd = find(tmp_path, "orphan")
        running_at(rd, 6)  # a checkpoint to resume from exists
        sup.send_signal(signal.SIGKILL)  # the supervisor dies; its torchrun and ranks do not
        sup.wait()
        step = running_at(rd, 3)["step"]
        second = start(tmp_path, "--resume", "orphan")
        with reaped(second):
            assert second.wait(timeout=120) == 2
            out = output(second)
        assert (
            "is still training" in out and "tunekit stop orphan" in out and "Traceback" not in out
        )
        running_at(rd, step + 3)  # the orphan was left alone
        res = run_cli("stop", "orphan", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        stopped_at = int(res.stdout.split()[-1])
        wait_for(rd, lambda s: s.get("status") == "stopped")
        assert contiguous(rd)[-1] == stopped_at - 1
        # Once it has stopped, the run resumes where it stopped.
        third = start(tmp_path, "--resume", "orphan")
        with reaped(third):
            running_at(rd, stopped_at + 2)
            # SIGTERM (what `timeout` and SLURM send first) stops it as Ctrl-C does: checkpoint,
            # stop, say how to resume; nothing left training (issue 34, item 8).
            third.send_signal(signal.SIGTERM)
            assert third.wait(timeout=120) == 143, output(third)
        out = output(third)
        assert "interrupted by SIGTERM; the run checkpointed and stopped" in out, out
        assert "`tunekit run --resume orphan`" in out and "Traceback" not in out
        st = rd.read_status()
        assert st["status"] == "stopped"
        assert rd.latest_checkpoint().name == f"step-{st['step']:08d}.pt"
        assert not live_rank_pids(rd.path)
        contiguous(rd)


def test_a_leftover_relaunch_plan_never_rewinds_a_resumed_run(tmp_path):
    # --checkpoint-every 2: the plan's checkpoint is soon rotated away, as in a long run.
    sup = start(tmp_path, LIGHT, "--name", "rewind", "--checkpoint-every", "2")
    with reaped(sup):
        rd = find(tmp_path, "rewind")
        running_at(rd, 4)
        sup.send_signal(signal.SIGSTOP)  # the supervisor will not act on the relaunch ...
        # A watch too long to reach a verdict in the test: 1 rank is slower per sample than 2,
        # and a shorter watch rolled the resumed job back to 2 ranks (one more relaunch) about
        # when the stop below was sent, which then met a job on its way out.
        res = run_cli(
            "apply", "rewind", "{}", "--nproc", "1", "--watch", "10000", "--no-wait", cwd=tmp_path
        )
        assert res.returncode == 0 and "relaunching with 1 rank(s)" in res.stdout, (
            res.stdout + res.stderr
        )
        wait_for(rd, lambda s: s.get("status") == "relaunching")
        sup.send_signal(signal.SIGKILL)  # ... because it is killed first
        sup.wait()
    assert rd.relaunch_file.exists()
    resumed = start(tmp_path, "--resume", "rewind")
    with reaped(resumed):
        at = running_at(rd, 0)["step"]
        running_at(rd, at + 6, world=1)
        res = run_cli("stop", "rewind", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert resumed.wait(timeout=120) == 0, output(
            resumed
        )  # stopped, not relaunched from the plan
    stopped_at = int(res.stdout.split()[-1])
    st = rd.read_status()
    assert st["status"] == "stopped" and st["step"] == stopped_at
    assert contiguous(rd)[-1] == stopped_at - 1  # nothing cut back
    events = rd.read_events()
    kinds = [e["kind"] for e in events]
    assert "crashed" not in kinds and kinds[-1] == "stopped"
    # The relaunch asked for before the kill was carried out on resume, and watched (item 9).
    resumed_at = next(e for e in events if e["kind"] == "started" and e.get("resumed"))
    assert resumed_at["world_size"] == 1
    assert st["world_size"] == 1 and st["watch"]["state"] == "watching"


def test_an_unwritable_checkpoint_folder_refuses_the_apply_and_a_read_only_run_folder_stops_cleanly(
    tmp_path,
):
    sup = start(tmp_path, LIGHT, "--name", "ro", "--checkpoint-every", "5", obey_file_modes=True)
    with reaped(sup):
        rd = find(tmp_path, "ro")
        running_at(rd, 6)
        good = rd.latest_checkpoint()
        rd.checkpoints.chmod(0o500)
        try:
            res = run_cli(
                "apply",
                "ro",
                '{"plugins": {"overlap_chunking": {"bucket_cap_mb": 1}}}',
                cwd=tmp_path,
            )
            assert res.returncode == 2, res.stdout + res.stderr
            assert "cannot write checkpoint" in res.stderr and "apply was refused" in res.stderr
            st = running_at(
                rd, rd.read_status()["step"] + 6
            )  # past a periodic checkpoint, which fails too
            assert st["config"]["plugins"] == {} and st["warnings"]
        finally:
            rd.checkpoints.chmod(0o700)
        assert good.exists()
        rd.path.chmod(0o500)  # the whole run folder read-only: files are rewritten in place
        try:
            step = rd.read_status()["step"]
            running_at(rd, step + 3)
            res = run_cli("stop", "ro", cwd=tmp_path)
            assert res.returncode == 0, res.stdout + res.stderr
            assert sup.wait(timeout=120) == 0
        finally:
            rd.path.chmod(0o700)
        out = output(sup)
    assert "Traceback" not in out and "ro stopped at step" in out, out
    stopped_at = int(res.stdout.split()[-1])
    assert rd.read_status()["status"] == "stopped"
    assert rd.latest_checkpoint().name == f"step-{stopped_at:08d}.pt"
    assert contiguous(rd)[-1] == stopped_at - 1


def test_status_says_a_job_killed_whole_died_without_a_word(tmp_path):
    """Issue 34, item 6: the whole job SIGKILLed (or dead on a full disk) leaves status.json
    saying "running"; `tunekit status` checks that something of the job lives."""
    sup = start(tmp_path, f"{WORKLOADS}:tiny", "--nproc", "1", "--name", "gone")
    with reaped(sup):
        rd = find(tmp_path, "gone")
        seen = running_at(rd, 3)["step"]
        kill_whole(sup)  # at once: nobody is left to say a word
    deadline = time.monotonic() + 30
    while live_rank_pids(rd.path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rd.read_status()["status"] == "running"  # what the job last wrote
    res = run_cli("status", "gone", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    said = res.stdout.strip()
    assert said.startswith("run gone: not running (last seen at step "), said
    assert "died without a word" in said and "tunekit run --resume gone" in said
    assert int(said.split("last seen at step ")[1].split(",")[0]) >= seen
    as_json = run_cli("status", "gone", "--json", cwd=tmp_path)
    assert as_json.returncode == 1 and '"status": "died"' in as_json.stdout


def _can_mount_a_tmpfs() -> bool:
    """Whether a private mount namespace with a tmpfs can be made here (no privilege needed
    where user namespaces are allowed)."""
    try:
        return (
            subprocess.run(
                ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]
                + ['d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs "$d"'],
                capture_output=True,
                timeout=30,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(
    not _can_mount_a_tmpfs(),
    reason="no user and mount namespaces for a tmpfs here; tests/unit/test_full_disk.py "
    "injects ENOSPC at the writers instead",
)
def test_a_full_disk_degrades_status_and_metrics_and_the_job_trains_on(tmp_path):
    """Issue 34, item 5: the run folder on a 20 MiB tmpfs that fills up while the job trains
    (tests/full_disk_job.py says what must hold)."""
    import psutil

    tests = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        res = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", sys.executable]
            + [str(tests / "full_disk_job.py"), str(tmp_path / "disk"), f"{WORKLOADS}:paced_tiny"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        for proc in psutil.process_iter(["cmdline"]):  # the job, were the driver to fail
            if str(tmp_path) in " ".join(proc.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
    log = (tmp_path / "supervisor.log").read_text()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + log[-3000:]
    assert "Traceback" not in log and "full stopped at step" in log, log
