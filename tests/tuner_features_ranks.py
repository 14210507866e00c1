"""Rank functions for the tuners' training-feature equivalence tests (importable by
spawned ranks: ``tests`` is on the path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunekit.runtime.session import Session
from tunekit.workload import load_workload

FEATURES = Path(__file__).parent / "data" / "feature_workloads.py"


def spec(variant: str) -> str:
    return f"{FEATURES}:{variant if variant.startswith(('tied', 'mlp_')) else f'mlp_{variant}'}"


def _install(session: Session, how: str, knobs: dict[str, Any]) -> None:
    if how == "ddp":
        return
    if how == "two_chunk":
        from tunekit.plugins.overlap_chunking.runtime import apply_two_chunk

        apply_two_chunk(session, knobs["k"], knobs["f"])
    elif how == "cgdp":
        from tunekit.plugins.cgdp.runtime import CgdpSync

        session.set_grad_sync(CgdpSync(**knobs))
    elif how == "layer_split":
        from tunekit.plugins.layer_split.plugin import LayerSplit

        tuner = LayerSplit()
        tuner.apply(session, tuner.validate({"plan": knobs["plan"]}))
        session.check_features("the placement's training step", session.step_fn.handles)
    elif how == "batch_ps_sizing":
        from tunekit.plugins.batch_ps_sizing.runtime import apply_batch_knobs

        apply_batch_knobs(session, knobs)
    elif how == "hybrid_mp":
        from tunekit.plugins.hybrid_mp.runtime import install_hybrid

        install_hybrid(session, _placement(), 2)
    else:
        raise ValueError(how)


def train(variant: str, how: str, knobs: dict[str, Any], steps: int) -> dict[str, Any]:
    """``steps`` steps of ``mlp_<variant>`` under one config; this rank's parameters, the
    losses, and the gradient norms clipping saw (DDP's reference only)."""
    session = Session(load_workload(spec(variant)), rank=dist.get_rank(), world_size=dist.get_world_size(),
                      group=dist.group.WORLD)  # fmt: skip
    if session.scaler is not None:
        # A loss scale so large the first steps overflow: the scaler must skip them (every
        # chunk's gradient in the inf check) and back off, then grow every 2 good steps.
        session.scaler = torch.amp.GradScaler(
            session.device.type, init_scale=2.0**22, growth_interval=2
        )
    norms: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording(*args, **kwargs):
        norm = clip(*args, **kwargs)
        norms.append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = recording
    try:
        _install(session, how, knobs)
        losses = [session.train_step().loss for _ in range(steps)]
        session.flush()
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
    out = {
        "params": {n: p.detach().clone() for n, p in session.model.named_parameters()},
        "losses": losses,
        "norms": norms,
        "lr": [g["lr"] for g in session.optimizer.param_groups],
        "scale": session.scaler.get_scale() if session.scaler is not None else None,
    }
    session.close()
    return out


def _placement() -> dict[str, int]:
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("feature_workloads", FEATURES)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return dict(module.HYBRID_PLACEMENT)


def train_many(rank: int, world: int, runs: list[tuple]) -> list[dict[str, Any]]:
    """:func:`train` for each ``(variant, how, knobs, steps)`` in one set of processes."""
    return [train(*run) for run in runs]


def refused(rank: int, world: int, variant: str, how: str, knobs: dict[str, Any]) -> str:
    """The one-line refusal of installing ``how`` on a job with ``variant``'s feature."""
    session = Session(
        load_workload(spec(variant)), rank=rank, world_size=world, group=dist.group.WORLD
    )
    try:
        _install(session, how, knobs)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        session.close()
    return "installed"


def refused_many(rank: int, world: int, cases: list[tuple]) -> list[str]:
    """:func:`refused` for each ``(variant, how, knobs)``."""
    return [refused(rank, world, *case) for case in cases]
