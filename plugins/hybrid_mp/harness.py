"""Run a placement for real: one rank of a hybrid job, and the single-process reference.

Tests use these with :func:`tunekit.testing.run_ranks` to check that a split
model trains to the same parameters as one process on the same global
batches; ``benchmarks/hybrid_mp_speedup.py`` uses them to measure the per-step
speed-up of model parallelism against DLPlacer's prediction.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from tunekit.plugins.hybrid_mp.runtime import install_hybrid
from tunekit.runtime.data import BatchSource
from tunekit.runtime.session import Session
from tunekit.workload import load_workload

__all__ = ["hybrid_rank", "reference_run", "p2p_pingpong", "fit_link"]


def hybrid_rank(
    rank: int,
    world: int,
    spec: str,
    steps: int,
    mp: int,
    plan: Mapping[str, Any] | None = None,
    knobs: Mapping[str, Any] | None = None,
    threads: int | None = None,
    reset_steps: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` steps as rank ``rank`` of an N × ``mp`` hybrid; return losses, times, state.

    The placement is ``plan`` (``{"node_device": ..., "order": ...}``) when
    given, else whatever :class:`~tunekit.plugins.hybrid_mp.plugin.HybridMp`
    plans for ``knobs`` in the worker, as a trial would. With ``reset_steps``
    the session then returns to its defaults (plain DDP, as a rollback would)
    and trains that many steps more. ``threads`` sets intra-op threads (default:
    leave what the caller set).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    workload = load_workload(spec)
    session = Session(
        workload, rank=rank, world_size=world, group=dist.group.WORLD if world > 1 else None
    )
    if plan is not None:
        install_hybrid(session, plan["node_device"], mp, plan.get("order"))
    else:
        from tunekit.plugins.hybrid_mp.plugin import HybridMp

        tuner = HybridMp()
        tuner.apply(session, tuner.validate({"mp_degree": mp, **(knobs or {})}))
    hybrid_lr = session.lr
    losses, times, cpu, comm = [], [], [], []
    for _ in range(steps):
        start_cpu = time.process_time()
        rec = session.train_step()
        cpu.append(time.process_time() - start_cpu)
        losses.append(rec.loss)
        times.append(rec.step_s)
        comm.append(sum(c["nbytes"] for c in rec.metrics.get("comm", [])))
    segments = session.grad_sync.program.describe() if hasattr(session.grad_sync, "program") else []
    if reset_steps:
        session.reset()
        for _ in range(reset_steps):
            losses.append(session.train_step().loss)
    session.flush()
    state = {k: v.detach().clone() for k, v in session.model.state_dict().items()}
    opt_state = session.optimizer.state_dict()
    out = {
        "losses": losses,
        "step_s": times,
        "cpu_s": cpu,
        "comm_bytes": comm,
        "lr": hybrid_lr,
        "state": state,
        "optimizer": opt_state,
        "segments": segments,
    }
    session.close()
    return out


def reference_run(
    spec: str,
    steps: int,
    dp: int,
    lr: float,
    threads: int | None = None,
    then: tuple[int, int, float] | None = None,
) -> dict[str, Any]:
    """One process training on the global batches of an N = ``dp`` hybrid (N × B samples).

    ``then = (steps, world, lr)`` continues as a ``world``-rank DDP job would.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    workload = load_workload(spec)
    session = Session(workload)
    phases = [(range(steps), dp, lr)]
    if then is not None:
        phases.append((range(steps, steps + then[0]), then[1], then[2]))
    schedule = []
    for rng, world, rate in phases:
        source = BatchSource(
            workload,
            rank=0,
            world_size=world,
            device=session.device,
            batch_size=workload.batch_size,
        )
        schedule += [(step, source, rate) for step in rng]
    losses, times, cpu = [], [], []
    for step, source, rate in schedule:
        session.set_lr(rate)
        start, start_cpu = time.perf_counter(), time.process_time()
        x, y = source.global_batch(step)
        loss = workload.loss(session.model(x), y)
        loss.backward()
        session.optimizer.step()
        session.optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {
        "losses": losses,
        "step_s": times,
        "cpu_s": cpu,
        "state": {k: v.detach().clone() for k, v in session.model.state_dict().items()},
        "optimizer": session.optimizer.state_dict(),
    }


def p2p_pingpong(
    rank: int, world: int, sizes: list[int], repeats: int = 5
) -> list[tuple[int, float]]:
    """One-way time of a ``send``/``recv`` between ranks 0 and 1, per message size (median
    of half round trips), for fitting a link's latency and bandwidth."""
    out = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - start) / 2)
        times = sorted(times[1:])
        out.append((buf.numel() * 4, times[len(times) // 2]))
    return out


def fit_link(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``time = latency + bytes / bandwidth``; returns (bandwidth, latency)."""
    n = len(samples)
    xs = [float(b) for b, _ in samples]
    ys = [t for _, t in samples]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    slope = max(slope, 1e-15)
    return 1.0 / slope, max(0.0, my - slope * mx)
