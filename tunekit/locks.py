"""Exclusive locks that say who holds them.

A lock is ``fcntl.flock`` on a file, so the kernel releases it when its holder
exits, however it exits (``kill -9`` included): a lock can never be left
behind by a dead process. The holder writes who it is into the file (pid,
what it is doing, since when), which a refused process reads to say who is in
its way. The descriptor is not inherited by child processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from tunekit.errors import TunekitError


class LockHeld(TunekitError):
    """Another process holds the lock; ``holder`` is what it wrote about itself."""

    def __init__(self, path: Path, holder: dict[str, Any]):
        self.path = path
        self.holder = holder
        super().__init__(f"{path} is held by {describe_holder(holder)}")


def describe_holder(holder: dict[str, Any]) -> str:
    """``tunekit auto (pid 1234 on host) since 14:02:11``, or what is known of it."""
    if not holder.get("pid"):
        return "another process"
    what = holder.get("role") or "a process"
    host = (
        f" on {holder['host']}"
        if holder.get("host") and holder["host"] != socket.gethostname()
        else ""
    )
    since = (
        f" since {time.strftime('%H:%M:%S', time.localtime(holder['since']))}"
        if holder.get("since")
        else ""
    )
    return f"{what} (pid {holder['pid']}{host}){since}"


def read_holder(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class FileLock:
    """An exclusive, non-blocking lock on ``path`` (created 0600 if missing)."""

    def __init__(self, path: str | Path, role: str, **details: Any):
        self.path = Path(path)
        self.info = {"pid": os.getpid(), "host": socket.gethostname(), "role": role, **details}
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> FileLock:
        """Take the lock now or raise :class:`LockHeld` naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeld(self.path, read_holder(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.update()
        return self

    def update(self, **details: Any) -> None:
        """Rewrite what the file says about the holder (it still holds the lock)."""
        if self._fd is None:
            return
        self.info.update(details, since=self.info.get("since") or time.time())
        data = json.dumps(self.info).encode()
        with contextlib.suppress(OSError):  # the lock holds even where the note cannot be written
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_if_held(path: str | Path) -> dict[str, Any] | None:
    """Who holds ``path`` now, or None when nobody does (or it does not exist)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(Path(path))
    finally:
        os.close(fd)
    return None
