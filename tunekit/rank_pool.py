"""Rank processes kept alive between :func:`tunekit.testing.run_ranks` calls.

A fresh spawned rank spends about 2 s importing torch and, at its first
optimizer, 1.5 s more importing ``torch._dynamo``; a test suite that runs
ranks a few dozen times spends most of its multi-process time there. With
``TUNEKIT_REUSE_RANKS=1`` in the environment, ``run_ranks`` hands each call to
a pool of spawned ranks that outlive it instead. Each call still gets its own
process group (a fresh port), a random torch seed as a fresh process has, one
thread per rank, grad mode on, and float32 as the default dtype. Any failure
or timeout kills the pool, so a broken call never leaks into the next one.

A pool's ranks fork from multiprocessing's fork server, which imports torch,
``torch.distributed`` and ``torch._dynamo`` once per process that uses the pool
(tunekit's trials fork their ranks from a warm server for the same reason:
:mod:`tunekit.trials.warm_start`). Each rank then takes the caller's environment,
working directory and ``sys.path`` as they were when the pool started, as a
spawned rank would. Where the caller's import-time environment (OpenMP's, torch's:
:func:`~tunekit.trials.warm_start.import_time_env`) differs from the one the fork
server started with, or ``TUNEKIT_PROCESS_START=spawn``, the ranks are spawned.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from tunekit.trials.warm_start import forking, import_time_env

ENV = "TUNEKIT_REUSE_RANKS"

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tunekit.testing.ranks"]
"""What the fork server imports before it forks a rank: what every rank imports before
its first optimizer step."""

_server_env: tuple[tuple[str, str], ...] | None = None
"""The import-time environment the fork server started with (None: not started here)."""


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


@dataclass(frozen=True)
class _Start:
    """What a spawned rank would have taken from its caller."""

    environ: dict[str, str]
    cwd: str
    path: list[str]


def _serve(
    rank: int, conn: Connection, run: Callable[..., None], start: _Start | None = None
) -> None:
    """A pooled rank: run each call as a fresh rank would, until told to stop or one fails."""
    if start is not None:  # forked from the fork server: take on the caller's process state
        os.environ.clear()
        os.environ.update(start.environ)
        os.chdir(start.cwd)
        sys.path[:] = start.path
    while True:
        try:
            call = conn.recv()
        except EOFError:  # the caller is gone
            return
        if call is None:
            return
        torch.seed()  # a fresh process starts from a random seed too
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            run(rank, *call)
        except BaseException:  # the result file says what; this process is done for
            conn.send(False)
            raise
        gc.collect()  # the call's process group and its sockets go now, not during the next
        conn.send(True)


def _context() -> tuple[Any, _Start | None]:
    """The fork server's context and the caller's state, or spawn's where a fork would not
    see the caller's import-time environment (see the module docstring)."""
    global _server_env
    env = import_time_env(os.environ)
    if not forking() or _server_env not in (None, env):
        return mp.get_context("spawn"), None
    ctx = mp.get_context("forkserver")
    if _server_env is None:
        ctx.set_forkserver_preload(PRELOAD)
        _server_env = env
    return ctx, _Start(dict(os.environ), os.getcwd(), list(sys.path))


class RankPool:
    """``nproc`` ranks that take calls one at a time."""

    def __init__(self, nproc: int, run: Callable[..., None]):
        ctx, start = _context()
        self.nproc = nproc
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(nproc):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(rank, child, run, start), name=f"tunekit-rank{rank}"
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def call(self, args: tuple, timeout_s: float) -> bool:
        """Run one call on every rank; True when every rank finished it without raising.

        Raises ``TimeoutError`` past ``timeout_s``.
        """
        for conn in self.conns:
            conn.send(args)
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s")
            ready = wait(
                [*pending.values(), *(p.sentinel for p in self.procs)], timeout=min(left, 1.0)
            )
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        ok = conn.recv()
                    except EOFError:
                        ok = False
                    if not ok:
                        return False
                    del pending[rank]
            if any(not p.is_alive() for p in self.procs) and pending:
                return False
        return True

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_pools: dict[int, RankPool] = {}


def run_on_pool(nproc: int, run: Callable[..., None], args: tuple, timeout_s: float) -> None:
    """``run(rank, *args)`` on every rank of the pool for ``nproc``; a failure retires the pool."""
    pool = _pools.get(nproc)
    if pool is None:
        pool = _pools[nproc] = RankPool(nproc, run)
    ok = False
    try:
        ok = pool.call(args, timeout_s)
    finally:
        if not ok:
            del _pools[nproc]
            pool.close()


@atexit.register
def _close_all() -> None:  # before multiprocessing's own exit handler joins them
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()
