"""Rank functions for this plugin's multi-process tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunekit.config import TuningConfig
from tunekit.plugins.overlap_chunking.plugin import OverlapChunking
from tunekit.plugins.overlap_chunking.runtime import apply_two_chunk
from tunekit.runtime.session import Session
from tunekit.workload import Workload, load_workload


def _mlp_model() -> nn.Module:
    # The first layer is fully connected (its input needs no gradient), an
    # in-place ReLU follows a replicated layer, and BatchNorm has buffers.
    return nn.Sequential(
        nn.Linear(20, 64),
        nn.ReLU(inplace=True),
        nn.BatchNorm1d(64),
        nn.Linear(64, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 5),
    )


def _mlp_batch(n: int, generator: torch.Generator):
    x = torch.randn(n, 20, generator=generator)
    return x, (x[:, :5].argmax(dim=1))


def mlp() -> Workload:
    return Workload(name="mlp", model=_mlp_model, make_batch=_mlp_batch, batch_size=8, lr=0.05)


def adam_cnn() -> Workload:
    """The example CNN with Adam, whose per-parameter state includes a step count.

    A large eps keeps Adam from turning float-order noise in near-zero
    gradients into full-size steps, so runs can be compared with a tolerance.
    """
    wl = load_workload("example:cnn")
    wl.optimizer = lambda params, lr: torch.optim.Adam(params, lr=1e-3, eps=1e-3, weight_decay=1e-4)
    return wl


def _workload(spec: str) -> Workload:
    return {"adam_cnn": adam_cnn, "mlp": mlp}.get(spec, lambda: load_workload(spec))()


def train(rank: int, world: int, spec: str, steps: int, schedule: list) -> dict[str, Any]:
    """Train ``steps`` steps, switching config at the given steps (None: the baseline).

    Returns this rank's final parameters, buffers and optimizer state (after a
    flush), and per step its communications and overlap ratio.
    """
    session = Session(_workload(spec), rank=rank, world_size=world, group=dist.group.WORLD)
    tuners = {"overlap_chunking": OverlapChunking()}
    changes = {step: knobs for step, knobs in schedule}
    per_step = []
    for step in range(steps):
        if step in changes:
            knobs = changes[step]
            if knobs is not None and "piece_bytes" in knobs:
                # Not a knob: small pieces split one chunk into many all-reduces.
                session.apply_config(TuningConfig(), tuners)
                apply_two_chunk(session, knobs["k"], knobs["f"], piece_bytes=knobs["piece_bytes"])
            else:
                config = TuningConfig({"overlap_chunking": knobs}) if knobs else TuningConfig()
                session.apply_config(config, tuners)
        rec = session.train_step()
        comms = rec.metrics.get("comm", [])
        per_step.append(
            {
                "loss": rec.loss,
                "sync": session.grad_sync.name,
                "comms": [c["name"] for c in comms],
                "timings": [(c["own_s"], c["blocked_s"]) for c in comms],
                "R": rec.metrics.get("overlap_R"),
            }
        )
    state = session.state_dict()  # flushes deferred updates
    session.close()
    return {
        "params": {n: p.detach().clone() for n, p in session.model.named_parameters()},
        "buffers": {n: b.clone() for n, b in session.model.named_buffers()},
        "requires_grad": all(p.requires_grad for p in session.model.parameters()),
        "optimizer": state["optimizer"],
        "steps": per_step,
    }


def train_many(
    rank: int, world: int, spec: str, steps: int, schedules: dict[str, list]
) -> dict[str, Any]:
    """:func:`train` for several schedules in the same ranks (one process start for all)."""
    return {name: train(rank, world, spec, steps, schedule) for name, schedule in schedules.items()}
