"""Test helpers importable from any test (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
