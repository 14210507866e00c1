"""Real ranks, and the float64 equivalence check run across them.

:func:`run_ranks` runs a function on N spawned processes joined in a gloo group
on loopback (or on the kept ranks of :mod:`tunekit.rank_pool`);
:func:`~tunekit.runtime.dist.single_rank_group` gives one-process code a real group.
:func:`default_dtype`, :func:`assert_states_close` and :data:`EQUIVALENCE_RTOL`
compare what such runs trained.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tunekit import rank_pool

# == real ranks ===========================================================================


_STORE_TIMEOUT = timedelta(seconds=120)


def _store(rank: int, world: int, out_dir: str) -> dist.TCPStore:
    """The call's rendezvous store, on a port rank 0 binds itself.

    Rank 0 asks the kernel for the port (0) and publishes it in ``out_dir``; a
    port picked earlier by the caller could be taken by any other process on the
    machine (a parallel test's ranks, a trial) while the ranks start.
    """
    published = Path(out_dir) / "store_port"
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False
        )
        staging = published.with_suffix(".tmp")
        staging.write_text(str(store.port))
        staging.replace(published)  # atomic: the others never read half a number
        return store
    deadline = time.monotonic() + _STORE_TIMEOUT.total_seconds()
    while not published.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 published no store port within {_STORE_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(0.01)
    port = int(published.read_text())
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=_STORE_TIMEOUT)


RANK_THREADS_ENV = "TUNEKIT_RANK_THREADS"
"""Intra-op threads per rank in :func:`run_ranks` (default 1): equivalence tests are run
under 1 and 2 to check that no tolerance depends on how a kernel splits its work."""


def rank_threads() -> int:
    return int(os.environ.get(RANK_THREADS_ENV, "1"))


def _rank_main(
    rank: int, fn: Callable, world: int, out_dir: str, args: tuple, dtype: torch.dtype | None = None
) -> None:
    torch.set_num_threads(rank_threads())
    if dtype is not None:
        torch.set_default_dtype(dtype)  # a pooled rank returns to float32 at its next call
    result_path = Path(out_dir) / f"rank{rank}.pt"
    try:
        store = _store(rank, world, out_dir)
        # What a torchrun rank sees, for code that reads it.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=_STORE_TIMEOUT
        )
        value = fn(rank, world, *args)
        torch.save({"ok": True, "value": value}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc(), "t": time.time()}, result_path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn_ranks(
    fn: Callable[..., Any], nproc: int, out_dir: str, args: tuple, timeout_s: float, dtype
) -> None:
    ctx = mp.start_processes(
        _rank_main,
        args=(fn, nproc, out_dir, args, dtype),
        nprocs=nproc,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        # A rank that raised or died: its own result file says what happened.
        with contextlib.suppress(mp.ProcessRaisedException, mp.ProcessExitedException):
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def run_ranks(
    fn: Callable[..., Any],
    nproc: int = 2,
    args: tuple = (),
    timeout_s: float = 180,
    *,
    dtype: torch.dtype | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo ranks; return each rank's value.

    ``dtype`` sets each rank's default dtype before ``fn`` runs (models and
    synthetic batches are then built in it): equivalence tests pass
    ``torch.float64``. Each rank runs :func:`rank_threads` intra-op threads.

    ``fn`` must be importable by name (a module-level function) because each
    rank is a fresh interpreter. Values travel back with ``torch.save``, so
    tensors are fine. A failure on any rank raises ``RuntimeError`` with that
    rank's traceback. With ``TUNEKIT_REUSE_RANKS=1`` the ranks are kept for the
    next call (:mod:`tunekit.rank_pool`; tunekit's own test suite does this).
    """
    found = _run_once(fn, nproc, args, timeout_s, dtype)
    attempts = 1
    while _lost_connection(found) and attempts < _ATTEMPTS:
        # gloo's loopback transport now and then has a connection closed under a rank, while
        # connecting or in a collective (pytorch/pytorch#53270, #53138; twice in 4 full runs
        # of the suite here, and once twice in a row beside two busy loops): fresh ranks run
        # the call again; a real failure fails every time.
        found = _run_once(fn, nproc, args, timeout_s, dtype)
        attempts += 1
    failed = [
        (res["t"], rank, res["error"]) for rank, res in enumerate(found) if res and not res["ok"]
    ]
    if failed:  # the first to fail; the others mostly fail because it left them waiting
        _, rank, error = min(failed)
        others = "".join(
            f"\n(rank {r} failed too: {e.strip().splitlines()[-1]})"
            for _, r, e in sorted(failed)
            if r != rank
        )
        tries = f" (in each of {attempts} attempts)" if attempts > 1 else ""
        raise RuntimeError(f"rank {rank} failed{tries}:\n{error}{others}")
    values = []
    for rank, res in enumerate(found):
        if res is None:
            raise RuntimeError(f"rank {rank} died without a result")
        values.append(res["value"])
    return values


def _run_once(fn, nproc: int, args: tuple, timeout_s: float, dtype) -> list[dict | None]:
    """Each rank's result file (None where a rank left none)."""
    with tempfile.TemporaryDirectory(prefix="tunekit-ranks-") as out_dir:
        if rank_pool.enabled():
            rank_pool.run_on_pool(nproc, _rank_main, (fn, nproc, out_dir, args, dtype), timeout_s)
        else:
            _spawn_ranks(fn, nproc, out_dir, args, timeout_s, dtype)
        paths = [Path(out_dir) / f"rank{rank}.pt" for rank in range(nproc)]
        return [torch.load(p, weights_only=False) if p.exists() else None for p in paths]


GLOO_CONNECTING = "Gloo connectFullMesh failed"
"""What gloo says when a connection was lost while the ranks connected (``init_process_group``)."""
GLOO_LOST = (GLOO_CONNECTING, "Connection closed by peer", "Connection reset by peer")
"""What gloo's loopback transport says when it loses a connection under a rank."""
_ATTEMPTS = 3
"""Runs of a call whose ranks only lost gloo connections, before it is said to fail."""


def _lost_connection(found: list[dict | None]) -> bool:
    """Every rank that failed lost a gloo connection: gloo's loopback transport, not ``fn``
    (a rank that raised anything else is said as it is). Lost in a collective, the call is
    run again only if no rank finished it (a rank that returned early also closes its
    connections); lost while connecting, ``fn`` never ran on that rank, whatever the others
    did (seen: rank 0 connected and returned, rank 1's connection was closed under it)."""
    failed = [r for r in found if r and not r["ok"]]
    if not failed or not all(any(words in r["error"] for words in GLOO_LOST) for r in failed):
        return False
    if all(GLOO_CONNECTING in r["error"] for r in failed):
        return True
    return all(r is None or not r["ok"] for r in found)


# == numerical equivalence ================================================================

EQUIVALENCE_RTOL = 1e-9
"""Relative tolerance of a float64 equivalence check (see :func:`assert_states_close`).

Why this value: float64's unit roundoff is u = 2**-53 ~ 1.1e-16. Two runs of the
same mathematics differ only in summation order (a gradient reduced in chunks,
a model-parallel split, a gathered batch, another kernel or thread split), and
a sum of n terms in another order differs by at most ~n*u of the sum of the
terms' magnitudes. Our reductions are at most ~1e5 terms deep (batch x spatial
positions), so one step differs by <= ~1e-11 of the tensor's scale, and a few
steps compound that additively. 1e-9 leaves a 100x margin on any CPU, while a
real mistake (a gradient contribution missed, doubled or stale, a wrong
learning rate) moves parameters by ~lr x |grad| >= 1e-5 of their scale."""


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build models and synthetic batches in ``dtype`` for the duration (a reference run)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def assert_states_close(
    actual: Any, expected: Any, what: str, *, rtol: float = EQUIVALENCE_RTOL
) -> None:
    """Assert two training states (nested dicts/lists of tensors and values) agree.

    Floating tensors must be float64 (the claim is "the same mathematics", see
    :data:`EQUIVALENCE_RTOL`) and agree elementwise within ``rtol`` of their own
    value plus ``rtol`` of the tensor's scale (a bias near zero is compared at its
    weight's precision, not its own); integer tensors and other values exactly.
    """
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and actual.keys() == expected.keys(), (
            f"{what}: keys differ: {sorted(map(str, actual))} vs {sorted(map(str, expected))}"
        )
        for key in expected:
            assert_states_close(actual[key], expected[key], f"{what}.{key}", rtol=rtol)
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple) and len(actual) == len(expected), (
            f"{what}: lengths differ"
        )
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_states_close(a, e, f"{what}[{i}]", rtol=rtol)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__} is no tensor"
        if not expected.is_floating_point():
            assert torch.equal(actual, expected), f"{what} differs"
            return
        assert expected.dtype == actual.dtype == torch.float64, (
            f"{what}: compared in {actual.dtype}/{expected.dtype}; equivalence runs in float64"
        )
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(
            actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what} differs: {m}"
        )
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"
