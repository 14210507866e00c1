"""Helpers for testing tuners and tunekit itself with real processes.

:func:`run_ranks` runs a function on N real processes joined in a gloo
process group on loopback, the way torchrun would, and returns what each
rank returned. Use it for equivalence tests (a gradient reducer against DDP,
a placement against single-process training).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tunekit.runtime.dist import free_port


def _rank_main(rank: int, fn: Callable, world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    result_path = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=120),
        )
        value = fn(rank, world, *args)
        torch.save({"ok": True, "value": value}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], nproc: int = 2, args: tuple = (), timeout_s: float = 180) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo ranks; return each rank's value.

    ``fn`` must be importable by name (a module-level function) because each
    rank is a fresh interpreter. Values travel back with ``torch.save``, so
    tensors are fine. A failure on any rank raises ``RuntimeError`` with that
    rank's traceback.
    """
    with tempfile.TemporaryDirectory(prefix="tunekit-ranks-") as out_dir:
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, nproc, free_port(), out_dir, args),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        try:
            import time

            deadline = time.monotonic() + timeout_s
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # the rank's own result file says what happened
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(nproc):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"rank {rank} died without a result")
            res = torch.load(path, weights_only=False)
            if not res["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{res['error']}")
            results.append(res["value"])
        return results
