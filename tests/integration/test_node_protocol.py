"""The node protocol against another process on the coordinator's port (issue 34, items 1-4).

A real coordinator (in this process), a real `tunekit follow` process, and the other party: a
second TCPStore client that lists, reads and writes the store's keys as another local user
could. No training runs: a follower's probe answer (from its cache) is the data that travels.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from tunekit.runtime.dist import free_port
from tunekit.trials.nodes import PREFIX, Coordinator, NodesError, parse_endpoint

pytestmark = pytest.mark.slow

TOKEN = "0123456789abcdef" * 4
FITS = [{"op": "all_reduce", "world_size": 2, "bandwidth": 1.25e9, "note": "PRIVATE-FIT-7"}]


def start_follower(folder: Path, port: int, token: str) -> subprocess.Popen:
    """``tunekit follow`` as node 1, in ``folder``, its output in ``folder/out.log``."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env["TUNEKIT_NODE_TOKEN"] = token
    with (folder / "out.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tunekit", "follow", "--coordinator", f"127.0.0.1:{port}"]
            + ["--node-rank", "1", "--join-timeout", "2m"],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def output_when(folder: Path, text: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = (folder / "out.log").read_text()
        if text in out:
            return out
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in the follower's output: {out[-2000:]}")


def test_another_process_on_the_port_can_neither_read_nor_steer_the_study(tmp_path):
    port = free_port()
    said: list[str] = []
    coordinator = Coordinator(
        parse_endpoint(f"127.0.0.1:{port}"), 2, TOKEN, lost_s=5.0, say=said.append
    )
    node1 = tmp_path / "node1"
    cache = node1 / ".tunekit" / "nodes" / "node1" / "probe-2.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(FITS))  # what node 1 answers: its measured collectives
    with reaped(start_follower(node1, port, TOKEN)) as follower:
        coordinator.wait_for_followers(120)
        spy = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))

        # Item 4: a correctly sealed value, written where the follower looks for its next job,
        # is refused there (it is bound to another key), said, and the follower goes on.
        spy.set(PREFIX + "job/0", spy.get(PREFIX + "coord/beat"))
        output_when(node1, "ignored the value at job/0")
        replies = coordinator.probe(2, timeout_s=120)
        assert replies[1] == {"fits": FITS}  # the real announcement, written over it, ran
        assert follower.poll() is None

        # Item 1: the keys are listed, but no value says anything.
        keys = spy.list_keys()
        assert PREFIX + "node/1/hello" in keys and PREFIX + "job/0/node/1" in keys
        seen = b"".join(spy.get(k) for k in keys)
        hello = coordinator.nodes[1]
        # The host name as the hello's JSON carries it, quoted: a short one ("vm") turns up in
        # a few kilobytes of ciphertext by chance about once in twenty runs.
        host = json.dumps(hello["host"])
        for secret in ("PRIVATE-FIT-7", "all_reduce", "probe", host, str(hello["pid"])):
            assert secret.encode() not in seen

        # Item 2: node 1 is killed while the other process writes its last heartbeat again and
        # again (and garbage between): the coordinator still sees it stand still.
        last_beat = spy.get(PREFIX + "node/1/beat")
        os.killpg(follower.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not coordinator.lost() and time.monotonic() < deadline:
            spy.set(PREFIX + "node/1/beat", last_beat)
            time.sleep(0.1)
            spy.set(PREFIX + "node/1/beat", b"\x00" * 40)
            time.sleep(0.1)
        assert "node 1" in coordinator.lost().get(1, ""), coordinator.lost()
    assert coordinator.refusals.count >= 1
    assert any("ignored the value at node/1/beat" in line for line in said)
    coordinator.beat.stop()


def test_a_follower_with_another_token_is_told_so_and_the_coordinator_names_it(tmp_path):
    port = free_port()
    said: list[str] = []
    coordinator = Coordinator(parse_endpoint(f"127.0.0.1:{port}"), 2, TOKEN, say=said.append)
    with reaped(start_follower(tmp_path / "node1", port, "f" * 64)) as follower:
        assert follower.wait(timeout=180) == 2
    out = (tmp_path / "node1" / "out.log").read_text()
    assert "node 1 does not hold the coordinator's node token" in out, out
    assert "joined" not in out and "Traceback" not in out
    with pytest.raises(NodesError, match="node 1 failed to authenticate"):
        coordinator.wait_for_followers(1)
    assert any(line.startswith("node 1 failed to authenticate") for line in said), said
    coordinator.beat.stop()


def test_a_follower_joins_the_new_run_although_the_last_runs_announcement_is_written_back(
    tmp_path,
):
    """After --resume (same token, same port), the earlier run's `run` value written over the
    new one does not bind the follower to the old run: the handshake is fresh both ways."""
    port = free_port()
    first = Coordinator(parse_endpoint(f"127.0.0.1:{port}"), 2, TOKEN)
    spy = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    stale = spy.get(PREFIX + "run")
    first.stop(0)
    stop = spy.get(PREFIX + "job/0/stop")
    del spy
    first.beat.stop()
    first.beat.thread.join()

    second = Coordinator(parse_endpoint(f"127.0.0.1:{free_port()}"), 2, TOKEN)
    spy = TCPStore(
        "127.0.0.1", second.endpoint.port, is_master=False, timeout=timedelta(seconds=10)
    )
    spy.set(PREFIX + "run", stale)
    with reaped(start_follower(tmp_path / "node1", second.endpoint.port, TOKEN)) as follower:
        deadline = time.monotonic() + 120
        # The stale run is written back faster than the coordinator repairs it (each second)
        # until the follower has said hello, to whichever run it read; then only the repair
        # stands between it and the new run (a race kept up to the end took 5-60 s to lose).
        while not spy.check([PREFIX + "node/1/hello"]) and time.monotonic() < deadline:
            spy.set(PREFIX + "run", stale)  # a repair stands ~10 ms of each second
            spy.set(PREFIX + "job/0/stop", stop)
            time.sleep(0.01)
        while not second.joined() and time.monotonic() < deadline:
            spy.set(PREFIX + "job/0/stop", stop)  # the old run's stop still written back
            time.sleep(0.05)
        assert second.joined() == [1]
        output_when(tmp_path / "node1", "node 1 joined")
        second.close()
        assert follower.wait(timeout=60) == 0
    out = (tmp_path / "node1" / "out.log").read_text()
    assert "the coordinator ended the study" in out, out
