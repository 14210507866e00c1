"""The live job as a ``tunekit run`` child process, started and stopped by another program (the TUI).

A separate process, not a thread of its starter: the job's supervisor and its
torchrun ranks must outlive anything that goes wrong there (a crash leaves the
job running, to be attached to again), and the supervisor's own signal
handling (Ctrl+C checkpoints and stops the ranks) keeps working. Stopping asks
the job to checkpoint and stop over the control socket, and escalates to
signals only if it will not.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from tunekit.errors import ControlError, TunekitError
from tunekit.observe.telemetry import read_pid_dir
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, last_error


class JobProcess:
    """A ``tunekit run`` child process (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen, rd: RunDir, log_path: Path):
        self.proc = proc
        self.rd = rd
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        workload: str,
        *,
        nproc: int,
        store_dir: Path,
        watch_window: int = 10,
        min_effect: float = 0.02,
        device: str = "auto",
        name: str | None = None,
        timeout_s: float = 120.0,
        memory_cap_bytes: int | None = None,
    ) -> JobProcess:
        """Start the job and return once its run directory exists; a bad workload raises one line."""
        from tunekit.workload import load_workload, resolve_spec

        spec = resolve_spec(workload)
        load_workload(spec)  # fail here, in one clear line, not in a child's log
        run_id = name or time.strftime("tui-%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        logs = Path(store_dir) / "tui"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{run_id}.log"
        cmd = [
            sys.executable,
            "-m",
            "tunekit",
            "run",
            spec,
            "--nproc",
            str(nproc),
            "--name",
            run_id,
            "--store",
            str(store_dir),
            "--watch-window",
            str(watch_window),
            "--min-effect",
            str(min_effect),
            "--device",
            device,
        ]
        if memory_cap_bytes is not None:
            cmd += ["--memory-cap", str(memory_cap_bytes)]
        with open(log_path, "ab") as log:
            # A session of its own: the terminal's Ctrl+C (Textual's to handle) never reaches it.
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise TunekitError(
                    f"tunekit run exited ({proc.returncode}): {last_error(log_path)}"
                )
            try:
                return cls(proc, RunDir.find(run_id, store_dir), log_path)
            except ControlError:
                if time.monotonic() > deadline:
                    cls(proc, RunDir(Path(store_dir) / "runs" / run_id), log_path).stop(wait_s=5)
                    raise TunekitError(
                        f"tunekit run did not create its run directory in {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.1)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def stop(self, wait_s: float = 60.0) -> int | None:
        """Checkpoint and stop the job; signals only if it will not stop. Returns the exit code."""
        deadline = time.monotonic() + wait_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:  # the socket appears once the ranks are up: keep asking until then
                client(self.rd, timeout_s=max(1.0, deadline - time.monotonic())).request("stop")
                break
            except (ControlError, OSError):
                time.sleep(0.5)
        try:
            return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # The supervisor turns SIGINT into "checkpoint and stop the ranks".
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.wait(timeout=10)

    def kill(self) -> None:
        """Last resort: kill the ranks' process group (the torchrun agent's) and the supervisor."""
        for pid in read_pid_dir(self.rd.path / "pids").values():
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
        if self.proc.poll() is None:
            self.proc.kill()
