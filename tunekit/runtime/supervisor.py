"""``tunekit run``'s own process: starts the job's torchrun and keeps it going.

The supervisor relaunches the job when a change needs new processes (world
size, placement: rank 0 leaves ``relaunch.json`` and a checkpoint), rolls back
by relaunching from the pre-apply checkpoint when the job crashes while an
applied config is still being watched, and marks the run ``crashed``
otherwise, leaving everything needed for ``tunekit run --resume``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunekit.config import TuningConfig, resolve
from tunekit.errors import ControlError, TunekitError
from tunekit.plugin_loading import available_tuners
from tunekit.runtime.control import ControlClient
from tunekit.runtime.rundir import RunDir

# The launcher and workloads (and so torch) are imported where a job starts:
# `tunekit status|apply|stop|...` only talk to the job's socket.


def create_run(
    store_dir: Path,
    workload: str,
    *,
    nproc: int,
    config: TuningConfig | None = None,
    steps: int | None = None,
    seed: int = 0,
    checkpoint_every: int = 50,
    watch_window: int = 10,
    min_effect: float = 0.02,
    device: str = "auto",
    name: str | None = None,
) -> RunDir:
    """Check the inputs here, in one clear line each, then create the run directory."""
    from tunekit.workload import load_workload, resolve_spec

    spec = resolve_spec(workload)
    load_workload(spec)
    config = config or TuningConfig()
    resolve(config, available_tuners())
    return RunDir.create(store_dir, {
        "workload": spec, "nproc": nproc, "config": config.to_dict(), "steps": steps, "seed": seed,
        "checkpoint_every": checkpoint_every, "watch_window": watch_window, "min_effect": min_effect,
        "device": device, "resume": None,
    }, name=name)


def prepare_resume(rd: RunDir) -> Path:
    """Point the run at its newest checkpoint; its config comes from the checkpoint."""
    ckpt = rd.latest_checkpoint()
    if ckpt is None:
        raise TunekitError(f"run {rd.run_id} has no checkpoint to resume from")
    rd.update_run(resume=str(ckpt), config=None)
    rd.log_event("resume_requested", checkpoint=str(ckpt))
    return ckpt


def client(rd: RunDir, timeout_s: float = 600.0) -> ControlClient:
    socket = rd.read_run().get("socket") or str(rd.socket_path)
    return ControlClient(Path(socket), rd.token(), timeout_s)


def supervise(rd: RunDir, on_tick: Callable[[RunDir], None] | None = None, poll_s: float = 0.5) -> int:
    """Run the job to its end; 0 when it finished or stopped, 1 when it crashed."""
    from tunekit.trials.launcher import LaunchOptions, agent_commands, launch_env

    rolled_back_after_crash = False
    launches = 0
    while True:
        spec = rd.read_run()
        opts = LaunchOptions(nproc=int(spec["nproc"]))
        (cmd,) = agent_commands(rd.path, opts, module="tunekit.runtime.live")
        log_path = rd.logs / f"agent-{launches}.log"
        launches += 1
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=launch_env(opts),
                                    start_new_session=True)
            try:
                while proc.poll() is None:
                    if on_tick is not None:
                        on_tick(rd)
                    time.sleep(poll_s)
            except KeyboardInterrupt:
                stop_gracefully(rd, proc)
                raise
        if on_tick is not None:
            on_tick(rd)
        if rd.relaunch_file.exists():
            plan = json.loads(rd.relaunch_file.read_text())
            rd.relaunch_file.unlink()
            rd.update_run(nproc=plan["nproc"], config=plan["config"], resume=plan["checkpoint"])
            continue
        if proc.returncode == 0:
            return 0
        status = rd.read_status()
        error = last_error(log_path)
        watch = status.get("watch") or {}
        if watch.get("state") == "watching" and watch.get("checkpoint") and not rolled_back_after_crash:
            # The change under watch broke the job: go back to before it.
            rd.log_event("rolled_back_after_crash", step=watch.get("applied_at"), error=error,
                         config=watch.get("prev_config"))
            rd.update_run(config=watch.get("prev_config"), resume=watch["checkpoint"])
            rolled_back_after_crash = True
            continue
        rd.write_status({**status, "status": "crashed", "error": error})
        rd.log_event("crashed", step=status.get("step"), error=error)
        return 1


def stop_gracefully(rd: RunDir, proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    """Ask the job to checkpoint and stop; kill its process group if it will not."""
    try:
        client(rd, timeout_s=wait_s).request("stop")
    except (ControlError, OSError):
        pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def last_error(log_path: Path) -> str:
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except FileNotFoundError:
        return "no log"
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "exited without output"


def wait_for(rd: RunDir, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 300.0,
             poll_s: float = 0.25) -> dict[str, Any]:
    """Poll status.json until ``predicate(status)``; raise ControlError on timeout or crash."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = rd.read_status()
        if predicate(status):
            return status
        if status.get("status") == "crashed":
            raise ControlError(f"the job crashed: {status.get('error', '')}")
        time.sleep(poll_s)
    raise ControlError(f"gave up waiting for the job after {timeout_s:.0f} s")
