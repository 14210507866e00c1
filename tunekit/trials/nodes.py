"""Trials across machines: one coordinator, a follower on every other node.

The node that holds the study store coordinates (``tunekit auto`` with node rank
0). It hosts a ``torch.distributed.TCPStore`` at the rendezvous endpoint. Every
other node runs a follower (``tunekit follow``, or the same ``tunekit auto``
command with its own node rank) that joins that store and, for each trial the
coordinator announces, starts that node's torchrun agent and nothing else. When
the agent has exited, the follower sends its node's files (each rank's result,
the agent's report of its failed ranks, fault stacks, profiler traces, the log's
tail) back through the store, so no node needs a shared folder.

Each trial's ranks meet in torchrun's static rendezvous on a port the
coordinator picks for that trial: node ``r`` holds global ranks
``r * nproc .. (r + 1) * nproc - 1``, so global rank 0 (progress lines, stall
detection) is on the coordinator and a missing rank names its node.

Every value on the store is signed with the node token (HMAC-SHA256 over its
key and body), and every key lives under a prefix derived from the token: a
process without the token can neither find the keys nor forge an announcement
that a follower would run. The store's traffic is not encrypted; like
torchrun's own rendezvous it belongs on the cluster's trusted network.

Liveness: each side bumps a counter on the store every second and watches the
other's on its own clock (clocks of different machines are never compared). A
follower whose counter stands still for ``LOST_S`` is lost; a follower whose
coordinator is gone (its store closed, or its counter still) kills its agent and
exits.

Keys, under the prefix::

    node/<r>/hello      a follower's hello: host, pid, cores, GPUs
    node/<r>/beat       its heartbeat counter
    node/<r>/bye        it saw the end
    coord/beat          the coordinator's heartbeat counter
    jobs                how many jobs were announced
    job/<n>             the n-th announcement: {"kind": "trial", ...} or {"kind": "end"}
    job/<n>/stop        the coordinator stopped trial n: kill its agent now
    job/<n>/node/<r>    node r's files and its agent's exit code for trial n

One module, though long: the coordinator and the follower are the two ends of
one protocol on the store above; their keys and messages are read in one place.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

from tunekit.errors import TunekitError

TOKEN_ENV = "TUNEKIT_NODE_TOKEN"
"""The environment variable that carries the node token (SLURM passes it to every task)."""
TOKEN_FILE = "node-token"
"""Where the coordinator writes the token it made, in its store folder (0600)."""
DEFAULT_PORT = 29400
"""torchrun's default rendezvous port, used when only a host is given."""
BEAT_S = 1.0
LOST_S = 20.0
"""A node whose heartbeat stands still this long is gone (it beats every second from a thread
of its own, so a busy node still beats)."""
SHIPPED = (
    "rank*.json",
    "agent0.json",
    "agent0.log",
    "faults/rank*.txt",
    "traces/rank*.json",
    "telemetry.json",
)
"""The files of a trial a follower sends back (relative to its trial folder)."""


class NodesError(TunekitError):
    """A node could not join, or left: one line that names it."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``HOST:PORT`` (or ``HOST``, on torchrun's default port) as an Endpoint; bad input is one line."""
    host, sep, port = (text or "").strip().rpartition(":")
    if not sep:
        host, port = (text or "").strip(), str(DEFAULT_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NodesError(f"rendezvous endpoint must be HOST:PORT, not {text!r}")
    return Endpoint(host, int(port))


# -- the token ------------------------------------------------------------------------------


def read_token(token_file: Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The node token from ``token_file`` or ``$TUNEKIT_NODE_TOKEN``; None if neither is there."""
    env = os.environ if env is None else env
    if token_file is not None:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise NodesError(
                f"cannot read the node token from {token_file}: {exc.strerror or exc}"
            ) from None
        if not token:
            raise NodesError(f"the node token file {token_file} is empty")
        return token
    return env.get(TOKEN_ENV, "").strip() or None


def make_token(store_dir: Path) -> Path:
    """A fresh token in ``store_dir/node-token``, created private (0600); returns its path."""
    path = Path(store_dir) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


# -- signed values on the store --------------------------------------------------------------


class Channel:
    """Signed JSON values under the token's prefix of a TCPStore."""

    def __init__(self, store, token: str):
        self.store = store
        self.secret = token.encode()
        self.prefix = "tunekit/" + hashlib.sha256(self.secret).hexdigest()[:16] + "/"

    def _mac(self, key: str, body: str) -> str:
        return hmac.new(self.secret, f"{key}\n{body}".encode(), hashlib.sha256).hexdigest()

    def put(self, key: str, value: dict[str, Any]) -> None:
        body = json.dumps(value)
        self.store.set(self.prefix + key, json.dumps({"body": body, "mac": self._mac(key, body)}))

    def get(self, key: str) -> dict[str, Any] | None:
        """The value at ``key``, or None while there is none; a forged one raises NodesError."""
        if not self.store.check([self.prefix + key]):
            return None
        try:
            raw = json.loads(self.store.get(self.prefix + key))
            body, mac = raw["body"], raw["mac"]
        except (ValueError, KeyError, TypeError):
            raise NodesError(
                f"the value at {key} on the coordinator's store is not tunekit's"
            ) from None
        if not hmac.compare_digest(str(mac), self._mac(key, body)):
            raise NodesError(f"the value at {key} is not signed with this study's node token")
        return json.loads(body)

    def bump(self, key: str) -> int:
        return int(self.store.add(self.prefix + key, 1))

    def count(self, key: str) -> int:
        return int(self.store.add(self.prefix + key, 0))


def _connect(endpoint: Endpoint, master: bool, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(
        endpoint.host,
        endpoint.port,
        is_master=master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


class _Heartbeat:
    """Bumps ``key`` every second on a connection of its own (a store client is not shared across threads)."""

    def __init__(self, endpoint: Endpoint, token: str, key: str):
        self.channel = Channel(_connect(endpoint, False, 30.0), token)
        self.key = key
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tunekit-{key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                self.channel.bump(self.key)
            except Exception:  # the other side closed the store: whoever watches it will see
                return
            self.done.wait(BEAT_S)

    def stop(self) -> None:
        self.done.set()


class _Watch:
    """When another node's heartbeat counter last moved, on this machine's clock."""

    def __init__(self, channel: Channel, key: str):
        self.channel, self.key = channel, key
        self.value = channel.count(key)
        self.moved = time.monotonic()

    def silent_s(self) -> float:
        value = self.channel.count(self.key)
        if value != self.value:
            self.value, self.moved = value, time.monotonic()
        return time.monotonic() - self.moved


def describe_node() -> dict[str, Any]:
    """What a node tells the coordinator about itself when it joins."""
    gpus: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install: the node still joins, with no GPU named
        gpus = []
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cores": psutil.cpu_count(logical=False) or 1,
        "memory_bytes": psutil.virtual_memory().total,
        "gpus": gpus,
    }


# -- a node's files, packed for the store ---------------------------------------------------------


def pack_files(trial_dir: Path, node_rank: int, returncode: int | None) -> dict[str, Any]:
    """The files of ``SHIPPED`` under ``trial_dir`` (the agent's renamed to this node's index)."""
    files = {}
    for pattern in SHIPPED:
        for path in sorted(trial_dir.glob(pattern)):
            name = path.relative_to(trial_dir).as_posix().replace("agent0.", f"agent{node_rank}.")
            name = name.replace("telemetry.json", f"telemetry-node{node_rank}.json")
            files[name] = base64.b64encode(zlib.compress(path.read_bytes())).decode()
    return {"returncode": returncode, "files": files}


def unpack_files(packed: dict[str, Any], trial_dir: Path, node_rank: int) -> None:
    """Write what :func:`pack_files` packed into ``trial_dir``; names that leave it are refused."""
    root = trial_dir.resolve()
    for name, data in (packed.get("files") or {}).items():
        target = (trial_dir / name).resolve()
        if root not in target.parents:
            raise NodesError(f"node {node_rank} sent a file outside its trial folder: {name!r}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(zlib.decompress(base64.b64decode(data)))


# -- the coordinator -----------------------------------------------------------------------------


class Coordinator:
    """The store's host on node 0: announces trials, collects every node's files, watches followers."""

    def __init__(self, endpoint: Endpoint, nnodes: int, token: str, lost_s: float = LOST_S):
        self.endpoint, self.nnodes, self.token, self.lost_s = endpoint, nnodes, token, lost_s
        try:
            self.channel = Channel(_connect(endpoint, True, 30.0), token)
        except Exception as exc:  # the port is taken, or the host is not this machine
            raise NodesError(
                f"cannot host the coordinator at {endpoint}: {_first_line(exc)}"
            ) from None
        self.beat = _Heartbeat(endpoint, token, "coord/beat")
        self.nodes: dict[int, dict[str, Any]] = {}
        """Every follower's hello, by node rank."""
        self.watches: dict[int, _Watch] = {}
        self.gone: dict[int, str] = {}
        """Nodes lost so far, with why."""
        self.jobs = 0

    @property
    def followers(self) -> list[int]:
        return list(range(1, self.nnodes))

    def follow_command(self, node_rank: int, token_hint: str = "") -> str:
        return f"tunekit follow --coordinator {self.endpoint} --node-rank {node_rank}{token_hint}"

    def joined(self) -> list[int]:
        """Followers whose hello has arrived (their liveness watched from then on)."""
        for r in self.followers:
            if r not in self.nodes and (hello := self.channel.get(f"node/{r}/hello")) is not None:
                self.nodes[r] = hello
                self.watches[r] = _Watch(self.channel, f"node/{r}/beat")
        return sorted(self.nodes)

    def wait_for_followers(
        self,
        timeout_s: float,
        token_hint: str = "",
        on_join: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        """Block until every follower has joined; a NodesError naming the missing ones after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen: set[int] = set()
        while True:
            for r in self.joined():
                if r not in seen and on_join is not None:
                    on_join(r, self.nodes[r])
                seen.add(r)
            missing = [r for r in self.followers if r not in self.nodes]
            if not missing:
                return
            if time.monotonic() > deadline:
                names = ("node " if len(missing) == 1 else "nodes ") + ", ".join(
                    str(r) for r in missing
                )
                raise NodesError(
                    f"{names} did not join within {timeout_s:.0f} s: start {'its' if len(missing) == 1 else 'their'} "
                    f"follower (`{self.follow_command(missing[0], token_hint)}`, or the same tunekit command with "
                    f"--node-rank {missing[0]}) with the same node token"
                )
            time.sleep(0.2)

    def describe(self, r: int) -> str:
        host = (self.nodes.get(r) or {}).get("host")
        return f"node {r}" + (f" ({host})" if host else "")

    def lost(self) -> dict[int, str]:
        """Followers that stopped answering (checked now), with why."""
        for r, watch in self.watches.items():
            if r not in self.gone and (silent := watch.silent_s()) > self.lost_s:
                self.gone[r] = (
                    f"{self.describe(r)} stopped answering for {silent:.0f} s: its follower is gone"
                )
        return dict(self.gone)

    def announce_trial(self, spec: dict[str, Any], launch: dict[str, Any]) -> tuple[int, str]:
        """Announce a trial; returns its job number and the static rendezvous (host:port) of its ranks."""
        master = self._master()
        job = self._announce(
            {"kind": "trial", "spec": spec, "launch": {**launch, "master": master}}
        )
        return job, master

    def announce_live(self, run: dict[str, Any], run_id: str, nproc: int) -> tuple[int, str]:
        """Announce a launch of live run ``run_id`` (its run.json); returns the job and its rendezvous."""
        master = self._master()
        job = self._announce(
            {
                "kind": "live",
                "run": run,
                "run_id": run_id,
                "launch": {"nproc": nproc, "nnodes": self.nnodes, "master": master},
            }
        )
        return job, master

    def probe(self, nproc: int, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Every follower measures its own node's collectives on ``nproc`` ranks (cached there);
        returns each one's fits (or its error), leaving out those that did not answer in time."""
        job = self._announce({"kind": "probe", "nproc": nproc})
        replies: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.followers) and time.monotonic() < deadline:
            for r in self.followers:
                if (
                    r not in replies
                    and (body := self.channel.get(f"job/{job}/node/{r}")) is not None
                ):
                    replies[r] = body
            if self.lost():
                break
            time.sleep(0.2)
        return replies

    def wait_for_agents(self, job: int, trial_dir: Path, timeout_s: float) -> dict[int, int | None]:
        """Every follower's exit code for ``job`` (its files written to ``trial_dir``), waiting up to
        ``timeout_s`` for those still running; lost followers are left out."""
        done: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            self.collect(job, trial_dir, done)
            waiting = [r for r in self.followers if r not in done and r not in self.lost()]
            if not waiting or time.monotonic() > deadline:
                return done
            time.sleep(0.2)

    def _master(self) -> str:
        """A fresh static rendezvous for one job's ranks, on this node."""
        from tunekit.runtime.dist import free_port

        return f"{self.endpoint.host}:{free_port()}"

    def how_to_follow(self, token_hint: str) -> str:
        """What to run on the other nodes, said once when the coordinator starts."""
        which = "node 1" if self.nnodes == 2 else f"each node N of 1 to {self.nnodes - 1}"
        command = self.follow_command(1, token_hint)
        if self.nnodes > 2:
            command = command.replace("--node-rank 1", "--node-rank N")
        how = (
            f"copy {token_hint.split()[-1]} there, or set $TUNEKIT_NODE_TOKEN to its content"
            if token_hint
            else "with the same node token"
        )
        return f"coordinating {self.nnodes} nodes at {self.endpoint}: on {which} run `{command}` ({how})"

    def _announce(self, body: dict[str, Any]) -> int:
        job = self.jobs
        self.channel.put(f"job/{job}", body)
        self.jobs = self.channel.bump("jobs")
        return job

    def stop(self, job: int) -> None:
        """Tell every follower to kill trial ``job``'s agent if it still runs."""
        self.channel.put(f"job/{job}/stop", {})

    def collect(self, job: int, trial_dir: Path, done: dict[int, int | None]) -> None:
        """Write the files of every follower that has sent trial ``job``'s into ``trial_dir``
        (``done``: node rank -> its agent's exit code, for those collected so far)."""
        for r in self.followers:
            if r not in done and (packed := self.channel.get(f"job/{job}/node/{r}")) is not None:
                unpack_files(packed, trial_dir, r)
                done[r] = packed.get("returncode")

    def close(self, wait_s: float = 5.0) -> None:
        """Announce the end, give the followers a moment to see it, close the store."""
        try:
            self._announce({"kind": "end"})
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and any(
                self.channel.get(f"node/{r}/bye") is None for r in self.nodes if r not in self.gone
            ):
                time.sleep(0.1)
        except Exception:  # closing anyway
            pass
        self.beat.stop()


def host_coordinator(
    endpoint: str, nnodes: int, token: str | None, store_dir: Path
) -> tuple[Coordinator, str]:
    """Node 0's coordinator, with ``token`` or a fresh one made in ``store_dir``; returns it and how a
    follower gets that token (`` --token-file PATH``, or '' when the token was given)."""
    hint = ""
    if token is None:
        path = make_token(store_dir).resolve()
        token, hint = path.read_text().strip(), f" --token-file {path}"
    return Coordinator(parse_endpoint(endpoint), nnodes, token), hint


def describe_hello(nodes: Coordinator, r: int) -> str:
    """One line on a follower that joined."""
    hello = nodes.nodes.get(r) or {}
    return f"{nodes.describe(r)} joined: {hello.get('cores')} cores, {', '.join(hello.get('gpus') or []) or 'no GPU'}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# -- a follower -----------------------------------------------------------------------------------


class Follower:
    """One node's follower: joins the coordinator's store and runs each announced trial's agent here."""

    def __init__(
        self,
        endpoint: Endpoint,
        node_rank: int,
        token: str,
        work_dir: Path,
        join_timeout_s: float = 300.0,
        lost_s: float = LOST_S,
        say: Callable[[str], None] = print,
    ):
        if node_rank < 1:
            raise NodesError("a follower's node rank is 1 or more (node 0 is the coordinator)")
        self.endpoint, self.node_rank, self.token = endpoint, node_rank, token
        self.work_dir, self.lost_s, self.say = Path(work_dir), lost_s, say
        try:
            self.channel = Channel(_connect(endpoint, False, join_timeout_s), token)
        except Exception as exc:
            raise NodesError(
                f"no coordinator answered at {endpoint} within {join_timeout_s:.0f} s "
                f"({_first_line(exc)})"
            ) from None
        self.beat: _Heartbeat | None = None

    def run(self) -> int:
        """Follow until the coordinator announces the end (0) or is gone (NodesError)."""
        ch = self.channel
        try:
            self.beat = _Heartbeat(self.endpoint, self.token, f"node/{self.node_rank}/beat")
            # What was announced before this follower joined is not its business.
            job = ch.count("jobs")
            ch.put(f"node/{self.node_rank}/hello", describe_node())
            coordinator = _Watch(ch, "coord/beat")
            self.say(f"node {self.node_rank} joined the coordinator at {self.endpoint}")
            while True:
                body = self._next(job, coordinator)
                if body.get("kind") == "end":
                    ch.put(f"node/{self.node_rank}/bye", {})
                    self.say("the coordinator ended the study")
                    return 0
                if body.get("kind") == "trial":
                    self._trial(job, body, coordinator)
                elif body.get("kind") == "live":
                    self._live(job, body, coordinator)
                elif body.get("kind") == "probe":
                    self._probe(job, int(body["nproc"]))
                job += 1
        except NodesError:
            raise
        except Exception as exc:  # the store's connection broke: its host, the coordinator, is gone
            raise NodesError(
                f"lost the coordinator at {self.endpoint} ({_first_line(exc)}); "
                "nothing of this node's is left running"
            ) from None
        finally:
            if self.beat is not None:
                self.beat.stop()

    def _next(self, job: int, coordinator: _Watch) -> dict[str, Any]:
        while (body := self.channel.get(f"job/{job}")) is None:
            self._check(coordinator)
            time.sleep(0.2)
        return body

    def _check(self, coordinator: _Watch) -> None:
        if (silent := coordinator.silent_s()) > self.lost_s:
            raise NodesError(
                f"the coordinator at {self.endpoint} stopped answering for {silent:.0f} s"
            )

    def _trial(self, job: int, body: dict[str, Any], coordinator: _Watch) -> None:
        from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_node_agent

        spec = TrialSpec(**body["spec"])
        launch = dict(body["launch"])
        opts = LaunchOptions(
            nproc=int(launch["nproc"]),
            nnodes=int(launch["nnodes"]),
            node_rank=self.node_rank,
            master=str(launch["master"]),
            threads_per_rank=launch.get("threads_per_rank"),
            env={str(k): str(v) for k, v in (launch.get("env") or {}).items()},
            timeout_s=float(launch.get("timeout_s", 300.0)),
            stall_s=None,
        )
        trial_dir = (self.work_dir / f"job{job:03d}").resolve()
        self.say(f"trial {job}: {spec.workload} on {opts.nproc} rank(s) here")
        (trial_dir / "telemetry.json").unlink(missing_ok=True)
        sampler = None
        # The observed baseline: this node's telemetry goes into the report too.
        if spec.profile_steps:
            from tunekit.observe.telemetry import TelemetrySampler

            sampler = TelemetrySampler(trial_dir / "pids", interval_s=0.5, pyspy_interval_s=2.0)
            sampler.start()
        try:
            rc = asyncio.run(
                run_node_agent(spec, opts, trial_dir, self._stop_check(job, coordinator))
            )
        finally:
            if sampler is not None:
                sampler.stop()
                (trial_dir / "telemetry.json").write_text(json.dumps(sampler.summary()))
        self.channel.put(
            f"job/{job}/node/{self.node_rank}", pack_files(trial_dir, self.node_rank, rc)
        )

    def _live(self, job: int, body: dict[str, Any], coordinator: _Watch) -> None:
        """This node's ranks of a live run (``tunekit run``), in a private copy of its run folder."""
        from tunekit.runtime.rundir import PRIVATE_DIR, RunDir
        from tunekit.trials.launcher import LaunchOptions, run_live_agent

        run_id = str(body["run_id"])
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise NodesError(f"the coordinator named a run {run_id!r} that is no folder name")
        launch = body["launch"]
        rd = RunDir(self.work_dir / "runs" / run_id)
        rd.path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        rd.logs.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        # What its ranks read: workload, config, plugins; the checkpoint comes from rank 0.
        rd.write_run(body["run"])
        opts = LaunchOptions(
            nproc=int(launch["nproc"]),
            nnodes=int(launch["nnodes"]),
            node_rank=self.node_rank,
            master=str(launch["master"]),
            stall_s=None,
            timeout_s=float("inf"),
        )
        log = rd.logs / f"agent-job{job:03d}.log"
        self.say(f"run {run_id}: {opts.nproc} rank(s) here")
        rc = asyncio.run(run_live_agent(rd, opts, log, self._stop_check(job, coordinator)))
        self.channel.put(f"job/{job}/node/{self.node_rank}", {"returncode": rc, "files": {}})

    def _probe(self, job: int, nproc: int) -> None:
        """This node's collectives on ``nproc`` ranks, measured once per node and rank count."""
        from dataclasses import asdict

        cache = self.work_dir / f"probe-{nproc}.json"
        try:
            fits = json.loads(cache.read_text())
        except (OSError, ValueError):
            self.say(f"measuring this node's collectives on {nproc} ranks (once)")
            try:
                from tunekit.observe.probe import probe_hardware

                fits = [asdict(f) for f in probe_hardware(nproc).hardware.collectives]
            except Exception as exc:  # the study goes on without this node's probe
                self.channel.put(f"job/{job}/node/{self.node_rank}", {"error": _first_line(exc)})
                return
            cache.write_text(json.dumps(fits))
        self.channel.put(f"job/{job}/node/{self.node_rank}", {"fits": fits})

    def _stop_check(self, job: int, coordinator: _Watch) -> Callable[[], str | None]:
        def stop_now() -> str | None:
            if self.channel.get(f"job/{job}/stop") is not None:
                return "stopped by the coordinator"
            self._check(coordinator)
            return None

        return stop_now


# -- where this node is: flags, torchrun's variables, SLURM's ----------------------------------------


@dataclass(frozen=True)
class NodePlace:
    nnodes: int
    node_rank: int
    endpoint: str | None


def node_place(
    nnodes: int | None,
    node_rank: int | None,
    endpoint: str | None,
    env: Mapping[str, str] | None = None,
    follower: bool = False,
) -> NodePlace:
    """This node's place from the flags given, else torchrun's conventions (``MASTER_ADDR``/``MASTER_PORT``,
    ``NODE_RANK``, ``NNODES``), else those of a SLURM job step (``srun``: ``SLURM_STEP_NUM_NODES``,
    ``SLURM_NODEID``, the step's first host as the coordinator). Flags win over the environment.

    SLURM's variables count only in a task ``srun`` started: a batch script's own shell sees
    the allocation's node count too, and a ``tunekit auto`` run there alone must not wait for
    followers that nobody started.
    """
    env = os.environ if env is None else env
    step = env.get("SLURM_STEP_ID") is not None and env.get("SLURM_STEP_NUM_NODES")
    if endpoint is None and env.get("MASTER_ADDR"):
        endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT') or DEFAULT_PORT}"
    if nnodes is None:
        nnodes = _int_env(env, "NNODES") or (
            _int_env(env, "SLURM_STEP_NUM_NODES") if step else None
        )
    # A follower may not know the node count; a wrong one is still an error.
    known = nnodes is not None
    nnodes = nnodes or 1
    if node_rank is None:
        node_rank = _int_env(env, "NODE_RANK")
        if node_rank is None and step:
            node_rank = _int_env(env, "SLURM_NODEID")
        node_rank = node_rank or 0
    if (
        endpoint is None
        and (nnodes > 1 or follower)
        and step
        and (nodelist := env.get("SLURM_STEP_NODELIST"))
    ):
        endpoint = f"{first_host(nodelist)}:{env.get('MASTER_PORT') or DEFAULT_PORT}"
    if follower and not known:
        return NodePlace(max(nnodes, node_rank + 1), node_rank, endpoint)
    if node_rank >= nnodes:
        raise NodesError(f"node rank {node_rank} is not below the node count {nnodes}")
    if (nnodes > 1 or follower and node_rank > 0) and not endpoint:
        raise NodesError(
            "several nodes need the coordinator's address: --rdzv-endpoint HOST:PORT "
            "(or MASTER_ADDR/MASTER_PORT, or srun inside a SLURM allocation)"
        )
    return NodePlace(nnodes, node_rank, endpoint)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise NodesError(f"${name} must be a whole number, not {value!r}")
    return int(value)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    text = nodelist.strip()
    head, bracket, rest = text.partition("[")
    if "," in head:  # the first entry has no range
        return head.split(",")[0]
    if not bracket:
        return head
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return head + first


# -- what each node brought to the baseline ----------------------------------------------------------


def node_summary(
    hellos: Mapping[int, dict[str, Any]],
    nproc: int,
    compute_s: Mapping[int, float],
    telemetry: Mapping[int, dict[str, Any] | None],
    probes: Mapping[int, list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """One row per node (host, cores, GPUs, its ranks' compute per step, CPU use) and the slowest node.

    ``compute_s``: each global rank's compute per step in the baseline's profiled steps (node
    ``r`` holds ranks ``r * nproc`` on); ``telemetry``: each node's sampler summary; ``probes``:
    each node's measured collective fits (its all-reduce among its own ranks is reported).
    """
    rows: list[dict[str, Any]] = []
    for r in sorted(hellos):
        mine = [compute_s[k] for k in range(r * nproc, (r + 1) * nproc) if k in compute_s]
        host = (telemetry.get(r) or {}).get("host") or {}
        rows.append(
            {
                "node": r,
                "host": hellos[r].get("host"),
                "cores": hellos[r].get("cores"),
                "gpus": hellos[r].get("gpus") or [],
                "compute_s": sum(mine) / len(mine) if mine else None,
                "cpu_pct_mean": host.get("system_cpu_pct_mean"),
                "all_reduce_gbps": _all_reduce_gbps((probes or {}).get(r)),
            }
        )
    timed = [row for row in rows if row["compute_s"]]
    out: dict[str, Any] = {"rows": rows}
    if len(timed) >= 2:
        slow, fast = (
            max(timed, key=lambda x: x["compute_s"]),
            min(timed, key=lambda x: x["compute_s"]),
        )
        out["slowest"] = {
            "node": slow["node"],
            "host": slow["host"],
            "ratio": slow["compute_s"] / fast["compute_s"],
            "fastest": fast["node"],
        }
    return out


def _all_reduce_gbps(fits: list[dict[str, Any]] | None) -> float | None:
    bandwidths = [f["bandwidth"] for f in fits or [] if f.get("op") == "all_reduce"]
    return max(bandwidths) / 1e9 if bandwidths else None


ALIKE = 1.05
"""Nodes whose ranks' compute per step differ less than this are not told apart."""


def describe_slowest(summary: Mapping[str, Any]) -> str:
    """One line naming the slowest node, or ''."""
    slow = summary.get("slowest")
    if not slow:
        return ""
    if slow["ratio"] < ALIKE:
        return f"the nodes' ranks computed alike (within {ALIKE - 1:.0%} per step): no node holds the others back"
    return (
        f"slowest node: node {slow['node']} ({slow['host']}), whose ranks compute {slow['ratio']:.2f}x as long "
        f"per step as node {slow['fastest']}'s; every step waits for it"
    )
