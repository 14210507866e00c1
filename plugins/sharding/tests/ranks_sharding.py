"""Functions run on spawned gloo ranks (``tunekit.testing.run_ranks``) by the tests and the
benchmark: settings of a workload measured one after another in one process group, each
in a fresh session (a layout is built in from the start), its steps timed (the slowest
rank's) and its peak per rank measured as a trial measures it (warm-up steps tracked)."""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from tunekit.api import Layout, Session, is_out_of_memory, release_memory
from tunekit.workload import load_workload


def _agree_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]


def measure_settings(
    rank: int,
    world: int,
    spec: str,
    settings: list[dict[str, Any]],
    warmup: int = 2,
    steps: int = 5,
    cap_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Each setting (``{"layout": {field: value}, "micro_batches": m}``) trained for
    ``warmup`` + ``steps`` steps: its median step (slowest rank), its peak (largest rank),
    and ``oom`` when a step went over ``cap_bytes`` on any rank (all ranks stop it together)."""
    workload = load_workload(spec)
    out = []
    for s in settings:
        layout = workload.layout().with_changes(s.get("layout", {}))
        session = Session(
            workload,
            rank=rank,
            world_size=world,
            layout=layout,
            memory_cap_bytes=cap_bytes,
            track_memory=True,
        )
        micro = int(s.get("micro_batches") or 0)
        if micro and micro != session.accumulation:
            session.set_micro_batches(micro)
        times, status, losses = [], "ok", []
        for i in range(warmup + steps):
            failed = 0.0
            try:
                rec = session.train_step()
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                failed = 1.0
            if _agree_max([failed])[0] > 0:
                status = "oom"
                break
            if i >= warmup:
                times.append(rec.step_s)
                losses.append(rec.loss)
            if i == warmup - 1 and cap_bytes is None:
                session.memory.stop()  # as a trial: the warm-up shows the peak
        peak = _agree_max([float(session.memory.max or -1)])[0]
        slowest = _agree_max(times) if status == "ok" else []
        out.append(
            {
                **s,
                "status": status,
                "step_s": statistics.median(slowest) if slowest else None,
                "steps_s": slowest,
                "peak_bytes": peak if peak >= 0 else None,
                "losses": losses,
                "describe": Layout.from_dict(layout.to_dict()).describe(),
            }
        )
        session.close()
        del session
        release_memory(torch.device("cpu"))
    return out
