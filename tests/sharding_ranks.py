"""Rank functions for the sharded-layout tests (importable by spawned ranks: ``tests`` is on
the path). Each builds many sessions in one process group, so that a whole grid of layouts
costs one start of the ranks."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunekit.layout import Layout
from tunekit.runtime.session import Session
from tunekit.testing import tiny_gpt_workload

STEPS = 3
FSDP_LAYOUTS = [
    Layout(sharding="fsdp", reshard_after_forward=reshard, cpu_offload=offload, **ckpt)
    for reshard in (True, False)
    for offload in (False, True)
    for ckpt in ({"checkpointing": "full"}, {"checkpointing": "full", "checkpoint_every": 2})
]
"""FSDP (both reshard settings, with and without CPU offload) x checkpointing (full, every k-th)."""


def full_state(session: Session) -> dict[str, torch.Tensor]:
    """The model's whole parameters on every rank (gathered from shards under FSDP)."""
    if session.layout.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(session.model, options=StateDictOptions(full_state_dict=True))
    else:
        state = session.model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def _trained(
    layout: Layout, accumulation: int, rank: int, world: int, install=None
) -> dict[str, Any]:
    workload = replace(tiny_gpt_workload(), accumulation=accumulation)
    s = Session(workload, rank=rank, world_size=world, group=dist.group.WORLD, layout=layout)
    if install is not None:
        install(s)
    losses = [s.train_step().loss for _ in range(STEPS)]
    out = {"params": full_state(s), "losses": torch.tensor(losses), "sync": s.grad_sync.name}
    s.close()
    return out


def _strategy(how: str):
    """A gradient strategy of the built-in tuners that claims to honour checkpointing."""
    if how == "two_chunk":
        from tunekit.plugins.overlap_chunking.runtime import apply_two_chunk

        return lambda s: apply_two_chunk(s, 2, 0)
    from tunekit.plugins.cgdp.runtime import CgdpSync

    return lambda s: s.set_grad_sync(CgdpSync(chunk_size=2))


def equivalence(rank: int, world: int) -> dict[str, Any]:
    """Every FSDP layout with checkpointing, at accumulation 1 and 2, checkpointing alone under
    DDP, and the tuners' reducers that claim to honour checkpointing, each trained from the same
    start on the same batches as the DDP baseline."""
    out: dict[str, Any] = {}
    for acc in (1, 2):
        out[f"ddp/acc{acc}"] = _trained(Layout(), acc, rank, world)
        out[f"ddp+ckpt/acc{acc}"] = _trained(Layout(checkpointing="full"), acc, rank, world)
        for layout in FSDP_LAYOUTS:
            out[f"{layout.describe()}/acc{acc}"] = _trained(layout, acc, rank, world)
    for how in ("two_chunk", "cgdp"):
        out[f"{how}+ckpt"] = _trained(Layout(checkpointing="full"), 1, rank, world, _strategy(how))
    return out


def checkpoints(rank: int, world: int, folder: str) -> dict[str, Any]:
    """A sharded job saved with DCP and loaded back: into the same layout (it goes on exactly),
    into a replicated job (resharded), and a replicated job's state into a sharded one."""
    from tunekit.runtime.checkpoint import load_sharded, save_sharded

    fsdp = Layout(sharding="fsdp", checkpointing="full")
    w = tiny_gpt_workload()

    def session(layout: Layout) -> Session:
        return Session(w, rank=rank, world_size=world, group=dist.group.WORLD, layout=layout)

    out: dict[str, Any] = {}
    s = session(fsdp)
    for _ in range(2):
        s.train_step()
    save_sharded(s, Path(folder))
    out["saved"] = full_state(s)
    out["saved_step"] = s.step
    for _ in range(2):
        s.train_step()
    out["continued"] = full_state(s)
    s.close()

    again = session(fsdp)
    extras = load_sharded(again, Path(folder))
    assert extras["step"] == 2 and again.step == 2, extras
    for _ in range(2):
        again.train_step()
    out["resumed_sharded"] = full_state(again)
    again.close()

    replicated = session(Layout())
    load_sharded(replicated, Path(folder))
    for _ in range(2):
        replicated.train_step()
    out["resumed_replicated"] = full_state(replicated)

    # A replicated job's own state dict (what a DDP live job checkpoints) into a sharded job.
    base = session(Layout())
    for _ in range(2):
        base.train_step()
    state = copy.deepcopy(base.state_dict())  # as written to disk: not the live tensors
    for _ in range(2):
        base.train_step()
    out["ddp_continued"] = full_state(base)
    sharded = session(fsdp)
    sharded.load_state_dict(state)
    for _ in range(2):
        sharded.train_step()
    out["ddp_into_sharded"] = full_state(sharded)
    return out
