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

Anyone who reaches the port can list, read, write and delete the store's keys
(a TCPStore has no access control). So every value, heartbeats included, is
sealed: encrypted and authenticated with AES-256-GCM under a key derived from
the node token, bound to its key, to this run of the coordinator (a nonce it
draws at start) and to a sequence number that only grows. A value that fails
the check (forged, written with another token, moved from another key, replayed
from another run or from earlier in this one) is ignored, counted and said,
never acted on and never fatal. A reader of the port sees the key names below,
the size of each value and when it changes; nothing of what they hold.

Joining is a handshake that proves freshness both ways: the coordinator
publishes its run nonce (``run``, re-sealed every second); a follower answers
with a hello bound to that nonce and carrying a nonce of its own; the
coordinator's welcome, bound to its run, echoes the follower's nonce. A
follower whose token is not the coordinator's cannot open ``run``: it says so
and leaves a hello that the coordinator reports as a node that failed to
authenticate.

Liveness: each side re-seals a heartbeat every second and watches the other's
sequence number move on its own clock (clocks of different machines are never
compared). A follower whose heartbeat stands still for ``LOST_S`` is lost; a
follower whose coordinator is gone (its store closed, or its heartbeat still)
kills its agent and exits.

Keys, under ``tunekit/``::

    run                 the coordinator's run nonce (bound to no run: it names the run)
    coord/beat          the coordinator's heartbeat
    node/<r>/hello      a follower's hello: host, pid, cores, GPUs, its nonce
    node/<r>/welcome    the coordinator's answer: the follower's nonce, the next job number
    node/<r>/beat       the follower's heartbeat
    node/<r>/bye        it saw the end
    job/<n>             the n-th announcement: {"kind": "trial", ...} or {"kind": "end"}
    job/<n>/stop        the coordinator stopped job n: kill its agent now
    job/<n>/node/<r>    node r's files and its agent's exit code for job n (deleted once read)

One module, though long: the coordinator and the follower are the two ends of
one protocol on the store above; their keys and messages are read in one place.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import json
import os
import secrets
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

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


# -- sealed values on the store ---------------------------------------------------------------

PREFIX = "tunekit/"
"""Every key of the protocol is under this prefix. It hides nothing (a reader of the port lists
the keys): the values are what is protected."""
_HEAD = struct.Struct(">4sQ12s")
"""A sealed value starts with: magic, sequence number, AES-GCM nonce."""
_MAGIC = b"tk2\n"
_ABSENT = b"\x00tunekit: no value here"
"""What :meth:`Channel._raw` reads for a key that is not there (see there)."""
SAID_REFUSALS = 10
"""Refused values said one by one; past these they are only counted."""


def _cipher(token: str) -> AESGCM:
    """AES-256-GCM under a key derived from the node token (HKDF-SHA256)."""
    key = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=None, info=b"tunekit node store v2"
    ).derive(token.encode())
    return AESGCM(key)


@dataclass(frozen=True)
class Refused:
    """A value that failed the check, and why."""

    key: str
    raw: bytes
    why: str
    sealed_otherwise: bool = False
    """It is a tunekit value that does not open: sealed with another token, for another run or
    another key (not garbage, not a replay)."""


class Refusals:
    """Values on the store that failed the check: ignored, counted, and the first few said.

    A value is counted once however often it is read again (the follower polls the key it
    waits on); another value at the same key counts again.
    """

    def __init__(self, say: Callable[[str], None] | None = None):
        self.say = say
        self.count = 0
        self._last: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def refuse(self, refused: Refused, message: str | None = None) -> bool:
        """Count ``refused`` (once); True when it had not been counted before."""
        digest = hashlib.sha256(refused.raw).digest()
        with self._lock:
            if self._last.get(refused.key) == digest:
                return False
            self._last[refused.key] = digest
            self.count += 1
            tell = self.count <= SAID_REFUSALS
        if tell and self.say is not None:
            text = (
                message
                or f"ignored the value at {refused.key} on the coordinator's store: {refused.why}"
            )
            self.say(
                text + ("" if self.count < SAID_REFUSALS else " (further ones are only counted)")
            )
        return True

    def accepted(self, key: str) -> None:
        with self._lock:
            self._last.pop(key, None)

    def summary(self) -> str:
        """One line on the values refused so far, or ''."""
        if not self.count:
            return ""
        return (
            f"{self.count} value(s) on the coordinator's store failed the node token's check and "
            "were ignored: another process that reaches the store's port wrote them"
        )


class Channel:
    """Sealed JSON values on a TCPStore: encrypted and authenticated with the node token, each
    bound to its key, to one run of the coordinator and to its sequence number."""

    def __init__(self, store, token: str, run: str = "", refusals: Refusals | None = None):
        self.store = store
        self.cipher = _cipher(token)
        self.run = run
        """The run nonce values are bound to ('' for ``run`` itself, which names it)."""
        self.refusals = refusals if refusals is not None else Refusals()
        self._seq = 0
        self._seen: dict[str, int] = {}
        """The newest sequence number accepted at each key: an older value there is a replay."""

    def bound(self, run: str) -> Channel:
        """The same store, token and refusals, for values of run ``run``."""
        channel = copy.copy(self)
        channel.run, channel._seq, channel._seen = run, 0, {}
        return channel

    def _aad(self, key: str, seq: int) -> bytes:
        return b"\0".join((b"tunekit-nodes/2", self.run.encode(), key.encode(), b"%d" % seq))

    def put(self, key: str, value: dict[str, Any]) -> None:
        # The wall clock only seeds the count, so that a restarted writer is not taken for a
        # replay of its earlier self; it grows by one whatever the clock does.
        self._seq = max(self._seq + 1, time.time_ns())
        nonce = secrets.token_bytes(12)
        sealed = self.cipher.encrypt(nonce, json.dumps(value).encode(), self._aad(key, self._seq))
        self.store.set(PREFIX + key, _HEAD.pack(_MAGIC, self._seq, nonce) + sealed)

    def _raw(self, key: str) -> bytes | None:
        # compare_set with an expected value nobody writes: the value, or _ABSENT when there is
        # none, without waiting (get() would block until the key exists: a key deleted between
        # check() and get() would hang the reader).
        raw = bytes(self.store.compare_set(PREFIX + key, _ABSENT, _ABSENT))
        return None if raw == _ABSENT else raw

    def open(self, key: str) -> tuple[int, dict[str, Any]] | Refused | None:
        """The value at ``key`` with its sequence number, None while there is none, or why it
        was refused. Refusals are neither counted nor said here (see :meth:`read`)."""
        raw = self._raw(key)
        if raw is None:
            return None
        if len(raw) < _HEAD.size or raw[:4] != _MAGIC:
            return Refused(key, raw, "it is not a tunekit value")
        _, seq, nonce = _HEAD.unpack_from(raw)
        if seq < self._seen.get(key, 0):
            return Refused(key, raw, "it is an earlier value written again (a replay)")
        try:
            body = json.loads(self.cipher.decrypt(nonce, raw[_HEAD.size :], self._aad(key, seq)))
        except InvalidTag:
            return Refused(
                key,
                raw,
                "it is not sealed with this study's node token for this run and this key",
                sealed_otherwise=True,
            )
        if not isinstance(body, dict):
            return Refused(key, raw, "it holds no tunekit message")
        self._seen[key] = seq
        self.refusals.accepted(key)
        return seq, body

    def read(self, key: str) -> tuple[int, dict[str, Any]] | None:
        """:meth:`open`, with a refused value counted, said and read as no value."""
        opened = self.open(key)
        if isinstance(opened, Refused):
            self.refusals.refuse(opened)
            return None
        return opened

    def get(self, key: str) -> dict[str, Any] | None:
        """The value at ``key``; None while there is none, or when it failed the check."""
        found = self.read(key)
        return None if found is None else found[1]

    def drop(self, key: str) -> None:
        self.store.delete_key(PREFIX + key)


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
    """Seals a fresh value at ``key`` every second, on a connection of its own (a store client
    is not shared across threads). The coordinator's also re-seals ``run``: a value another
    process wrote over it is repaired within a second."""

    def __init__(self, endpoint: Endpoint, token: str, run: str, key: str, names_run: bool = False):
        boot = Channel(_connect(endpoint, False, 30.0), token)
        self.channel = boot.bound(run)
        self.names = boot if names_run else None
        self.key = key
        self._beat()  # the first one now: a follower may read it at once
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tunekit-{key}", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        if self.names is not None:
            self.names.put("run", {"run": self.channel.run})
        self.channel.put(self.key, {})

    def _run(self) -> None:
        while not self.done.wait(BEAT_S):
            try:
                self._beat()
            except Exception:  # the other side closed the store: whoever watches it will see
                return

    def stop(self) -> None:
        self.done.set()


class _Watch:
    """When another node's heartbeat last moved (a sealed value with a newer sequence
    number), on this machine's clock."""

    def __init__(self, channel: Channel, key: str):
        self.channel, self.key = channel, key
        found = channel.read(key)
        self.seq = found[0] if found else 0
        self.moved = time.monotonic()

    def silent_s(self) -> float:
        found = self.channel.read(self.key)
        if found is not None and found[0] > self.seq:
            self.seq, self.moved = found[0], time.monotonic()
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

    def __init__(
        self,
        endpoint: Endpoint,
        nnodes: int,
        token: str,
        lost_s: float = LOST_S,
        say: Callable[[str], None] | None = None,
    ):
        """``say``: where a refused value and a node that failed to authenticate are told (from
        whichever thread reads the store)."""
        self.endpoint, self.nnodes, self.token, self.lost_s = endpoint, nnodes, token, lost_s
        self.run = secrets.token_hex(16)
        """This run's nonce: every value of it is bound to it, so none of another run counts."""
        self.refusals = Refusals(say)
        try:
            store = _connect(endpoint, True, 30.0)
        except Exception as exc:  # the port is taken, or the host is not this machine
            raise NodesError(
                f"cannot host the coordinator at {endpoint}: {_first_line(exc)}"
            ) from None
        self.channel = Channel(store, token, self.run, self.refusals)
        self.beat = _Heartbeat(endpoint, token, self.run, "coord/beat", names_run=True)
        self.nodes: dict[int, dict[str, Any]] = {}
        """Every follower's hello, by node rank."""
        self.watches: dict[int, _Watch] = {}
        self.gone: dict[int, str] = {}
        """Nodes lost so far, with why."""
        self.unauthenticated: dict[int, str] = {}
        """Nodes whose hello failed the check (another token, most likely), with why."""
        self.jobs = 0

    @property
    def followers(self) -> list[int]:
        return list(range(1, self.nnodes))

    def follow_command(self, node_rank: int, token_hint: str = "") -> str:
        return f"tunekit follow --coordinator {self.endpoint} --node-rank {node_rank}{token_hint}"

    def joined(self) -> list[int]:
        """Followers whose hello has arrived, each welcomed (its liveness watched from then on);
        a hello that fails the check is said once as a node that failed to authenticate."""
        for r in self.followers:
            if r in self.nodes:
                continue
            opened = self.channel.open(f"node/{r}/hello")
            if isinstance(opened, Refused):
                why = f"its hello {opened.why.removeprefix('it ')}"
                self.unauthenticated[r] = why
                self.refusals.refuse(
                    opened,
                    f"node {r} failed to authenticate: {why} (was its follower given another "
                    "node token?)",
                )
            elif opened is not None:
                hello = opened[1]
                self.unauthenticated.pop(r, None)
                self.nodes[r] = {k: v for k, v in hello.items() if k != "nonce"}
                self.watches[r] = _Watch(self.channel, f"node/{r}/beat")
                self.channel.put(
                    f"node/{r}/welcome", {"nonce": hello.get("nonce"), "jobs": self.jobs}
                )
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
                failed = "; ".join(
                    f"node {r} failed to authenticate ({self.unauthenticated[r]})"
                    for r in missing
                    if r in self.unauthenticated
                )
                raise NodesError(
                    f"{names} did not join within {timeout_s:.0f} s"
                    + (f" ({failed})" if failed else "")
                    + f": start {'its' if len(missing) == 1 else 'their'} "
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
        self.jobs += 1
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
                self.channel.drop(f"job/{job}/node/{r}")  # the store holds no node's files longer

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
    endpoint: str,
    nnodes: int,
    token: str | None,
    store_dir: Path,
    say: Callable[[str], None] | None = None,
) -> tuple[Coordinator, str]:
    """Node 0's coordinator, with ``token`` or a fresh one made in ``store_dir``; returns it and how a
    follower gets that token (`` --token-file PATH``, or '' when the token was given). ``say``:
    where refused values are told."""
    hint = ""
    if token is None:
        path = make_token(store_dir).resolve()
        token, hint = path.read_text().strip(), f" --token-file {path}"
    return Coordinator(parse_endpoint(endpoint), nnodes, token, say=say), hint


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
        self.join_timeout_s = join_timeout_s
        self.refusals = Refusals(say)
        try:
            self.boot = Channel(_connect(endpoint, False, join_timeout_s), token, "", self.refusals)
        except Exception as exc:
            raise NodesError(
                f"no coordinator answered at {endpoint} within {join_timeout_s:.0f} s "
                f"({_first_line(exc)})"
            ) from None
        self.channel = self.boot
        self.beat: _Heartbeat | None = None

    def run(self) -> int:
        """Follow until the coordinator announces the end (0) or is gone (NodesError)."""
        try:
            job = self._join()
            ch = self.channel
            self.beat = _Heartbeat(self.endpoint, self.token, ch.run, f"node/{self.node_rank}/beat")
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
            if summary := self.refusals.summary():
                self.say(summary)

    WRONG_TOKEN_S = 3.0
    """How long ``run`` may fail the check before this node's token is taken to be the wrong
    one (another process may have written over it: the coordinator repairs it every second)."""

    def _join(self) -> int:
        """The handshake (see the module's docstring); returns the first job that is this
        node's business (what was announced before it joined is not)."""
        r = self.node_rank
        mine = secrets.token_hex(16)
        deadline = time.monotonic() + self.join_timeout_s
        failing_since: float | None = None
        while True:
            opened = self.boot.open("run")
            if isinstance(opened, Refused) and not opened.sealed_otherwise:
                self.refusals.refuse(opened)  # garbage, or a replay: not a question of tokens
            elif isinstance(opened, Refused):
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > self.WRONG_TOKEN_S:
                    # Leave a hello the coordinator will fail to open: it says which node it was.
                    self.boot.put(f"node/{r}/hello", {"nonce": mine})
                    raise NodesError(
                        f"node {r} does not hold the coordinator's node token: the values of the "
                        f"coordinator at {self.endpoint} do not open with it; give this node the "
                        "coordinator's token (--token-file FILE, or $TUNEKIT_NODE_TOKEN)"
                    )
            elif opened is not None:
                failing_since = None
                run = str(opened[1].get("run"))
                if run != self.channel.run:  # the first, or one written over a stale one
                    self.channel = self.boot.bound(run)
                    self.channel.put(f"node/{r}/hello", {**describe_node(), "nonce": mine})
            if self.channel.run:
                welcome = self.channel.get(f"node/{r}/welcome")
                if welcome is not None and welcome.get("nonce") == mine:
                    return int(welcome.get("jobs") or 0)
            if time.monotonic() > deadline:
                raise NodesError(
                    f"the coordinator at {self.endpoint} did not welcome node {r} within "
                    f"{self.join_timeout_s:.0f} s (is another follower running as node {r}?)"
                )
            time.sleep(0.2)

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
