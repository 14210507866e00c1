"""A child process's output, kept to a bounded size on disk and in memory.

A workload may print without limit (a gigabyte per rank was seen). Its
output is piped through tunekit, which keeps the first ``head_bytes`` in the
log file as they come and only the last ``tail_bytes`` in memory, and at the
end writes that tail after a line saying how much was dropped between them.
Whoever reads the log reads its tail only (:func:`read_tail`).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

HEAD_BYTES = 64 * 1024
"""Kept from the start of a process's output: how it started (versions, settings, the first warnings)."""
TAIL_BYTES = 1024 * 1024
"""Kept from the end: how it ended (the traceback, torchrun's summary)."""
_CHUNK = 64 * 1024


@dataclass
class OutputRecord:
    """What a log file holds of a process's output: goes into the trial's record."""

    log: str
    """The log file's name."""
    bytes: int
    """Bytes the process wrote."""
    kept_bytes: int
    """Bytes of it in the log file."""
    dropped_bytes: int
    """Bytes dropped between the kept head and tail (0: the log is complete)."""

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.log}: {_size(self.bytes)} of output; kept its start and end ({_size(self.kept_bytes)}), "
            f"dropped {_size(self.dropped_bytes)} between them"
        )


class CappedLog:
    """Writes a stream's head to ``path`` as it comes and keeps its tail in memory until :meth:`close`
    (``append``: after what ``path`` holds, which counts towards no cap)."""

    def __init__(
        self,
        path: Path,
        head_bytes: int = HEAD_BYTES,
        tail_bytes: int = TAIL_BYTES,
        append: bool = False,
    ):
        self.path = Path(path)
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        self.file = open(self.path, "ab" if append else "wb")  # noqa: SIM115 - closed in close()
        self.total = 0
        self.tail: deque[bytes] = deque()
        self.tail_size = 0
        self.record: OutputRecord | None = None

    def note(self, text: str) -> None:
        """A line of tunekit's own in the log (not the process's output: outside the cap)."""
        self.file.write(f"\n[tunekit: {text}]\n".encode())

    def write(self, data: bytes) -> None:
        room = max(0, self.head_bytes - self.total)
        self.total += len(data)
        if room:
            self.file.write(data[:room])
            data = data[room:]
        if not data:
            return
        self.tail.append(data)
        self.tail_size += len(data)
        while (
            self.tail_size - len(self.tail[0]) >= self.tail_bytes
        ):  # whole chunks no longer needed
            self.tail_size -= len(self.tail.popleft())

    def close(self) -> OutputRecord:
        if self.record is not None:
            return self.record
        tail = b"".join(self.tail)[-self.tail_bytes :] if self.tail else b""
        dropped = self.total - min(self.total, self.head_bytes) - len(tail)
        if dropped:
            self.file.write(
                f"\n[tunekit: {_size(dropped)} of output dropped here; this log keeps the first "
                f"{_size(self.head_bytes)} and the last {_size(len(tail))} of {_size(self.total)}]\n".encode()
            )
        self.file.write(tail)
        self.file.close()
        self.tail.clear()
        self.record = OutputRecord(
            self.path.name, self.total, min(self.total, self.head_bytes) + len(tail), dropped
        )
        return self.record


async def pump(stream: asyncio.StreamReader, log: CappedLog) -> None:
    """Copy ``stream`` into ``log`` until end of file."""
    while chunk := await stream.read(_CHUNK):
        log.write(chunk)


def read_tail(path: Path, max_bytes: int = 64 * 1024) -> str:
    """The last ``max_bytes`` of a file, as text ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
