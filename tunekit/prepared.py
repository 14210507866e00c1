"""``tunekit.prepare``: a tuned config inside your own training loop, without tunekit owning it.

::

    import tunekit

    model, optimizer, step = tunekit.prepare(model, optimizer, loss_fn, config="best_config.json")
    for inputs, targets in loader:  # build the loader with batch_size=step.batch_size
        loss = step(inputs, targets)

Run the script under ``torchrun`` as before (``prepare`` joins the process
group torchrun describes, or uses the one you initialised). Each call of
``step`` is one optimizer step on this rank's batch, exactly as ``tunekit run``
would train it under the same config: the tuners' own runtime hooks install
their gradient reducer (DDP buckets, two_chunk, the CGDP reducer) or their
executor (layer_split), and the training features you pass (mixed precision,
accumulation, a scheduler, clipping) mean the same as in a ``Workload``.

A config that chose another batch size (``batch_ps_sizing``) sets
``step.batch_size``: build your loader with it (``step`` refuses a batch of
another size rather than train a different job).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunekit.config import TuningConfig
from tunekit.errors import ConfigError
from tunekit.layout import CheckpointPolicy, Sharding
from tunekit.runtime.session import Session
from tunekit.workload import Batch, LrScaling, Precision, Workload

__all__ = ["Prepared", "prepare"]


def _size(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    if isinstance(x, tuple | list):
        return _size(x[0])
    if isinstance(x, Mapping):
        return _size(next(iter(x.values())))
    raise TypeError(f"cannot tell the batch size of {type(x).__name__}")


def _map(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple | list):
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, Mapping):
        return {k: _map(fn, v) for k, v in x.items()}
    return x


class PushedBatches:
    """Where the session's data source was: the batches the user's loop hands to ``step``."""

    def __init__(self, session: Session):
        self.session = session
        self.pushed: Batch | None = None
        self.batch_size = session.batch_size

    def push(self, inputs: Any, targets: torch.Tensor) -> None:
        self.pushed = (inputs, targets)

    def set_batch_size(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def set_options(self, options: Any) -> None:  # a data tuner's knobs: the user owns the loader
        pass

    def _current(self) -> Batch:
        if self.pushed is None:
            raise ConfigError("no batch yet: call step(inputs, targets)")
        return self.pushed

    def batch(self, index: int) -> Batch:
        """Micro-batch ``index`` (``step * accumulation + m``) of the pushed batch, on the device."""
        inputs, targets = self._current()
        acc = self.session.accumulation
        m = index - self.session.step * acc
        if acc > 1:
            inputs, targets = (_map(lambda t: t.chunk(acc)[m], v) for v in (inputs, targets))
        device = self.session.device
        return _map(lambda t: t.to(device), inputs), _map(lambda t: t.to(device), targets)

    def global_batch(self, index: int) -> Batch:
        """Micro-batch ``index`` of every rank's pushed batch, in rank order (placements that
        split the whole batch), as ``BatchSource.global_batch``."""
        inputs, targets = self.batch(index)
        world = self.session.world_size
        if world == 1:
            return inputs, targets

        def gather(t: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=self.session.group)
            return torch.cat(parts)

        return _map(gather, inputs), _map(gather, targets)

    def close(self) -> None:
        self.pushed = None


class Prepared:
    """``step(inputs, targets) -> loss``: one optimizer step under the prepared config."""

    def __init__(self, session: Session):
        self.session = session
        self.data = PushedBatches(session)
        # A duck-typed stand-in for the session's BatchSource (batch, global_batch,
        # set_batch_size, set_options, close); it has no loader, so no .options.
        session.data = self.data  # type: ignore[assignment]

    @property
    def batch_size(self) -> int:
        """Samples per rank that one ``step`` takes (the config's batch when it set one)."""
        return self.session.batch_size * self.session.accumulation

    @property
    def config(self) -> TuningConfig:
        return self.session.config

    def __call__(self, inputs: Any, targets: torch.Tensor) -> float:
        got = _size(targets)
        if got != self.batch_size:
            raise ConfigError(
                f"step got a batch of {got} samples; this config trains {self.batch_size} per rank "
                "(build your loader with batch_size=step.batch_size)"
            )
        self.data.push(inputs, targets)
        return self.session.train_step().loss

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and step: what ``load_state_dict`` resumes from."""
        return self.session.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.session.load_state_dict(state)
        self.session.apply_config(self.session.config, _tuners())

    def close(self) -> None:
        self.session.close()


def _tuners():
    from tunekit.plugin_loading import available_tuners

    return available_tuners()


def _config(config: str | Path | Mapping[str, Any] | TuningConfig | None) -> TuningConfig:
    if config is None:
        return TuningConfig()
    if isinstance(config, TuningConfig):
        return config
    if isinstance(config, Mapping):
        return TuningConfig.from_dict(dict(config))
    return TuningConfig.load(config)


def _resharded_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer):
    """``(params, lr) -> optimizer``: one of ``optimizer``'s class, groups and settings over the
    model's parameters once FSDP has replaced them with shards (matched by name)."""
    if optimizer.state:
        raise ConfigError(
            "prepare(sharding='fsdp') needs a fresh optimizer: call it before the first step"
        )
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        ({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]])
        for g in optimizer.param_groups
    ]

    def build(_params, _lr: float) -> torch.optim.Optimizer:
        now = dict(model.named_parameters())
        # Every setting travels in its group (a group's keys override the defaults).
        return type(optimizer)(
            [{**settings, "params": [now[n] for n in members]} for settings, members in groups],
            lr=groups[0][0]["lr"],
        )

    return build


def _join_group(device: torch.device, even_alone: bool = False) -> None:
    """Join the process group torchrun describes, when the script has not already (on one
    rank too when ``even_alone``: FSDP shards over a group, even of one)."""
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    if dist.is_initialized() or world < (1 if even_alone else 2):
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    config: str | Path | Mapping[str, Any] | TuningConfig | None = "best_config.json",
    *,
    batch_size: int,
    lr_scaling: LrScaling = "linear",
    precision: Precision = "fp32",
    accumulation: int = 1,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    clip_grad_norm: float | None = None,
    example: Batch | None = None,
    device: torch.device | str | None = None,
    sharding: Sharding = "ddp",
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    checkpointing: CheckpointPolicy = "none",
    checkpoint_every: int = 1,
    checkpoint_blocks: tuple[str, ...] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, Prepared]:
    """Apply a tuned ``config`` (a ``best_config.json``, a dict or a TuningConfig) to your model.

    ``batch_size`` is your loader's per-rank batch (what the config was tuned
    from); ``example`` a batch of yours, needed by configs whose runtime traces
    the model (layer_split). Returns the model (unwrapped: save its state_dict as
    usual), the optimizer, and ``step``. See the module docstring.

    ``sharding`` ... ``checkpoint_blocks`` lay the model out as a ``Workload``'s fields of
    those names do (FSDP2 on its blocks, activation checkpointing). Sharded, the model
    returned is the FSDP module (its parameters are DTensor shards; save with
    ``step.state_dict()`` and ``torch.distributed.checkpoint``), and the optimizer returned
    is a new one of your optimizer's class and settings over the shards (yours held the
    unsharded parameters): call ``prepare`` before the first step.
    """
    cfg = _config(config)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    _join_group(device, even_alone=sharding == "fsdp")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = optimizer.param_groups[0]
    lr = first.get("initial_lr", first["lr"])  # a scheduler built already moved "lr" off its base

    def example_batch(n: int, generator: torch.Generator) -> Batch:
        if example is None:
            raise ConfigError(
                "this config traces the model: pass one of your batches, prepare(..., example=(inputs, targets))"
            )
        reps = -(-n // _size(example[1]))
        return tuple(_map(lambda t: torch.cat([t] * reps)[:n], part) for part in example)

    make_optimizer = (
        _resharded_optimizer(model, optimizer)
        if sharding == "fsdp"
        else lambda params, lr: optimizer
    )
    workload = Workload(
        name="prepared",
        model=lambda: model,
        make_batch=example_batch,
        loss=loss_fn,
        optimizer=make_optimizer,
        batch_size=batch_size,
        lr=lr,
        lr_scaling=lr_scaling,
        batch_range=(1, 1 << 20),  # the config's batch, if any, was checked when it was tuned
        precision=precision,
        accumulation=accumulation,
        scheduler=(lambda opt: scheduler) if scheduler is not None else None,
        clip_grad_norm=clip_grad_norm,
        sharding=sharding,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        checkpointing=checkpointing,
        checkpoint_every=checkpoint_every,
        checkpoint_blocks=checkpoint_blocks,
    )
    if scheduler is not None and sharding == "fsdp":
        raise ConfigError(
            "prepare(sharding='fsdp') builds a new optimizer over the shards, which your "
            "scheduler does not drive: pass scheduler=None and build it on the returned optimizer"
        )
    rng = torch.get_rng_state()  # a Session seeds the global generator; leave the user's alone
    try:
        session = Session(
            workload,
            rank=rank,
            world_size=world,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            device=device,
            group=dist.group.WORLD if world > 1 or dist.is_initialized() else None,
            backend=dist.get_backend() if dist.is_initialized() else "gloo",
        )
    finally:
        torch.set_rng_state(rng)
    step = Prepared(session)
    session.apply_config(cfg, _tuners())
    return session.model, session.optimizer, step
