"""Run a placement for real: one rank of a hybrid job, and the single-process reference.

Tests use these with :func:`tunekit.testing.run_ranks` to check that a split
model trains to the same parameters as one process on the same global
batches; ``benchmarks/hybrid_mp_speedup.py`` uses them to measure the per-step
speed-up of model parallelism against DLPlacer's prediction (the link between
the ranks is measured by the core's :func:`tunekit.observe.timing.measure_link`).
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

__all__ = ["hybrid_rank", "reference_run"]


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
