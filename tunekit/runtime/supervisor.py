"""``tunekit run``'s own process: starts the job's torchrun and keeps it going.

The supervisor relaunches the job when a change needs new processes (world
size, placement: rank 0 leaves ``relaunch.json`` and a checkpoint), rolls back
by relaunching from the pre-apply checkpoint when the job crashes while an
applied config is still being watched, and marks the run ``crashed``
otherwise, leaving everything needed for ``tunekit run --resume``.

One run, one job: the supervisor holds ``supervisor.lock`` and the job's rank
0 holds ``rank0.lock`` (:mod:`tunekit.locks`), so a second ``tunekit run
--resume`` is refused while either lives, even when the supervisor was killed
and left its job training on. Each launch has an id that rank 0 writes into
its ``relaunch.json``: a plan left by an earlier launch is never carried out.

A ``tunekit stop`` that comes while the job is between launches leaves
``stop-request.json``; a supervisor about to carry out a relaunch plan takes it
and stops the run instead, leaving the plan for ``tunekit run --resume``. The
file is taken (unlinked) by exactly one side: the supervisor, or the client
that wrote it once the relaunched job serves its socket (it then asks that job).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunekit.config import TuningConfig, resolve
from tunekit.errors import ConfigError, ControlError, TunekitError
from tunekit.locks import FileLock, LockHeld, describe_holder, holder_if_held
from tunekit.plugin_loading import available_tuners, load_all, slow_imports
from tunekit.runtime.control import ControlClient, JobNotRunning, JobRelaunching
from tunekit.runtime.rundir import PRIVATE_FILE, RunDir
from tunekit.trials.warm_start import ForkedPopen, popen_python

if TYPE_CHECKING:
    from tunekit.trials.nodes import Coordinator

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
    nnodes: int = 1,
    memory_cap_bytes: int | None = None,
) -> RunDir:
    """Check the inputs here, in one clear line each, then create the run directory."""
    from tunekit.config import config_layout
    from tunekit.workload import load_workload, resolve_spec

    spec = resolve_spec(workload)
    wl = load_workload(spec)
    config = config or TuningConfig()
    records = load_all()
    tuners = available_tuners(records)
    layout = config_layout(resolve(config, tuners), wl.layout())
    check_job(wl, layout, nproc * nnodes, memory_cap_bytes)
    if layout.sharded and nnodes > 1:
        raise ConfigError(
            "a sharded (FSDP) live job checkpoints every rank's shard into the run folder, which "
            "nodes do not share: run it on one node (trials across nodes work)"
        )
    rd = RunDir.create(
        store_dir,
        {
            "workload": spec,
            "nproc": nproc,
            "config": config.to_dict(),
            "steps": steps,
            "seed": seed,
            "checkpoint_every": checkpoint_every,
            "watch_window": watch_window,
            "min_effect": min_effect,
            "device": device,
            "resume": None,
            "plugins": sorted(tuners),  # the ranks load these and no others
            "nnodes": nnodes,  # nproc is per node; a change of world size keeps the nodes
            "memory_cap_bytes": memory_cap_bytes,
        },
        name=name,
    )
    for line in slow_imports([r for r in records if r.ok]):
        rd.log_event("slow_plugin", reason=line)
    return rd


def check_job(wl, layout, world_size: int, memory_cap_bytes: int | None) -> None:
    """The layout against the model (its blocks, its parameters) and the cap against the
    parameters' own size per rank, before any rank starts: one line naming the field.

    The model is built on the meta device (no memory) where its code allows."""
    import torch

    from tunekit.errors import WorkloadError
    from tunekit.memory import format_bytes
    from tunekit.runtime.sharding import check_layout

    try:
        with torch.device("meta"):
            model = wl.model()
    except Exception:  # code that needs real tensors to build: build it for real
        model = wl.model()
    try:
        check_layout(model, layout)
    except ConfigError as exc:
        raise WorkloadError(f"workload {wl.name!r}: {exc}") from None
    if memory_cap_bytes is not None:
        shards = world_size if layout.sharded else 1
        own = sum(p.numel() * p.element_size() for p in model.parameters()) / shards
        if memory_cap_bytes < own:
            raise ConfigError(
                f"--memory-cap {format_bytes(memory_cap_bytes)} is below this job's own "
                f"parameters per rank ({format_bytes(own)}): nothing could run; give a larger cap"
            )


@contextlib.contextmanager
def supervising(rd: RunDir) -> Iterator[FileLock]:
    """Hold the run for this process: refused while another supervisor or a rank 0 of it lives."""
    lock = FileLock(rd.supervisor_lock, "tunekit run", run=rd.run_id)
    try:
        lock.acquire()
    except LockHeld as exc:
        raise TunekitError(
            f"run {rd.run_id} is already supervised by {describe_holder(exc.holder)}; "
            f"see `tunekit status {rd.run_id}`"
        ) from None
    except OSError as exc:
        raise TunekitError(
            f"cannot lock run {rd.run_id} ({exc.strerror}: {exc.filename})"
        ) from None
    try:
        holder = rank0_still_held(rd)
        if holder is not None:  # a job whose supervisor died, still training
            raise TunekitError(
                f"run {rd.run_id} is still training: its rank 0 is {describe_holder(holder)}; "
                f"stop it with `tunekit stop {rd.run_id}` before resuming it"
            )
        yield lock
    finally:
        lock.release()


RANK0_EXIT_GRACE_S = 30.0
"""How long a job that says it ended may take to let go of its rank-0 lock (its rank 0 writes
the final status, then tears its process group down and exits)."""


def rank0_still_held(rd: RunDir, grace_s: float = RANK0_EXIT_GRACE_S) -> dict[str, Any] | None:
    """Who holds the run's rank-0 lock, or None. A job whose status says it ended is given
    ``grace_s`` to exit, so that `tunekit stop RUN && tunekit run --resume RUN` resumes."""
    deadline = time.monotonic() + grace_s
    while (holder := holder_if_held(rd.rank0_lock)) is not None:
        ended = rd.read_status().get("status") in ("stopped", "finished", "crashed", "relaunching")
        if not ended or time.monotonic() > deadline:
            return holder
        time.sleep(0.2)
    return None


def prepare_resume(rd: RunDir) -> Path:
    """Point the run at its newest checkpoint; its config comes from the checkpoint.

    A relaunch the last launch asked for but nobody carried out (its supervisor
    was killed in between) is carried out now, when its checkpoint is the newest;
    any other leftover plan is dropped: it would rewind the run.
    """
    plan = _take_relaunch_plan(rd)
    ckpt = rd.latest_checkpoint()
    if ckpt is None:
        raise TunekitError(f"run {rd.run_id} has no checkpoint to resume from")
    spec = rd.read_run()
    if (
        plan is not None
        and plan.get("launch") == spec.get("launch")
        and Path(plan["checkpoint"]) == ckpt
    ):
        rd.update_run(
            nproc=per_node(plan["nproc"], spec),
            config=plan["config"],
            resume=str(ckpt),
            watch=plan.get("watch"),
            applied=plan.get("applied", spec.get("applied", [])),
        )
        rd.log_event(
            "resume_requested", checkpoint=str(ckpt), pending_relaunch=True, nproc=plan["nproc"]
        )
        return ckpt
    if plan is not None:
        rd.log_event(
            "stale_relaunch_dropped", plan_step=plan.get("step"), checkpoint=plan.get("checkpoint")
        )
    rd.update_run(resume=str(ckpt), config=None, watch=None)
    rd.log_event("resume_requested", checkpoint=str(ckpt))
    return ckpt


def _take_relaunch_plan(rd: RunDir) -> dict[str, Any] | None:
    """Read and remove ``relaunch.json`` (None when there is none or it is unreadable)."""
    plan = _read_relaunch_plan(rd)
    rd.relaunch_file.unlink(missing_ok=True)
    return plan


def _read_relaunch_plan(rd: RunDir) -> dict[str, Any] | None:
    try:
        text = rd.relaunch_file.read_text()
    except FileNotFoundError:
        return None
    try:
        plan = json.loads(text)
    except ValueError:
        return None
    return plan if isinstance(plan, dict) and "checkpoint" in plan and "nproc" in plan else None


STOP_REQUEST_TTL_S = 900.0
"""A stop request older than this is a client's that gave up (it waits at most
``tunekit.runtime.client.STOP_WAIT_S``): never carried out."""


def take_stop_request(rd: RunDir, now: float | None = None) -> bool:
    """Take (remove) a stop asked for between launches; whether one was there and still fresh.

    Removing it is the decision: the client that wrote it removes it too when the
    relaunched job serves first, and only one of the two can succeed."""
    try:
        text = rd.stop_request_file.read_text()
        rd.stop_request_file.unlink()
    except FileNotFoundError:
        return False
    try:
        asked_at = float(json.loads(text)["asked_at"])
    except (ValueError, KeyError, TypeError):
        return False
    return (time.time() if now is None else now) - asked_at < STOP_REQUEST_TTL_S


def per_node(world: int, spec: dict[str, Any]) -> int:
    """Ranks per node for a world size (relaunch plans and watches count the whole job's ranks)."""
    return max(1, int(world) // int(spec.get("nnodes") or 1))


def client(rd: RunDir, timeout_s: float = 600.0) -> ControlClient:
    return RunClient(rd, timeout_s)


class RunClient(ControlClient):
    """A run's control client: between two launches of its job it says so (JobRelaunching),
    not that the run is not running."""

    def __init__(self, rd: RunDir, timeout_s: float = 600.0):
        super().__init__(rd.socket_file(), rd.token(), timeout_s)
        self.rd = rd

    def _connect(self, deadline: float) -> socket.socket:
        try:
            return super()._connect(deadline)
        except JobNotRunning:
            to = relaunching_to(self.rd)
            if to is None:
                raise
            raise JobRelaunching(to or None) from None


def relaunching_to(rd: RunDir) -> int | None:
    """The world size the run's job is being relaunched with (0: not known), or None when it
    is not between launches: its status says so and its supervisor lives to relaunch it."""
    status = rd.read_status()
    if status.get("status") != "relaunching" or holder_if_held(rd.supervisor_lock) is None:
        return None
    return int(status.get("relaunching_to") or 0)


def supervise(
    rd: RunDir,
    on_tick: Callable[[RunDir], None] | None = None,
    poll_s: float = 0.5,
    nodes: Coordinator | None = None,
) -> int:
    """Run the job to its end; 0 when it finished or stopped, 1 when it crashed.

    The caller holds the run (:func:`supervising`). With ``nodes`` (the job spans machines)
    every launch is announced to the followers, which start their nodes' ranks; a follower
    that stops answering ends the launch as a crash that names its node.
    """
    from tunekit.trials.launcher import LaunchOptions, agent_commands, launch_env

    rolled_back: set[Any] = set()  # applies already undone after a crash: never twice
    launches = 0
    rd.stop_request_file.unlink(missing_ok=True)  # asked of an earlier supervisor
    while True:
        launch = secrets.token_hex(4)
        spec = rd.update_run(launch=launch)
        opts = LaunchOptions(nproc=int(spec["nproc"]))
        job = None
        if nodes is not None:
            job, master = nodes.announce_live(
                {k: v for k, v in spec.items() if k != "socket"}, rd.run_id, opts.nproc
            )
            opts = LaunchOptions(nproc=opts.nproc, nnodes=nodes.nnodes, node_rank=0, master=master)
        (cmd,) = agent_commands(rd.path, opts, module="tunekit.runtime.live")
        env = launch_env(opts)
        env["PYTHONSAFEPATH"] = (
            "1"  # `python -m` would put the working directory on the ranks' import path
        )
        log_path = rd.logs / f"agent-{launches}.log"
        launches += 1
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
        with open(fd, "ab") as log:
            # Forked from this process's warm server (a relaunch skips torch's imports).
            proc = popen_python(
                cmd, env=env, stdout=log.fileno(), stderr=subprocess.STDOUT, umask=0o077
            )
            lost: dict[int, str] = {}
            try:
                while proc.poll() is None:
                    if on_tick is not None:
                        on_tick(rd)
                    if nodes is not None and (lost := nodes.lost()):
                        _kill(
                            proc
                        )  # its ranks would wait for the lost node's until a collective times out
                        break
                    time.sleep(poll_s)
            except KeyboardInterrupt:
                stop_gracefully(rd, proc)
                raise
            finally:
                if nodes is not None and job is not None:
                    nodes.stop(job)
                    nodes.wait_for_agents(job, rd.logs, timeout_s=60.0)
        if nodes is not None and proc.returncode != 0 and not lost:
            # Rank 0 reports a broken connection (a gloo error quoting its source) when a
            # follower died: by now (the wait above) its heartbeat has stood still long enough.
            lost = nodes.lost()
        if on_tick is not None:
            on_tick(rd)
        if lost:
            error = (
                f"{'; '.join(lost.values())}; continue with `tunekit run --resume {rd.run_id}` once its "
                "follower is back"
            )
            _settle(rd, "crashed", error, "node_lost", nodes=sorted(lost))
            return 1
        plan = _read_relaunch_plan(rd)
        if plan is not None and plan.get("launch") == launch and take_stop_request(rd):
            # Stopped between launches: the job checkpointed for the relaunch, and the plan
            # stays for `tunekit run --resume` (its checkpoint is the newest) to carry out.
            _stop_before_relaunch(rd, plan)
            return 0
        plan = _take_relaunch_plan(rd)
        if plan is not None and plan.get("launch") == launch:
            rd.update_run(
                nproc=per_node(plan["nproc"], spec),
                config=plan["config"],
                resume=plan["checkpoint"],
                watch=plan.get("watch"),
                applied=plan.get("applied", []),
            )
            continue
        if plan is not None:  # not this launch's: carrying it out would rewind the run
            rd.log_event(
                "stale_relaunch_dropped",
                plan_step=plan.get("step"),
                checkpoint=plan.get("checkpoint"),
            )
        if proc.returncode == 0:
            return 0
        status = rd.read_status()
        error = last_error(log_path)
        # This launch's watch: from its status, or (it died before writing one) from run.json.
        watch = (status.get("watch") if status.get("launch") == launch else spec.get("watch")) or {}
        key = (watch.get("applied_at"), json.dumps(watch.get("config"), sort_keys=True))
        if watch.get("state") == "watching" and watch.get("checkpoint") and key not in rolled_back:
            # The change under watch broke the job: go back to before it.
            rolled_back.add(key)
            nproc = (
                per_node(watch["prev_nproc"], spec) if watch.get("prev_nproc") else spec["nproc"]
            )
            verdict = {
                **watch,
                "state": "rolled_back",
                "before": None,
                "reason": f"the job crashed under the new config ({error}); "
                "relaunched from the checkpoint taken before it",
            }
            rd.log_event(
                "rolled_back_after_crash",
                step=watch.get("applied_at"),
                error=error,
                config=watch.get("prev_config"),
                nproc=nproc,
            )
            rd.write_status(
                {
                    **status,
                    "status": "relaunching",
                    "relaunching_to": nproc * int(spec.get("nnodes") or 1),
                    "watch": verdict,
                    "launch": None,
                }
            )
            applied = rd.read_run().get("applied") or []  # as the job left it
            rd.update_run(
                config=watch.get("prev_config"),
                nproc=nproc,
                resume=watch["checkpoint"],
                watch=verdict,
                applied=applied[:-1],
            )
            continue
        _settle(rd, "crashed", error, "crashed", step=status.get("step"))
        return 1


def _stop_before_relaunch(rd: RunDir, plan: dict[str, Any]) -> None:
    """Record a stop asked for while the job was between launches (its relaunch still pending)."""
    status = {k: v for k, v in rd.read_status().items() if k != "relaunching_to"}
    rd.write_status(
        {
            **status,
            "status": "stopped",
            "step": plan.get("step", status.get("step")),
            "pending_relaunch": plan["nproc"],
            "launch": None,
        }
    )
    rd.log_event("stopped", step=plan.get("step"), pending_relaunch=plan["nproc"])


def _settle(rd: RunDir, state: str, error: str, event: str, **payload: Any) -> None:
    """Record how the job ended in ``status.json`` and ``events.jsonl``; where the disk refuses
    (it is full), say it on the terminal instead: one line, the job's end never unsaid."""
    status = rd.read_status()
    try:
        rd.write_status({**status, "status": state, "error": error, "launch": None})
        rd.log_event(event, error=error, **payload)
    except OSError as exc:
        raise TunekitError(
            f"run {rd.run_id} {state} at step {status.get('step')}: {error}; this could not be "
            f"recorded in {rd.path} ({exc.strerror or exc}): make room, then "
            f"`tunekit run --resume {rd.run_id}`"
        ) from None


def _kill(proc: subprocess.Popen | ForkedPopen) -> None:
    """Terminate the job's process group, then kill it if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def stop_gracefully(rd: RunDir, proc: subprocess.Popen | ForkedPopen, wait_s: float = 60.0) -> None:
    """Ask the job to checkpoint and stop; kill its process group if it will not."""
    try:
        client(rd, timeout_s=wait_s).request("stop")
    except (ControlError, OSError):
        pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        _kill(proc)


_RAISED = re.compile(
    r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*)"
)


def last_error(log_path: Path) -> str:
    """The exception a rank raised, from the end of the agent's log (torchrun's own
    ChildFailedError report, which follows it, says only that a rank failed)."""
    try:
        lines = [
            ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()
        ]
    except FileNotFoundError:
        return "no log"
    for ln in reversed(lines):
        m = _RAISED.match(ln)
        if m and "ChildFailedError" not in ln:
            return m.group(1)[:300]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "exited without output"


def wait_for(
    rd: RunDir,
    predicate: Callable[[dict[str, Any]], bool],
    timeout_s: float = 300.0,
    poll_s: float = 0.25,
) -> dict[str, Any]:
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
