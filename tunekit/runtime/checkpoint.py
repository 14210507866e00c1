"""Sharded checkpoints: a session saved and loaded with ``torch.distributed.checkpoint`` (DCP).

A replicated (DDP) live job saves rank 0's ``step-<N>.pt`` (every rank holds the same
state). A sharded (FSDP) job holds a different shard on each rank, so every rank writes its
part of ``step-<N>.dcp/`` (DCP's own files) and rank 0 adds ``tunekit.json``: the step,
config, learning rates, scheduler, RNG, world size and layout.

Loading reshards: DCP reads each parameter by name and global shape, so a checkpoint taken
at one world size loads at another, and a sharded checkpoint loads into a replicated job
(and a replicated one into a sharded job), which is how a live job relaunches from DDP to
FSDP and back. Before anything is loaded, every parameter and optimizer tensor the session
needs is checked against the checkpoint's metadata (present, same global shape): a
mismatch is refused in one line and the session is left as it was, never half-loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tunekit.errors import TunekitError

if TYPE_CHECKING:
    from tunekit.runtime.session import Session

DCP_SUFFIX = ".dcp"
META_FILE = "tunekit.json"


class CheckpointMismatch(TunekitError):
    """A checkpoint that does not fit this session (another model, a missing tensor)."""


def is_sharded_checkpoint(path: Path) -> bool:
    return Path(path).is_dir() and Path(path).name.endswith(DCP_SUFFIX)


# -- what goes in --------------------------------------------------------------------------


def _tensors(session: Session) -> dict[str, Any]:
    """The session's model and optimizer state by parameter name: shards under FSDP,
    whole tensors under DDP (DCP saves a replicated tensor once)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(session.model, session.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _extras(session: Session) -> dict[str, Any]:
    """What is not a shard, as JSON: the same on every rank, written once by rank 0."""
    return {
        "step": session.step,
        "config": session.config.to_dict(),
        "base_group_lrs": list(session._base_group_lrs),
        "rng": torch.get_rng_state().tolist(),
        "scheduler": session.scheduler.state_dict() if session.scheduler is not None else None,
        "scaler": session.scaler.state_dict() if session.scaler is not None else None,
        "world_size": session.world_size,
        "layout": session.layout.to_dict(),
    }


def save_sharded(session: Session, path: Path) -> None:
    """Every rank: write this session's shards into ``path`` (a folder), rank 0 its extras.

    Collective: every rank of the session's group calls it. Raises OSError or RuntimeError
    (DCP's report of a failed write) on the rank that could not write."""
    import torch.distributed.checkpoint as dcp

    session.flush()
    path = Path(path)
    dcp.save(_tensors(session), checkpoint_id=str(path), process_group=session.group)
    if session.rank == 0:
        tmp = path / f"{META_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            json.dump(_extras(session), f)
        tmp.replace(path / META_FILE)


def read_extras(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointMismatch(f"checkpoint {path} has no readable {META_FILE}: {exc}") from None


def load_sharded(session: Session, path: Path) -> dict[str, Any]:
    """Every rank: load ``path`` into ``session`` (any world size, either layout); return
    its extras (``step``, ``config`` ...). Checked first, loaded only when it fits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    extras = read_extras(path)
    template = _tensors(session)
    check_fits(template, path)
    dcp.load(template, checkpoint_id=str(path), process_group=session.group)
    set_state_dict(
        session.model,
        session.optimizer,
        model_state_dict=template["model"],
        optim_state_dict=template["optimizer"],
    )
    session.restore_progress(extras)
    return extras


def check_fits(template: Mapping[str, Any], path: Path) -> None:
    """Every tensor of ``template`` is in the checkpoint with its global shape, or
    :class:`CheckpointMismatch` names the first that is not."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointMismatch(f"cannot read checkpoint {path}: {exc}") from None
    for key, tensor in _flat_tensors(template):
        meta = saved.get(key)
        if meta is None:
            raise CheckpointMismatch(
                f"checkpoint {path} does not fit this job: it has no {key} (another model?)"
            )
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(tensor.shape):
            raise CheckpointMismatch(
                f"checkpoint {path} does not fit this job: {key} is {tuple(meta.size)} "
                f"there and {tuple(tensor.shape)} here"
            )


def _flat_tensors(state: Any, prefix: str = ""):
    """``(dotted key, tensor)`` as DCP names them (``model.blocks.0.ln1.weight``,
    ``optimizer.state.blocks.0.ln1.weight.exp_avg``)."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _flat_tensors(value, f"{prefix}.{key}" if prefix else str(key))


# -- a whole (replicated) state into a sharded session --------------------------------------


def load_into_sharded(session: Session, model_state: Mapping, optim_state: Mapping) -> None:
    """Load a state dict into a sharded session: a whole one (a replicated job's
    ``model.state_dict()`` and ``optimizer.state_dict()``, keyed by parameter index) is
    sharded as it loads; a sharded one (:meth:`Session.state_dict` of a sharded session at
    this world size) is loaded as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.tensor import DTensor

    whole = not any(isinstance(v, DTensor) for v in model_state.values())
    if whole and any(isinstance(k, int) for k in optim_state.get("state", {})):
        optim_state = _by_name(session, optim_state)
    set_state_dict(
        session.model,
        session.optimizer,
        model_state_dict=dict(model_state),
        optim_state_dict=dict(optim_state),
        options=StateDictOptions(full_state_dict=whole),
    )


def _by_name(session: Session, optim_state: Mapping) -> dict[str, Any]:
    """A ``torch.optim`` state dict keyed by parameter index, re-keyed by parameter name
    (the indices count the session's optimizer's parameters in group order, as the saving
    job's optimizer, built by the same workload, counted them)."""
    names = {id(p): n for n, p in session.model.named_parameters()}
    order = [names[id(p)] for g in session.optimizer.param_groups for p in g["params"]]
    return {
        "state": {order[i]: v for i, v in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [order[i] for i in g["params"]]} for g in optim_state["param_groups"]
        ],
    }


def barrier(session: Session) -> None:
    if dist.is_initialized() and session.world_size > 1:
        dist.barrier(group=session.group)
