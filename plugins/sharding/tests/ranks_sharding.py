"""Functions run on spawned gloo ranks (``tunekit.testing.run_ranks``) by the tests and the
benchmark: configs of a workload measured one after another in one process group, each in
a fresh session built as a trial builds it (the config's layout from the start, then its
hooks), its steps timed (the slowest rank's) and its peak per rank measured as a trial
measures it (the warm-up steps tracked; every step under a cap)."""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from tunekit.config import TuningConfig, config_layout, resolve
from tunekit.plugin_loading import load_named, select
from tunekit.plugins.sharding.search import step_or_out_of_memory
from tunekit.runtime.session import Session
from tunekit.workload import load_workload


def _agree_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]


def sharding_config(layout: dict[str, Any] | None = None, micro_batches: int = 0) -> dict:
    """The tunekit config of a setting of the sharding tuner's knobs."""
    knobs: dict[str, Any] = dict(layout or {})
    if micro_batches:
        knobs["micro_batches"] = micro_batches
    return TuningConfig({"sharding": knobs} if knobs else {}).to_dict()


def measure_configs(
    rank: int,
    world: int,
    spec: str,
    configs: list[dict[str, Any]],
    warmup: int = 3,
    steps: int = 5,
    cap_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """Each config trained for ``warmup`` + ``steps`` steps: its median step (the slowest
    rank's), its peak (the largest rank's), its losses, and ``oom`` when a step went over
    ``cap_bytes`` on any rank (every rank stops that config together)."""
    workload = load_workload(spec)
    out = []
    for raw in configs:
        config = TuningConfig.from_dict(raw)
        names = sorted(config.plugins)
        tuners = select(load_named(names), names) if names else {}
        layout = config_layout(resolve(config, tuners), workload.layout())
        session = Session(
            workload,
            rank=rank,
            world_size=world,
            layout=layout,
            memory_cap_bytes=cap_bytes,
            track_memory=True,
        )
        session.apply_config(config, tuners)
        times: list[float] = []
        losses: list[float] = []
        status = "ok"
        for i in range(warmup + steps):
            rec = step_or_out_of_memory(session)
            if _agree_max([1.0 if rec is None else 0.0])[0] > 0:
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
                "config": raw,
                "layout": session.layout.describe(),
                "micro_batches": session.accumulation,
                "status": status,
                "step_s": statistics.median(slowest) if slowest else None,
                "steps_s": slowest,
                "peak_bytes": peak if peak >= 0 else None,
                "losses": losses,
            }
        )
        session.close()
        del session
    return out


def split_against_whole(rank: int, world: int, steps: int = 3) -> dict[str, Any]:
    """The tiny dataset MLP trained whole and split into 2 micro-batches (DDP, and FSDP):
    every step's loss, and the replicated jobs' parameters (run in float64)."""
    from tunekit.api import Layout
    from tunekit.testing import tiny_dataset_workload

    workload = tiny_dataset_workload()
    out: dict[str, Any] = {}
    for name, layout, micro in (
        ("whole", Layout(), 1),
        ("split", Layout(), 2),
        ("fsdp_split", Layout(sharding="fsdp"), 2),
    ):
        session = Session(workload, rank=rank, world_size=world, layout=layout)
        if micro > 1:
            session.set_micro_batches(micro)
        out[f"{name}_losses"] = [session.train_step().loss for _ in range(steps)]
        if not layout.sharded:
            out[f"{name}_params"] = {
                k: v.detach().clone() for k, v in session.model.state_dict().items()
            }
        session.close()
    return out
