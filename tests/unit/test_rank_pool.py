"""run_ranks with reused ranks (tunekit.rank_pool): same processes, fresh start each call."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from support import (
    rank_one_raises,
    rank_pid,
    rank_sleeps,
    rank_state_then_spoil,
    rank_surroundings,
)

from tunekit import rank_pool
from tunekit.testing import run_ranks
from tunekit.testing.ranks import _lost_connection
from tunekit.trials.warm_start import forking, import_time_env

pytestmark = pytest.mark.slow


@pytest.fixture
def pooled(monkeypatch):
    monkeypatch.setenv(rank_pool.ENV, "1")


def test_each_call_starts_as_a_fresh_rank_would_on_the_same_processes(pooled, monkeypatch):
    from tunekit.testing import ranks

    # A gloo connection lost under the ranks (gloo's loopback transport, now and then) retires
    # them and runs the call again on new ones: the same processes only where none was lost.
    lost = []
    run_once = ranks._run_once
    monkeypatch.setattr(
        ranks, "_run_once", lambda *a: (f := run_once(*a), lost.append(_lost_connection(f)))[0]
    )
    pids = run_ranks(rank_pid, 2)
    lost.clear()  # lost before the pids were read: those are the new ranks' already
    run_ranks(rank_state_then_spoil, 2)  # leaves a fixed seed, 2 threads and grad mode off
    again = run_ranks(rank_state_then_spoil, 2)
    now = run_ranks(rank_pid, 2)
    assert (now == pids) is not any(lost), (pids, now, lost)
    for rank, (draw, threads, grad) in enumerate(again):
        assert (threads, grad) == (1, True)
        assert draw != torch.rand(1, generator=torch.Generator().manual_seed(1234 + rank)).item()
    assert again[0][0] != again[1][0]  # random seeds, as fresh processes have


def test_pooled_ranks_fork_from_a_warm_server_and_run_where_the_caller_was(
    pooled, monkeypatch, tmp_path
):
    rank_pool._close_all()  # pools started by earlier tests keep what they started with
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNEKIT_PROBE", "set by the caller")
    monkeypatch.syspath_prepend(str(tmp_path))
    # The fork server imports with the import-time environment of the first pool here.
    forks = forking() and rank_pool._server_env in (None, import_time_env(os.environ))
    try:
        for parent, cwd, probe, path in run_ranks(rank_surroundings, 2):
            assert (parent != os.getpid()) is forks  # forked by the server, not this process
            assert (cwd, probe) == (str(tmp_path), "set by the caller")
            assert path[0] == str(tmp_path)
        rank_pool._close_all()
        # An import-time variable (OpenMP's, torch's, ...) the server did not start with: a
        # fork could not honour it, so the ranks are spawned (by this process).
        monkeypatch.setenv("MKL_TUNEKIT_PROBE", "1")
        assert all(parent == os.getpid() for parent, *_ in run_ranks(rank_surroundings, 2))
    finally:
        rank_pool._close_all()


def test_a_failing_call_retires_its_ranks_and_the_next_call_gets_new_ones(pooled):
    before = run_ranks(rank_pid, 2)
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*rank one broke on purpose"):
        run_ranks(rank_one_raises, 2, timeout_s=60)
    assert not any(psutil.pid_exists(p) for p in before)
    with pytest.raises(TimeoutError, match="within 1 s"):
        run_ranks(rank_sleeps, 2, args=(30,), timeout_s=1)
    after = run_ranks(rank_pid, 2)
    assert set(after).isdisjoint(before)


LOST = "RuntimeError: Gloo connectFullMesh failed with [pair.cc:561] Connection closed by peer"
MIDWAY = "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:17805"


@pytest.mark.parametrize(
    "found, retried",
    [
        # rank 1 lost its connection while connecting; rank 0 was stopped before writing
        ([None, {"ok": False, "error": LOST, "t": 1.0}], True),
        # ... or in a collective, on both ranks
        ([{"ok": False, "error": MIDWAY, "t": 1.0}, {"ok": False, "error": LOST, "t": 2}], True),
        # fn raised something of its own on one rank: never run twice
        (
            [{"ok": False, "error": MIDWAY, "t": 2}, {"ok": False, "error": "ValueError", "t": 1}],
            False,
        ),
        ([None, {"ok": False, "error": "TimeoutError: no port", "t": 1}], False),
        # gloo's other word for it
        ([None, {"ok": False, "error": "[pair.cc:598] Connection reset by peer", "t": 1}], True),
        # a rank that finished: a collective's connection was not lost under the call ...
        ([{"ok": True, "value": 1}, {"ok": False, "error": MIDWAY, "t": 1.0}], False),
        # ... but one that never connected never ran fn (seen beside two busy loops)
        ([{"ok": True, "value": 1}, {"ok": False, "error": LOST, "t": 1.0}], True),
        ([{"ok": True, "value": 1}, {"ok": True, "value": 2}], False),
    ],
)
def test_only_a_gloo_connection_lost_under_the_ranks_is_tried_again(found, retried):
    assert _lost_connection(found) is retried


def test_a_call_whose_ranks_keep_losing_connections_is_run_three_times_then_said(monkeypatch):
    from tunekit.testing import ranks

    lost = [None, {"ok": False, "error": LOST, "t": 1.0}]
    runs = []

    def run_once(*args):
        runs.append(args)
        return lost if len(runs) < 3 else [{"ok": True, "value": 0}, {"ok": True, "value": 1}]

    monkeypatch.setattr(ranks, "_run_once", run_once)
    assert ranks.run_ranks(rank_pid, 2) == [0, 1] and len(runs) == 3  # lost twice, then ran
    runs.clear()
    monkeypatch.setattr(ranks, "_run_once", lambda *a: runs.append(a) or lost)
    with pytest.raises(RuntimeError, match=r"rank 1 failed \(in each of 3 attempts\):"):
        ranks.run_ranks(rank_pid, 2)
    assert len(runs) == 3
