"""A live run's directory: state, metrics, events, checkpoints, logs.

    .tunekit/runs/<id>/
        run.json         what to run: workload, ranks, config, steps (the supervisor's input)
        status.json      what runs now: status, step, config (rank 0 rewrites it every step)
        metrics.jsonl    one line per step: step, loss, step_s, samples_per_s, config_id
        events.jsonl     applies, watch verdicts, rollbacks, trials, relaunches
        checkpoints/     step-<N>.pt (rank 0's session; data-parallel replicas are identical),
                         or step-<N>.dcp/ for a sharded job (every rank's shard, DCP)
        logs/            torchrun agent logs
        pids/            rank<R>: each rank's pid (telemetry samples them)
        control.sock     rank 0's control socket (mode 0600; elsewhere, see choose_socket_path)
        token            the socket's shared secret
        relaunch.json    left by rank 0 for the supervisor when a change needs new processes
        supervisor.lock  held by the `tunekit run` that supervises the run
        rank0.lock       held by the job's rank 0 while it trains

The folder is private (0700) and every file in it is created 0600: the token
and checkpoints steer the job. Every file is written atomically (temporary
file, then rename) or appended a line at a time, so a crash leaves the
directory consistent; when the folder itself has become read-only, an existing
file is rewritten in place rather than not at all. On a full disk a write
fails whole: the last good file stays, no temporary file is left behind, and
a line that did not fit is cut back off so that the lines after it still read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from tunekit.errors import ControlError, TunekitError

RUNS_DIR = "runs"
KEEP_CHECKPOINTS = 3
_SOCKET_MAX = 100  # sun_path is 108 bytes on Linux
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


class CheckpointError(TunekitError):
    """A checkpoint could not be written (or its folder read)."""


@contextlib.contextmanager
def private_file(path: Path, append: bool = False, binary: bool = False) -> Iterator[IO]:
    """Open ``path`` for writing, created 0600 whatever the umask (never through a symlink)."""
    flags = (
        os.O_WRONLY
        | os.O_CREAT
        | (os.O_APPEND if append else os.O_TRUNC)
        | getattr(os, "O_NOFOLLOW", 0)
    )
    fd = os.open(path, flags, PRIVATE_FILE)
    with open(fd, ("a" if append else "w") + ("b" if binary else "")) as f:
        yield f


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with private_file(tmp) as f:
            f.write(text)
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not path.exists():
            raise  # a full disk among them: the last good file stays as it was
        # The folder has become read-only but the file is not: rewrite it in place
        # (a reader may see it half-written once) rather than lose the update.
        with private_file(path) as f:
            f.write(text)


def _append_line(path: Path, line: str) -> None:
    """Append ``line`` whole or not at all: what a full disk let through is cut back off."""
    data = line.encode()
    fd = os.open(
        path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), PRIVATE_FILE
    )
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def is_private_folder(path: Path) -> bool:
    """Whether ``path`` is a real folder (no symlink) of this user that nobody else may enter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def private_socket_folder() -> Path:
    """A folder for sockets that only this user can write: verified, or made fresh.

    ``$XDG_RUNTIME_DIR/tunekit`` or ``<tmp>/tunekit-<uid>`` when they exist (or can be
    made) as this user's own, mode 0700, and not a symlink; otherwise (another user
    made one first, or it is open to others) a fresh ``mkdtemp`` folder.
    """
    bases = (
        [Path(os.environ["XDG_RUNTIME_DIR"]) / "tunekit"]
        if os.environ.get("XDG_RUNTIME_DIR")
        else []
    )
    bases.append(Path(tempfile.gettempdir()) / f"tunekit-{os.geteuid()}")
    for folder in bases:
        with contextlib.suppress(OSError):
            folder.mkdir(mode=PRIVATE_DIR)
        if is_private_folder(folder):
            return folder
    return Path(tempfile.mkdtemp(prefix=f"tunekit-{os.geteuid()}-"))


_STATUS_READS = 5
"""Reads of a half-written status file before the last good one stands in for it."""


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        self._last_status: dict[str, Any] | None = None  # what read_status last read whole

    # -- locations -------------------------------------------------------------------

    @property
    def run_file(self) -> Path:
        return self.path / "run.json"

    @property
    def status_file(self) -> Path:
        return self.path / "status.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def token_file(self) -> Path:
        return self.path / "token"

    @property
    def relaunch_file(self) -> Path:
        return self.path / "relaunch.json"

    @property
    def stop_request_file(self) -> Path:
        """A stop asked for between launches: the supervisor stops instead of relaunching."""
        return self.path / "stop-request.json"

    @property
    def supervisor_lock(self) -> Path:
        return self.path / "supervisor.lock"

    @property
    def rank0_lock(self) -> Path:
        return self.path / "rank0.lock"

    def choose_socket_path(self) -> Path:
        """``control.sock`` in the run directory, or one in a private folder when that path is
        too long for a socket. The server records its choice in run.json (``socket``)."""
        inside = self.path / "control.sock"
        if len(str(inside)) <= _SOCKET_MAX:
            return inside
        name = f"{hashlib.sha256(str(self.path).encode()).hexdigest()[:16]}.sock"
        path = private_socket_folder() / name
        if len(str(path)) > _SOCKET_MAX:
            raise ControlError(
                f"no socket path short enough for run {self.run_id}: {path} is too long "
                "(set TMPDIR to a shorter folder)"
            )
        return path

    def socket_file(self) -> Path:
        """Where clients find the job's socket (what the server recorded)."""
        return Path(self.read_run().get("socket") or self.path / "control.sock")

    # -- creation and lookup -----------------------------------------------------------

    @classmethod
    def create(cls, store_dir: Path, spec: dict[str, Any], name: str | None = None) -> RunDir:
        run_id = name or time.strftime("%Y%m%d-%H%M%S") + f"-{secrets.token_hex(2)}"
        rd = cls(Path(store_dir) / RUNS_DIR / run_id)
        rd.path.parent.mkdir(parents=True, exist_ok=True)
        rd.path.mkdir(mode=PRIVATE_DIR)  # private before anything goes in
        rd.checkpoints.mkdir(mode=PRIVATE_DIR)
        rd.logs.mkdir(mode=PRIVATE_DIR)
        fd = os.open(rd.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
        with open(fd, "w") as f:
            f.write(secrets.token_hex(32))
        rd.write_run({**spec, "id": run_id, "created": time.time()})
        return rd

    @classmethod
    def find(cls, run: str | Path, store_dir: Path = Path(".tunekit")) -> RunDir:
        """A run by path, by id under ``store_dir/runs``, or ``latest``."""
        candidates = [Path(run), Path(store_dir) / RUNS_DIR / str(run)]
        if str(run) == "latest":
            runs = sorted(
                (Path(store_dir) / RUNS_DIR).glob("*/run.json"), key=lambda p: p.stat().st_mtime
            )
            candidates = [runs[-1].parent] if runs else []
        for c in candidates:
            if (c / "run.json").is_file():
                return cls(c)
        raise ControlError(f"no run {str(run)!r} (give a run directory, a run id or 'latest')")

    @property
    def run_id(self) -> str:
        return self.path.name

    # -- state -------------------------------------------------------------------------

    def read_run(self) -> dict[str, Any]:
        return json.loads(self.run_file.read_text())

    def write_run(self, data: dict[str, Any]) -> None:
        _atomic_write(self.run_file, json.dumps(data, indent=2))

    def update_run(self, **fields: Any) -> dict[str, Any]:
        data = {**self.read_run(), **fields}
        self.write_run(data)
        return data

    def read_status(self) -> dict[str, Any]:
        """The job's last status; ``{"status": "starting"}`` before it wrote one.

        In a run folder that became read-only the file is rewritten in place, and a read
        can meet it half-written: it is read again a moment later, and if it is still
        unreadable the last status this object read stands in for it."""
        for _ in range(_STATUS_READS):
            try:
                status = json.loads(self.status_file.read_text())
            except FileNotFoundError:
                return {"status": "starting"}
            except json.JSONDecodeError:
                time.sleep(0.02)
                continue
            self._last_status = status
            return status
        return self._last_status or {"status": "starting"}

    def write_status(self, status: dict[str, Any]) -> None:
        _atomic_write(self.status_file, json.dumps({**status, "updated": time.time()}))

    def write_relaunch(self, plan: dict[str, Any]) -> None:
        _atomic_write(self.relaunch_file, json.dumps(plan))

    def write_stop_request(self, request: dict[str, Any]) -> None:
        _atomic_write(self.stop_request_file, json.dumps(request))

    def token(self) -> str:
        return self.token_file.read_text().strip()

    # -- streams -----------------------------------------------------------------------

    def append_metric(self, record: dict[str, Any]) -> None:
        _append_line(self.metrics_file, json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_file.exists():
            return []
        out = []
        for line in self.metrics_file.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash: everything before it stands
        return out

    def truncate_metrics(self, before_step: int) -> None:
        """Keep only steps below ``before_step`` (a resume replays the rest)."""
        kept = [m for m in self.read_metrics() if m["step"] < before_step]
        _atomic_write(self.metrics_file, "".join(json.dumps(m) + "\n" for m in kept))

    def log_event(self, kind: str, **payload: Any) -> dict[str, Any]:
        event = {"t": time.time(), "kind": kind, **payload}
        _append_line(self.events_file, json.dumps(event, default=str) + "\n")
        return event

    def read_events(self) -> list[dict[str, Any]]:
        if not self.events_file.exists():
            return []
        return [
            json.loads(line) for line in self.events_file.read_text().splitlines() if line.strip()
        ]

    # -- checkpoints -------------------------------------------------------------------

    def save_checkpoint(
        self, step: int, state: dict[str, Any], keep: tuple[Path, ...] = ()
    ) -> Path:
        """Write ``step-<N>.pt``; then drop all but the newest few and those in ``keep``.

        Raises CheckpointError (and leaves the checkpoints there untouched) when it
        cannot be written: a full disk, a read-only folder.
        """
        path = self.checkpoints / f"step-{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        import torch  # here: the control commands read run folders without importing torch

        try:
            with private_file(tmp, binary=True) as f:
                torch.save(state, f)
            tmp.replace(path)
        except (OSError, RuntimeError) as exc:  # torch reports a failed write as RuntimeError
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from None
        self._rotate(path, keep)
        return path

    def sharded_checkpoint_path(self, step: int) -> Path:
        """Where every rank of a sharded job writes its part of step ``step``'s checkpoint
        (a folder, ``step-<N>.dcp``: see :mod:`tunekit.runtime.checkpoint`)."""
        return self.checkpoints / f"step-{step:08d}.dcp"

    def commit_sharded(self, written: Path, final: Path, keep: tuple[Path, ...] = ()) -> Path:
        """A sharded checkpoint every rank has written into ``written``: made the newest
        (``final``) at once, then the old ones rotated as :meth:`save_checkpoint` does."""
        import shutil

        try:
            if final.exists():
                shutil.rmtree(final)
            written.rename(final)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoint {final}: {exc}") from None
        self._rotate(final, keep)
        return final

    def _rotate(self, newest: Path, keep: tuple[Path, ...]) -> None:
        import shutil

        kept = {Path(k).resolve() for k in keep}
        for old in self.checkpoint_files()[:-KEEP_CHECKPOINTS]:
            if old != newest and old.resolve() not in kept:
                with contextlib.suppress(OSError):
                    if old.is_dir():
                        shutil.rmtree(old)
                    else:
                        old.unlink(missing_ok=True)

    def checkpoint_files(self) -> list[Path]:
        """Every ``step-<N>.pt`` (and sharded ``step-<N>.dcp`` folder), oldest first;
        CheckpointError when the folder cannot be read."""
        try:
            return sorted(
                p
                for p in self.checkpoints.iterdir()
                if p.name.startswith("step-") and (p.suffix == ".pt" or p.suffix == ".dcp")
            )
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(
                f"cannot read the checkpoints of run {self.run_id}: {exc}"
            ) from None

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoint_files()
        return found[-1] if found else None

    @staticmethod
    def load_checkpoint(path: Path | BinaryIO) -> dict[str, Any]:
        import torch

        # Tensors, numbers and strings only: nothing is unpickled beyond that.
        return torch.load(path, map_location="cpu", weights_only=True)


class LossyStream(io.TextIOBase):
    """A rank's stdout or stderr, written straight to its descriptor, unbuffered.

    A rank's output goes to the agent's log, a file in the run folder: on a full disk
    ``print`` would raise in the middle of a step, and a buffer left unflushed at exit would
    end the rank with status 120. Here a line that cannot be written is lost, not the rank.
    """

    encoding = "utf-8"

    def __init__(self, fd: int):
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError):
            os.write(self._fd, text.encode(errors="replace"))
        return len(text)
