"""A full disk under a live run's folder (issue 34, item 5): writes fail whole, the last good
files and checkpoint stay, no temporary file is left, and a rank's output cannot kill it.

The disk fills at rundir's write calls (a byte budget, then ENOSPC, a partial write first as
a real disk does); the rank's output goes to /dev/full, a real device that answers every write
with ENOSPC. tests/integration/test_live_failures.py runs a whole job on a full tmpfs.
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import types

import pytest

from tunekit.runtime import rundir as rundir_module
from tunekit.runtime.quiet_writes import QuietWrites
from tunekit.runtime.rundir import CheckpointError, RunDir


class Disk:
    """What is left on the disk, in bytes; ``None``: room enough."""

    def __init__(self) -> None:
        self.left: int | None = None

    def take(self, n: int) -> int:
        """How many of ``n`` bytes fit; ENOSPC when none does."""
        if self.left is None:
            return n
        if self.left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fits = min(n, self.left)
        self.left -= fits
        return fits


class _FillingFile(io.RawIOBase):
    def __init__(self, fd: int, disk: Disk):
        self.fd, self.disk = fd, disk

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        return os.write(self.fd, bytes(data)[: self.disk.take(len(data))])

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


@pytest.fixture
def disk(monkeypatch) -> Disk:
    """rundir's files on a disk that fills: its ``open(fd, ...)`` and ``os.write`` meet it."""
    disk = Disk()

    def filling_open(fd, mode="r", *args, **kwargs):
        raw = _FillingFile(fd, disk)
        buffered = io.BufferedWriter(raw)
        return buffered if "b" in mode else io.TextIOWrapper(buffered, encoding="utf-8")

    def filling_write(fd, data):
        return os.write(fd, bytes(data)[: disk.take(len(data))])

    monkeypatch.setattr(rundir_module, "open", filling_open, raising=False)
    proxy = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    proxy.write = filling_write
    monkeypatch.setattr(rundir_module, "os", proxy)
    return disk


def _run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path, {"workload": "x", "nproc": 1})


def test_a_full_disk_keeps_the_last_good_status_and_leaves_no_temporary_file(tmp_path, disk):
    rd = _run(tmp_path)
    rd.write_status({"status": "running", "step": 11})
    disk.left = 20  # less than a status takes
    with pytest.raises(OSError) as raised:
        rd.write_status({"status": "running", "step": 12})
    assert raised.value.errno == errno.ENOSPC
    assert rd.read_status()["step"] == 11  # the last good one, whole
    assert not list(rd.path.glob("*.tmp"))
    disk.left = None  # room again
    rd.write_status({"status": "running", "step": 13})
    assert rd.read_status()["step"] == 13


def test_a_line_that_did_not_fit_is_cut_back_off_so_the_lines_after_it_read(tmp_path, disk):
    rd = _run(tmp_path)
    rd.append_metric({"step": 0, "loss": 1.0})
    rd.log_event("started", step=0)
    disk.left = 10  # part of the next line fits, not all of it
    for write in (lambda: rd.append_metric({"step": 1, "loss": 0.9}), lambda: rd.log_event("x")):
        with pytest.raises(OSError):
            write()
        disk.left = 10
    disk.left = None
    rd.append_metric({"step": 1, "loss": 0.9})
    rd.log_event("stopped", step=2)
    assert [m["step"] for m in rd.read_metrics()] == [0, 1]
    assert [e["kind"] for e in rd.read_events()] == ["started", "stopped"]


def test_events_a_full_disk_kept_out_are_written_in_order_once_there_is_room(
    tmp_path, disk, capsys
):
    """Events are rare: one that did not fit waits for the next write instead of being lost,
    and its warning goes once it is written, though no new event comes."""
    rd = _run(tmp_path)
    writes = QuietWrites(rd)
    writes.log_event("started", step=0)
    disk.left = 0
    writes.log_event("checkpoint_failed", step=3)
    writes.log_event("checkpoint_failed", step=6)
    assert list(writes.warned) == ["events.jsonl"]
    assert [e["kind"] for e in rd.read_events()] == ["started"]
    written_at = [e["t"] for e in writes.waiting_events]
    writes.flush_events()  # the next status write: still no room
    assert list(writes.warned) == ["events.jsonl"]
    disk.left = None  # room again
    writes.flush_events()
    events = rd.read_events()
    assert [(e["kind"], e["step"]) for e in events] == [
        ("started", 0),
        ("checkpoint_failed", 3),
        ("checkpoint_failed", 6),
    ]
    assert [e["t"] for e in events[1:]] == written_at  # when they happened, not when written
    assert writes.warned == {} and not writes.waiting_events
    err = capsys.readouterr().err
    assert err.count("cannot write events.jsonl") == 1 and "events.jsonl is written again" in err


def test_a_checkpoint_that_does_not_fit_leaves_the_last_good_one(tmp_path, disk):
    rd = _run(tmp_path)
    good = rd.save_checkpoint(3, {"w": list(range(100))})
    disk.left = 200
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        rd.save_checkpoint(6, {"w": list(range(10_000))})
    assert rd.checkpoint_files() == [good]
    assert RunDir.load_checkpoint(good)["w"] == list(range(100))
    assert not list(rd.checkpoints.glob("*.tmp"))


RANK = (
    "import sys\n"
    "if sys.argv[1] == 'lossy':\n"
    "    from tunekit.runtime.rundir import LossyStream\n"
    "    sys.stdout, sys.stderr = LossyStream(1), LossyStream(2)\n"
    "for step in range(3):\n"
    "    print(f'step {step}', 'x' * 10000)\n"
    "    print('a warning', file=sys.stderr, flush=True)\n"
)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(("streams", "survives"), [("plain", False), ("lossy", True)])
def test_a_ranks_output_on_a_full_disk_cannot_end_it(streams, survives):
    with open("/dev/full", "w") as full:
        rc = subprocess.run(
            [sys.executable, "-c", RANK, streams], stdout=full, stderr=full, timeout=120
        ).returncode
    assert (rc == 0) == survives, rc


def test_a_status_met_half_rewritten_in_place_reads_as_the_last_one_read(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.read_status() == {"status": "starting"}  # none written yet
    rd.write_status({"status": "running", "step": 6})
    assert rd.read_status()["step"] == 6
    # A read-only run folder's status is truncated and rewritten in place: a read between the
    # two sees part of it, and must not say the job is starting again.
    rd.status_file.write_text('{"status": "running", "st')
    assert rd.read_status()["step"] == 6
    assert RunDir(tmp_path).read_status() == {"status": "starting"}  # nothing read before
