"""Relaunch trials: one torchrun per trial, isolated from the tuner.

Each trial runs in its own process session, so that a crash, an
out-of-memory or a hang fails the trial and not the tuner: on timeout the
whole process group (torchrun agent and its workers) is killed. On Linux the
agent also gets SIGTERM when tunekit itself dies, however it dies, so that
an interrupted study leaves no trial running (or hanging) behind it.

Outcomes: ``ok``; ``crash`` (a rank reported an error, died of a signal or
exited without a result); ``oom`` (a rank's own error was an out-of-memory
error); ``too_slow`` (the trial outlived its timeout while its steps kept
finishing); ``hang`` (its steps stopped, or it outlived its timeout without
finishing a step).

A trial is classified from facts, never from its log: each rank's result file
(which carries its exception's type), and each torchrun agent's report of the
exit status of the ranks that failed (``agent<i>.json``, see
:mod:`tunekit.trials.agent`). The agents' output is kept capped
(:mod:`tunekit.trials.output`): a workload may print without limit.

One module, though past 600 lines: starting a trial's agents, watching them
(progress, stalls, the timeout) and classifying how they ended read the same
trial folder and the same clock; the parts that stand alone are their own
modules (``agent``, ``output``, ``exits``, ``nodes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from tunekit.observe.observation import Measurement
from tunekit.runtime import rank_entry
from tunekit.runtime.dist import free_port
from tunekit.trials.exits import describe_exit, fault_location, signal_name
from tunekit.trials.output import CappedLog, OutputRecord, pump, read_tail
from tunekit.trials.stats import measurement_from_ranks
from tunekit.trials.warm_start import PIPE, STDOUT, child_env, start_python

if TYPE_CHECKING:
    from tunekit.runtime.rundir import RunDir
    from tunekit.trials.nodes import Coordinator

OK, CRASH, OOM, HANG, TOO_SLOW = "ok", "crash", "oom", "hang", "too_slow"


@dataclass
class TrialSpec:
    """What a trial runs (written as ``spec.json`` for the workers)."""

    workload: str
    """Resolved workload name (see ``tunekit.workload.resolve_spec``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """``TuningConfig.to_dict()``."""
    warmup: int = 3
    steps: int = 10
    seed: int = 0
    profile_steps: int = 0
    """Extra steps after the measured ones, recorded with torch.profiler
    (Chrome traces per rank in ``traces/``; they are not part of the measurement)."""
    search: dict[str, Any] | None = None
    """``{"plugin": name, "max_steps": n}``: run that tuner's in-job search first."""
    device: str = "auto"
    memory_cap_bytes: int | None = None
    """``--memory-cap``: a step whose peak on a rank goes over it fails the trial as ``oom``."""
    probe: dict[str, Any] | None = None
    """``{"sizes": [...], "repeats": n}``: after the measured (and profiled) steps, time this
    machine's collectives in the trial's process group (``tunekit.observe.probe.sweep_rank``),
    into each rank's result as ``probe``: a study's first baseline does, where no probe is
    cached, instead of starting ranks of its own for it."""


@dataclass
class LaunchOptions:
    """How to start the ranks."""

    nproc: int = 2
    """Ranks per node (``torchrun --nproc-per-node``)."""
    timeout_s: float = 300.0
    """Wall-clock limit of the trial; past it the trial is ``too_slow`` if its steps
    were still finishing, else a hang."""
    stall_s: float | None = 60.0
    """Once training steps run, a trial whose rank 0 finishes no step for this long
    (and for ``STALL_STEPS`` times its slowest step so far) is a hang, without waiting
    for ``timeout_s``. None: only ``timeout_s`` counts."""
    nnodes: int = 1
    """Nodes in the job (``--nnodes``); several machines need ``rdzv_endpoint``."""
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous for several machines (passed to torchrun)."""
    rdzv_backend: str = "c10d"
    rdzv_id: str | None = None
    master: str | None = None
    """``host:port`` of one trial's static rendezvous across nodes (the coordinator picks it,
    :mod:`tunekit.trials.nodes`): node ``node_rank`` holds global ranks ``node_rank * nproc`` on."""
    loopback_nodes: int = 1
    """Run this many torchrun agents on this machine as separate "nodes"."""
    threads_per_rank: int | None = None
    """``OMP_NUM_THREADS`` for each rank; default: the caller's ``OMP_NUM_THREADS``, else cores / ranks here."""
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.nnodes < 1 or self.loopback_nodes < 1:
            raise ValueError("nproc, nnodes and loopback_nodes must be at least 1")
        if self.loopback_nodes > 1 and self.nnodes > 1:
            raise ValueError("use either loopback_nodes or nnodes, not both")
        if self.stall_s is not None and self.stall_s <= 0:
            raise ValueError("stall_s must be positive (or None)")

    @property
    def world_size(self) -> int:
        return self.nproc * max(self.nnodes, self.loopback_nodes)


@dataclass
class TrialOutcome:
    status: str
    error: str
    wall_s: float
    trial_dir: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    measurement: Measurement | None = None
    search: dict[str, Any] | None = None
    startup_s: float | None = None
    """Seconds from launch to rank 0's first step (None: it never started one)."""
    output: list[dict[str, Any]] = field(default_factory=list)
    """Per agent log: the bytes its processes wrote and what the log kept of them
    (:class:`tunekit.trials.output.OutputRecord`)."""

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["measurement"] = self.measurement.to_dict() if self.measurement else None
        return d


ProgressFn = Callable[[dict[str, Any]], None]


def agent_commands(
    spec_path: Path,
    opts: LaunchOptions,
    module: str = "tunekit.runtime.worker",
    report_dir: Path | None = None,
) -> list[list[str]]:
    """The torchrun command line of each agent: ``module`` runs in every rank with ``spec_path``.

    With ``report_dir``, agent ``i`` writes its failed ranks' exit statuses to
    ``report_dir/agent<i>.json`` (:mod:`tunekit.trials.agent`).
    """
    cmds = _agent_commands(spec_path, opts, module)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    return [
        [
            sys.executable,
            "-m",
            "tunekit.trials.agent",
            "-" if report_dir is None else str(report_dir / f"agent{i}.json"),
            *cmd[len(torchrun) :],
        ]
        for i, cmd in enumerate(cmds)
    ]


def _agent_commands(spec_path: Path, opts: LaunchOptions, module: str) -> list[list[str]]:
    base = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(opts.nproc),
        "--max-restarts",
        "0",
    ]
    worker = ["-m", module, str(spec_path)]
    if rank_entry.forking():  # each rank forks from the agent, torch already imported
        worker = [
            "--run-path",
            "--start-method",
            "fork",
            rank_entry.__file__,
            module,
            str(spec_path),
        ]
    if opts.loopback_nodes > 1:
        port = free_port()
        return [
            base
            + ["--nnodes", str(opts.loopback_nodes), "--node-rank", str(i)]
            + ["--master-addr", "127.0.0.1", "--master-port", str(port)]
            + worker
            for i in range(opts.loopback_nodes)
        ]
    if opts.master:
        host, _, master_port = opts.master.rpartition(":")
        return [
            base
            + [
                "--nnodes",
                str(opts.nnodes),
                "--node-rank",
                str(opts.node_rank),
                "--master-addr",
                host,
                "--master-port",
                master_port,
            ]
            + worker
        ]
    if opts.nnodes > 1 or opts.rdzv_endpoint:
        if not opts.rdzv_endpoint:
            raise ValueError("several nodes need a rendezvous endpoint (host:port)")
        rdzv = ["--nnodes", str(opts.nnodes), "--node-rank", str(opts.node_rank)]
        rdzv += ["--rdzv-backend", opts.rdzv_backend, "--rdzv-endpoint", opts.rdzv_endpoint]
        rdzv += ["--rdzv-id", opts.rdzv_id or "tunekit"]
        return [base + rdzv + worker]
    return [base + ["--standalone"] + worker]


def rank_threads(local_ranks: int, threads_per_rank: int | None = None) -> int:
    """Compute threads per rank: as asked, else as the caller's ``OMP_NUM_THREADS`` says
    (someone sharing the machine sets it), else this machine's cores split among the ranks."""
    if threads_per_rank:
        return threads_per_rank
    asked = os.environ.get("OMP_NUM_THREADS", "").strip()
    if asked.isdigit() and int(asked) > 0:
        return int(asked)
    return max(1, (psutil.cpu_count(logical=False) or 1) // max(local_ranks, 1))


def launch_env(opts: LaunchOptions) -> dict[str, str]:
    env = child_env()
    threads = rank_threads(opts.nproc * opts.loopback_nodes, opts.threads_per_rank)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(opts.env)
    return env


EXIT_GRACE_S = 5.0
"""How long a trial whose ranks have all reported waits for its agents to exit by themselves
before it stops them (a forked rank exits within a tenth of a second; a spawned one in about 1 s)."""
RESULT_GRACE_S = 60.0
"""How long a trial waits for a follower's files once this node's agents have exited, and how
long past its timeout a follower's agent may run before the follower kills it."""

STALL_STEPS = 10
"""A stalled trial has gone this many of its slowest steps without finishing one."""

_TIMED_PHASES = ("warmup", "measure", "profile")


class StallWatch:
    """Tells a hung trial from a slow one by rank 0's step lines in ``progress.jsonl``.

    Armed from the first timed step to the trial's last one: before it, process
    start-up and compilation have no steps to show, and an in-job search runs steps
    without lines; after it, only ``timeout_s`` bounds the trace export and teardown.
    The same lines give the trial's start-up time and its pace when the timeout comes.
    """

    def __init__(
        self,
        spec: TrialSpec,
        limit_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
    ):
        self.limit_s = limit_s
        self.clock = clock
        self.started = clock() if started is None else started
        profiled = spec.profile_steps > 0
        self.final = ("profile", spec.profile_steps) if profiled else ("measure", spec.steps)
        self.total = spec.warmup + spec.steps + spec.profile_steps
        self.last_at: float | None = None
        self.slowest_s = 0.0
        self.step_times: list[float] = []
        self.startup_s: float | None = None
        """Launch to the start of rank 0's first step (or of its in-job search)."""
        self.where = ""

    def saw(self, line: dict[str, Any]) -> None:
        phase, index = line.get("phase"), line.get("index")
        step_s = float(line.get("step_s") or 0.0)
        if self.startup_s is None:
            self.startup_s = max(0.0, self.clock() - self.started - step_s)
        if phase in _TIMED_PHASES:
            self.step_times.append(step_s)
        timed = phase in _TIMED_PHASES and (phase, index) != self.final
        self.last_at = self.clock() if timed else None
        self.slowest_s = max(self.slowest_s, step_s)
        self.where = f"{phase} step {index}/{line.get('total')}"

    def _silence_limit(self) -> float:
        return max(self.limit_s or 0.0, STALL_STEPS * self.slowest_s)

    def stalled(self) -> str | None:
        """Why the trial counts as hung now, or None."""
        if self.limit_s is None or self.last_at is None:
            return None
        idle = self.clock() - self.last_at
        if idle <= self._silence_limit():
            return None
        return f"no step finished for {idle:.0f} s after {self.where}; killed the trial's processes"

    def steps_running(self) -> bool:
        """Timed steps are under way and the last one finished recently for their pace."""
        # At least a second: lines are read every quarter second, millisecond steps
        # would otherwise look stopped between two reads.
        return self.last_at is not None and self.clock() - self.last_at <= max(
            self._silence_limit(), 1.0
        )

    def timed_out(self, timeout_s: float) -> tuple[str, str]:
        """The status and error line of a trial killed at its timeout: too slow while steps finish, else hung."""
        if self.steps_running():
            return TOO_SLOW, (
                f"too slow: {_seconds(statistics.median(self.step_times))} per step, {len(self.step_times)} of "
                f"{self.total} steps done when the {timeout_s:.0f} s timeout came; killed the trial's processes"
            )
        return HANG, f"no result within {timeout_s:.0f} s; killed the trial's processes"


def _seconds(x: float) -> str:
    return f"{x:.1f} s" if x >= 1 else f"{x:.2f} s"


async def run_trial(
    spec: TrialSpec,
    opts: LaunchOptions,
    trial_dir: Path,
    on_progress: ProgressFn | None = None,
    nodes: Coordinator | None = None,
) -> TrialOutcome:
    """Run one trial to completion (or timeout) and collect every rank's result.

    With ``nodes`` (several machines), the trial is announced to every follower and
    this machine runs node 0's agent; the followers' files come back through the
    coordinator's store into ``trial_dir``.
    """
    trial_dir = Path(trial_dir)
    _fresh_trial_dir(trial_dir)
    spec_path = trial_dir / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=2))
    start = time.monotonic()
    job = None
    if nodes is not None:
        job, master = nodes.announce_trial(
            asdict(spec),
            {
                "nproc": opts.nproc,
                "nnodes": opts.nnodes,
                "threads_per_rank": opts.threads_per_rank,
                "env": opts.env,
                "timeout_s": opts.timeout_s,
            },
        )
        opts = replace(opts, master=master, node_rank=0)
    sent: dict[int, int | None] = {}  # follower -> its agent's exit code, once its files are here
    procs, logs, pumps = await _start_agents(
        agent_commands(spec_path, opts, report_dir=trial_dir), opts, trial_dir
    )
    killed: tuple[str, str] | None = None  # (status, why) of a trial we had to kill
    stopped_after_results = False
    watch = StallWatch(spec, opts.stall_s, started=start)
    seen = 0
    ended_at = None  # when this node's agents had all exited
    results_at = None  # when every rank's result was in
    try:
        while True:
            seen = _forward_progress(trial_dir / "progress.jsonl", seen, on_progress, watch)
            if nodes is not None and job is not None:  # (job is set whenever nodes is)
                nodes.collect(job, trial_dir, sent)
                if lost := nodes.lost():
                    killed = (CRASH, "; ".join(lost.values()))
                    break
            if _all_ranks_reported(trial_dir, opts.world_size):
                # Every result is in: the agents get a moment to end by themselves (so that
                # the ranks' exit hooks, a workload's own clean-up, run), not torchrun's
                # whole teardown, which can take seconds.
                stopped_after_results = True
                results_at = results_at or time.monotonic()
                if not any(p.returncode is None for p in procs) or (
                    time.monotonic() - results_at > EXIT_GRACE_S
                ):
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout=0.25)
                continue
            running = any(p.returncode is None for p in procs)
            if not running:
                if nodes is None or len(sent) == len(nodes.followers):
                    break
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > RESULT_GRACE_S:
                    break  # a follower that still sends nothing: its ranks count as missing
            if time.monotonic() - start > opts.timeout_s:
                killed = watch.timed_out(opts.timeout_s)
                break
            if stall := watch.stalled():
                killed = (HANG, stall)
                break
            if not running:  # this node is done: the followers' files are still to come
                await asyncio.sleep(0.2)
                continue
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout=0.25)
            except TimeoutError:
                pass
        _forward_progress(trial_dir / "progress.jsonl", seen, on_progress, watch)
    finally:
        if nodes is not None and job is not None:
            nodes.stop(job)
        await stop_all(procs)
        output = await _finish_logs(pumps, logs)
    codes = [p.returncode for p in procs]
    if stopped_after_results:
        # We stopped the agents (torchrun exits 1 on our SIGTERM): the rank files speak.
        codes = [0] * len(procs)
    elif nodes is not None:
        codes += [
            sent.get(r, 0) for r in nodes.followers
        ]  # a missing node is named by its missing ranks
    outcome = collect(trial_dir, opts, codes, killed, time.monotonic() - start, output, nodes)
    outcome.startup_s = watch.startup_s
    return outcome


def _fresh_trial_dir(trial_dir: Path) -> None:
    trial_dir.mkdir(parents=True, exist_ok=True)
    stale = [
        *trial_dir.glob("rank*.json"),
        *trial_dir.glob("agent*.json"),
        *trial_dir.glob("faults/rank*"),
        *trial_dir.glob("traces/rank*.json"),
        trial_dir / "progress.jsonl",
    ]
    for path in stale:
        path.unlink(missing_ok=True)


async def _start_agents(cmds: list[list[str]], opts: LaunchOptions, trial_dir: Path):
    """Start every agent in a process session of its own, its output piped into a capped log."""
    procs, logs, pumps = [], [], []
    env = launch_env(opts)
    for i, cmd in enumerate(cmds):
        # Piped through tunekit, not written straight to the file: what a workload prints is unbounded.
        log = CappedLog(trial_dir / f"agent{i}.log")
        logs.append(log)
        proc = await start_python(cmd, env=env, stdout=PIPE, stderr=STDOUT)
        procs.append(proc)
        assert proc.stdout is not None  # stdout=PIPE
        pumps.append(asyncio.create_task(pump(proc.stdout, log)))
    return procs, logs, pumps


async def run_node_agent(
    spec: TrialSpec, opts: LaunchOptions, trial_dir: Path, stop_now: Callable[[], str | None]
) -> int | None:
    """A follower's part of a trial: this node's agent, until it exits, ``opts.timeout_s`` passes
    or ``stop_now`` gives a reason to stop; returns its exit code (None: killed)."""
    trial_dir = Path(trial_dir)
    _fresh_trial_dir(trial_dir)
    spec_path = trial_dir / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=2))
    start = time.monotonic()
    procs, logs, pumps = await _start_agents(
        agent_commands(spec_path, opts, report_dir=trial_dir), opts, trial_dir
    )
    why = None
    try:
        while any(p.returncode is None for p in procs):
            if (why := stop_now()) or time.monotonic() - start > opts.timeout_s + RESULT_GRACE_S:
                break
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout=0.25)
            except TimeoutError:
                pass
    finally:
        await stop_all(procs)
        if why:
            logs[0].note(why)
        await _finish_logs(pumps, logs)
    return None if why else procs[0].returncode


async def run_live_agent(
    rd: RunDir, opts: LaunchOptions, log_path: Path, stop_now: Callable[[], str | None]
) -> int | None:
    """A follower's part of a live run: this node's agent of ``tunekit.runtime.live``, until it
    exits or ``stop_now`` gives a reason to stop; returns its exit code (None: stopped)."""
    env = launch_env(opts)
    env["PYTHONSAFEPATH"] = (
        "1"  # as the supervisor starts node 0's: not the working directory on the path
    )
    (cmd,) = agent_commands(rd.path, opts, module="tunekit.runtime.live")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(fd, "ab") as log:
        proc = await start_python(cmd, env=env, stdout=log.fileno(), stderr=STDOUT)
    why = None
    try:
        while proc.returncode is None:
            if why := stop_now():
                break
            try:
                await asyncio.wait_for(proc.wait(), timeout=0.25)
            except TimeoutError:
                pass
    finally:
        await stop_all([proc])
    return None if why else proc.returncode


async def _finish_logs(pumps: list[asyncio.Task], logs: list[CappedLog]) -> list[OutputRecord]:
    """Let the pumps copy what the stopped agents left in their pipes, then close the logs."""
    # A process the workload left behind may hold a pipe open past its agent: do not wait for it.
    _, late = await asyncio.wait(pumps, timeout=5) if pumps else (set(), set())
    for task in late:
        task.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
    return [log.close() for log in logs]


def run_trial_sync(
    spec: TrialSpec, opts: LaunchOptions, trial_dir: Path, on_progress: ProgressFn | None = None
) -> TrialOutcome:
    """:func:`run_trial` for callers without an event loop."""
    return asyncio.run(run_trial(spec, opts, trial_dir, on_progress))


def _all_ranks_reported(trial_dir: Path, world_size: int) -> bool:
    return all((trial_dir / f"rank{r}.json").exists() for r in range(world_size))


def _forward_progress(
    path: Path, seen: int, on_progress: ProgressFn | None, watch: StallWatch
) -> int:
    if not path.exists():
        return seen
    lines = path.read_text().splitlines()
    for line in lines[seen:]:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return seen  # a line still being written: read it next time
        watch.saw(event)
        if on_progress is not None:
            on_progress(event)
        seen += 1
    return seen


async def stop_all(procs) -> None:
    """Terminate every agent's whole process group, then kill what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.returncode is None]
        if not alive:
            break
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in alive)), timeout=5)
        except TimeoutError:
            continue


def collect(
    trial_dir: Path,
    opts: LaunchOptions,
    returncodes: list[int | None],
    killed: tuple[str, str] | None,
    wall_s: float,
    output: list[OutputRecord] | None = None,
    nodes: Coordinator | None = None,
) -> TrialOutcome:
    """Turn the rank files, the agents' reports and their exit codes into an outcome
    (``killed``: the status and reason of a killed trial; ``nodes``: the followers, to name
    a node none of whose ranks reported)."""
    ranks = []
    for r in range(opts.world_size):
        path = trial_dir / f"rank{r}.json"
        if path.exists():
            try:
                ranks.append(json.loads(path.read_text()))
            except json.JSONDecodeError:
                pass
    reported = {r.get("rank") for r in ranks}
    # Ranks that ended without writing a result: killed by a signal, or exited early.
    deaths = [f for f in _agent_failures(trial_dir) if f["rank"] not in reported]
    failed = [r for r in ranks if r.get("status") != OK]
    out = TrialOutcome(
        status=OK,
        error="",
        wall_s=wall_s,
        trial_dir=str(trial_dir),
        ranks=ranks,
        output=[o.to_dict() for o in output or []],
    )
    if killed:
        out.status, out.error = killed
    elif any(r.get("status") == OOM for r in ranks):
        out.status = OOM
        out.error = next(r["error"] for r in ranks if r.get("status") == OOM)
    elif failed or deaths or any(rc != 0 for rc in returncodes) or len(ranks) < opts.world_size:
        out.status = CRASH
        out.error = _silent_nodes(reported, opts, nodes) or _crash_reason(
            trial_dir, failed, deaths, returncodes
        )
    if out.ok:
        out.measurement = measurement_from_ranks(ranks)
        out.search = ranks[0].get("search")
    return out


def _silent_nodes(reported: set, opts: LaunchOptions, nodes: Coordinator | None) -> str:
    """One line naming the followers none of whose ranks reported, or ''."""
    if nodes is None:
        return ""
    silent = [
        r
        for r in nodes.followers
        if not any(r * opts.nproc + i in reported for i in range(opts.nproc))
    ]
    if not silent:
        return ""
    return "; ".join(f"{nodes.describe(r)} sent no result for its ranks" for r in silent)


def _agent_failures(trial_dir: Path) -> list[dict[str, Any]]:
    """Every agent's failed ranks (rank, pid, exit code), first to fail first."""
    rows = []
    for path in sorted(trial_dir.glob("agent*.json")):
        try:
            rows += json.loads(path.read_text()).get("failures", [])
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
    return sorted(rows, key=lambda f: f.get("timestamp") or 0)


def _crash_reason(
    trial_dir: Path, failed: list[dict], deaths: list[dict], returncodes: list[int | None]
) -> str:
    """One line on why a trial crashed, from the most basic fact there is."""
    # A rank killed by a signal comes first: its peers then fail on a broken connection.
    for d in deaths:
        if signal_name(d.get("exitcode")):
            where = fault_location(trial_dir / "faults" / f"rank{d['rank']}.txt")
            return f"rank {d['rank']} {describe_exit(d['exitcode'])}" + (
                f" at {where}" if where else ""
            )
    if error := next((r["error"] for r in failed if r.get("error")), ""):
        return error
    if deaths:
        d = deaths[0]
        return f"rank {d['rank']} {describe_exit(d.get('exitcode'))} without writing its result"
    for i, rc in enumerate(returncodes):
        if rc:  # torchrun itself failed (bad arguments, rendezvous): its log says how
            line = _last_error_line(read_tail(trial_dir / f"agent{i}.log"))
            return f"torchrun agent {i} {describe_exit(rc)}" + (f": {line}" if line else "")
    return "the trial exited without a result"


def _last_error_line(logs: str) -> str:
    """The most telling line of a failed agent's log (its message, not its classification)."""
    lines = [ln.strip() for ln in logs.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Exception" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else ""
