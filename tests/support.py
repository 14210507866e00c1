"""Test helpers importable from any test (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

DATA = Path(__file__).parent / "data"
CHAOS_PLUGIN = DATA / "chaos_plugin"
WORKLOADS = DATA / "workloads.py"


def run_cli(*args: str, cwd: Path, env_extra: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``tunekit ARGS`` as a user would, in a child process."""
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "tunekit", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def chaos_pythonpath() -> dict[str, str]:
    """Environment that puts the fault-injection plugin where entry-point discovery finds it."""
    path = os.pathsep.join([str(CHAOS_PLUGIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path}


def live_rank_pids(root: Path) -> list[int]:
    """Trial rank processes still running among those that wrote ``pids/rank*`` below ``root``."""
    alive = []
    for pid in {int(p.read_text()) for p in Path(root).glob("**/pids/rank*")}:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
