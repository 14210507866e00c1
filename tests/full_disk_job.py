"""A live job whose run folder is on a small tmpfs that fills up (issue 34, item 5).

Run by tests/integration/test_live_failures.py inside a private mount namespace
(``unshare --user --map-root-user --mount``), where mounting a tmpfs needs no privilege and
nobody else sees it::

    python tests/full_disk_job.py DISK WORKLOAD

It mounts a 20 MiB tmpfs at DISK, starts ``tunekit run`` there, fills the disk while the job
trains, frees it, stops the job, and exits 0 when every guarantee held (an AssertionError
saying which did not otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support import run_cli

from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, wait_for


def live_status(rd: RunDir) -> dict:
    """What rank 0 says over its socket (status.json may be a step behind on a full disk)."""
    return client(rd, timeout_s=30).request("status")


def until(what, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := what():
            return result
        time.sleep(0.3)
    raise AssertionError(f"gave up waiting for {what.__doc__}")


def main(disk: Path, workload: str) -> None:
    disk.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)], check=True)
    log = disk.parent / "supervisor.log"  # off the full disk, for the test to read
    with log.open("w") as sink:
        sup = subprocess.Popen(
            [sys.executable, "-m", "tunekit", "run", workload, "--nproc", "1", "--name", "full"]
            + ["--checkpoint-every", "3"],
            cwd=disk,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        rd = RunDir(disk / ".tunekit" / "runs" / "full")
        until(lambda: rd.run_file.exists())
        wait_for(rd, lambda s: s.get("status") == "running" and s.get("step", 0) >= 4, 300)
        good = rd.latest_checkpoint()
        assert good is not None

        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        for chunk in (1 << 20, 1 << 12, 1):  # the disk fills up, to the last page
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * chunk):
                    pass
        os.close(fd)
        full_at = live_status(rd)["step"]

        def trained_on_with_warnings() -> dict | None:
            """steps past two failed checkpoints, each write that failed said in a warning"""
            st = live_status(rd)
            said = " ".join(st.get("warnings") or [])
            every = all(w in said for w in ("status.json", "metrics.jsonl", "checkpoint"))
            return st if st["step"] >= full_at + 6 and every else None

        st = until(trained_on_with_warnings)
        assert "No space left on device" in " ".join(st["warnings"]), st["warnings"]
        assert sup.poll() is None, "the supervisor died on a full disk"
        assert not list(rd.path.rglob("*.tmp")), list(rd.path.rglob("*.tmp"))
        assert json.loads(rd.status_file.read_text())["status"] == "running"  # last good, whole
        assert good.exists()
        res = run_cli("status", "full", cwd=disk)
        assert res.returncode == 0 and "running" in res.stdout, res.stdout + res.stderr

        (disk / "filler").unlink()  # room again: everything is written again

        def written_again() -> bool:
            """status.json written again, warnings gone"""
            return rd.read_status().get("step", 0) > st["step"] and not live_status(rd).get(
                "warnings"
            )

        until(written_again)
        res = run_cli("stop", "full", cwd=disk)
        assert res.returncode == 0, res.stdout + res.stderr
        assert sup.wait(timeout=120) == 0
        stopped_at = int(res.stdout.split()[-1])
        assert rd.read_status()["status"] == "stopped"
        assert rd.latest_checkpoint().name == f"step-{stopped_at:08d}.pt"
        steps = [m["step"] for m in rd.read_metrics()]  # every line reads: none was cut
        assert steps == sorted(steps) and steps[-1] == stopped_at - 1, steps
        assert sum(1 for _ in rd.metrics_file.open()) == len(steps)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        subprocess.run(["umount", "-l", str(disk)], check=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
