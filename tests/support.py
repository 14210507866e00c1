"""Test helpers importable from any test (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import tomllib

from tunekit.errors import ControlError
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import wait_for

DATA = Path(__file__).parent / "data"
CHAOS_PLUGIN = DATA / "chaos_plugin"
RAISER_PLUGIN = DATA / "raiser_plugin"
WORKLOADS = DATA / "workloads.py"


def run_cli(
    *args: str, cwd: Path, env_extra: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``tunekit ARGS`` as a user would, in a child process."""
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "tunekit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_run(cwd: Path, *args: str, env_extra: dict | None = None) -> subprocess.Popen:
    """``tunekit run ARGS`` in ``cwd``, in the background (its output in ``.stdout``)."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "tunekit", "run", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def rundir(cwd: Path, name: str, timeout: float = 60) -> RunDir:
    """The run folder of live job ``name`` started in ``cwd``, once it exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return RunDir.find(name, cwd / ".tunekit")
        except ControlError:
            time.sleep(0.2)
    raise TimeoutError(name)


def wait_step(rd: RunDir, step: int, timeout: float = 180) -> dict:
    """The job's status once it runs at ``step`` or later."""
    return wait_for(
        rd, lambda s: s.get("status") == "running" and s.get("step", 0) >= step, timeout
    )


def chaos_pythonpath(*also: Path) -> dict[str, str]:
    """Environment that puts the fault-injection plugin (and the plugin folders ``also``, e.g.
    :data:`RAISER_PLUGIN`) where entry-point discovery finds it."""
    folders = [str(f) for f in (*also, CHAOS_PLUGIN)]
    path = os.pathsep.join([*folders, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
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


# -- rank functions for run_ranks (importable by name in spawned ranks) -----------------------


def rank_pid(rank: int, world: int) -> int:
    return os.getpid()


def rank_surroundings(rank: int, world: int) -> tuple[int, str, str | None, list[str]]:
    """Who started the rank, and the working folder, environment and sys.path it runs in."""
    return os.getppid(), os.getcwd(), os.environ.get("TUNEKIT_PROBE"), sys.path


def rank_state_then_spoil(rank: int, world: int) -> tuple[float, int, bool]:
    """What a call starts with; then leaves the process changed for the next call."""
    import torch

    start = (torch.rand(1).item(), torch.get_num_threads(), torch.is_grad_enabled())
    torch.manual_seed(1234 + rank)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    return start


def rank_one_raises(rank: int, world: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one broke on purpose")
    dist.barrier()  # left waiting for rank 1
    return rank


def rank_sleeps(rank: int, world: int, seconds: float) -> None:
    time.sleep(seconds)


# -- running a command under the limits an ordinary user has -------------------------------

_LIMITED = (
    "import ctypes, os, resource, sys\n"
    "nofile = int(sys.argv[1])\n"
    "if nofile:\n"
    "    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
    "if int(sys.argv[2]) and os.geteuid() == 0:\n"
    "    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH: root obeys file modes too\n"
    "        if ctypes.CDLL(None).prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP\n"
    "            sys.exit('cannot drop CAP_DAC_OVERRIDE')\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def limited(cmd: list[str], *, nofile: int = 0, obey_file_modes: bool = False) -> list[str]:
    """``cmd`` run with at most ``nofile`` open files and, with ``obey_file_modes``, unable to
    write where file modes forbid it even as root (which the suite may run as): a test can then
    make a folder read-only with ``chmod`` and have the command meet it as a user would."""
    return [sys.executable, "-c", _LIMITED, str(nofile), str(int(obey_file_modes)), *cmd]


def rank_broadcasts_without_unpickling(rank: int, world: int) -> list:
    """``broadcast_object`` from each rank in turn, in a rank that refuses to unpickle anything."""
    import torch.distributed.distributed_c10d as c10d

    from tunekit.runtime.dist import broadcast_object

    class Refuse:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a rank unpickled what another sent")

    saved, c10d._unpickler = (
        c10d._unpickler,
        Refuse,
    )  # what torch's object collectives unpickle with
    try:
        return [
            broadcast_object(
                {"from": src, "plan": [1, 2.5, "x", None], "t": (1, 2)} if rank == src else None,
                src=src,
            )
            for src in range(world)
        ]
    finally:
        c10d._unpickler = saved


def rank_train_params(rank: int, world: int, spec: str, steps: int) -> dict:
    """Train ``steps`` steps with the session's default gradient sync; this rank's parameters."""
    import torch.distributed as dist

    from tunekit.runtime.session import Session
    from tunekit.workload import load_workload

    session = Session(load_workload(spec), rank=rank, world_size=world, group=dist.group.WORLD)
    losses = [session.train_step().loss for _ in range(steps)]
    session.close()
    return {
        "params": {n: p.detach().clone() for n, p in session.model.named_parameters()},
        "losses": losses,
    }


BUILT_IN_TUNERS = set(
    tomllib.loads((DATA.parents[1] / "pyproject.toml").read_text())["project"]["entry-points"][
        "tunekit.plugins"
    ]
)
"""The tuners tunekit registers itself (its pyproject's entry points)."""


def assert_every_tuner_heard_and_no_trial_crashed(report: dict) -> None:
    """A study's report.json: every built-in tuner diagnosed the job (a crash in diagnose
    leaves it out of the report) and said something, and no trial crashed (a candidate the
    job cannot run is not planned)."""
    assert set(report["diagnoses"]) == BUILT_IN_TUNERS, report["diagnoses"].keys()
    for name, d in report["diagnoses"].items():
        assert d["summary"], name
    trials = report["trials"]
    assert trials[0]["role"] == "baseline" and trials[0]["status"] == "ok"
    assert all(t["status"] != "crash" for t in trials), [
        (t["description"], t["error"]) for t in trials
    ]
