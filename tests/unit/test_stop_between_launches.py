"""`tunekit stop` while a live job is between launches: exactly one side takes the stop request.

The supervisor's side is played by a thread calling the supervisor's own
``take_stop_request``; the run folder, its status and its lock are real.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tunekit.locks import FileLock
from tunekit.runtime.client import _said_stopped, _stop_between_launches
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import STOP_REQUEST_TTL_S, relaunching_to, take_stop_request


@pytest.fixture
def between(tmp_path):
    """A run whose job exited to be relaunched with 1 rank, its supervisor alive (the lock)."""
    rd = RunDir.create(tmp_path, {"workload": "example:cnn", "nproc": 2})
    rd.write_status({"status": "relaunching", "step": 12, "world_size": 2, "relaunching_to": 1})
    lock = FileLock(rd.supervisor_lock, "tunekit run", run=rd.run_id).acquire()
    yield rd
    lock.release()


def when_asked(rd: RunDir, then) -> threading.Thread:
    """``then(rd)`` once the stop request is there (as the other side finds it)."""

    def act():
        deadline = time.monotonic() + 30
        while not rd.stop_request_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        then(rd)

    t = threading.Thread(target=act, daemon=True)
    t.start()
    return t


def test_the_supervisor_takes_the_stop_and_the_client_reports_the_pending_relaunch(between):
    rd = between
    assert relaunching_to(rd) == 1

    def supervisor(rd):
        assert take_stop_request(rd)
        rd.write_status({**rd.read_status(), "status": "stopped", "pending_relaunch": 1})

    t = when_asked(rd, supervisor)
    ended = _stop_between_launches(rd, time.monotonic() + 60)
    t.join()
    assert ended is not None and ended["status"] == "stopped"
    assert _said_stopped(rd, ended) == (
        f"stopped at step 12 instead of relaunching with 1 rank(s); "
        f"`tunekit run --resume {rd.run_id}` relaunches it"
    )
    assert not rd.stop_request_file.exists()


def test_a_relaunched_job_that_serves_first_is_asked_and_the_supervisor_finds_nothing(between):
    rd = between
    t = when_asked(rd, lambda rd: rd.write_status({"status": "running", "step": 12}))
    assert _stop_between_launches(rd, time.monotonic() + 60) is None  # ask the new job
    t.join()
    assert not rd.stop_request_file.exists()
    assert not take_stop_request(rd)  # a later relaunch is not stopped by it


def test_no_supervisor_left_to_relaunch_means_no_request_left_behind(tmp_path):
    rd = RunDir.create(tmp_path, {"workload": "example:cnn", "nproc": 2})
    rd.write_status({"status": "relaunching", "step": 3, "relaunching_to": 1})
    assert relaunching_to(rd) is None  # its supervisor was killed: not relaunching
    assert _stop_between_launches(rd, time.monotonic() + 60) is None
    assert not rd.stop_request_file.exists()


def test_a_stale_or_garbled_stop_request_is_dropped_not_carried_out(tmp_path):
    rd = RunDir.create(tmp_path, {"workload": "example:cnn", "nproc": 2})
    rd.write_stop_request({"asked_at": time.time() - STOP_REQUEST_TTL_S - 1})
    assert not take_stop_request(rd) and not rd.stop_request_file.exists()
    rd.stop_request_file.write_text("{not json")
    assert not take_stop_request(rd) and not rd.stop_request_file.exists()
    rd.stop_request_file.write_text(json.dumps({"asked_at": time.time()}))
    assert take_stop_request(rd) and not rd.stop_request_file.exists()
    assert not take_stop_request(rd)
