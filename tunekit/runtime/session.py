"""The training session inside one worker rank: what tuners' runtime hooks change.

A :class:`Session` owns the model, the optimizer, the data source and the
gradient synchronisation strategy of one rank. :meth:`Session.apply_config`
resets it to the workload's defaults and then runs each tuner's ``apply``
hook; model parameters, optimizer state and the step counter carry over, so
the same call serves fresh trials, live config changes and rollbacks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from tunekit.config import TuningConfig, config_layout, resolve
from tunekit.errors import ConfigError, WorkloadError
from tunekit.layout import Layout
from tunekit.observe.memory import StepPeaks
from tunekit.runtime.data import BatchSource
from tunekit.runtime.sharding import (
    BlockCheckpointing,
    FSDPSync,
    checkpointed_blocks,
    model_blocks,
    shard_model,
)
from tunekit.runtime.sync import LAYOUT_FEATURES, DDPSync, GradSync, LocalSync, overlap_ratio
from tunekit.workload import Workload

FEATURE_WHY = {
    "amp": "its forward runs outside the session's autocast",
    "grad_scaler": "fp16's loss scale must unscale every gradient before any update",
    "accumulation": "its reductions would run on every micro-batch",
    "scheduler": "it steps the optimizer more than once per step",
    "clipping": "clipping needs the whole gradient before any update",
    "sharded": "FSDP holds the parameters and gradients in shards, reduced by FSDP itself",
    "checkpointed": "checkpointed blocks recompute their forward inside backward",
}
"""Why a strategy that updates in pieces cannot take a training feature as it is."""

StepFn = Callable[["Session", int], torch.Tensor]
"""A replacement training step for tuners that change how the model executes
(placement): ``(session, step) -> loss``; it must leave parameters updated. It
lists the training features it honours in a ``handles`` attribute (a frozenset
of ``Workload.features()`` names); a job using others refuses it."""


@dataclass
class StepRecord:
    step: int
    """Index of the step (0-based) this record measured."""
    loss: float
    step_s: float
    """Wall time of the whole step on this rank."""
    data_s: float
    """Part of ``step_s`` spent getting the batch."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Extra measurements (e.g. ``overlap_R``, ``comm``) from the strategy."""


class Session:
    """One rank's training state and the knobs tuners turn."""

    def __init__(
        self,
        workload: Workload,
        *,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
        backend: str = "gloo",
        seed: int | None = None,
        layout: Layout | None = None,
        memory_cap_bytes: int | None = None,
        track_memory: bool = False,
    ):
        self.workload = workload
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device or torch.device("cpu")
        self.group = group
        self.backend = backend
        # A sharded job's gathered parameters are freed in gloo's threads, unseen and (large)
        # seldom reused: its steps are measured from a count of what the session holds.
        sharded = (layout or workload.layout()).sharded
        self.memory = StepPeaks(
            self.device, memory_cap_bytes, resident=self.resident_bytes if sharded else None
        )
        """Each step's peak memory on this rank (``StepRecord.metrics["peak_bytes"]``), checked
        against the cap; measured on CUDA always, on the CPU when asked or capped."""
        if track_memory or memory_cap_bytes is not None or self.device.type == "cuda":
            self.memory.start()  # before the model: it counts
        else:
            self.memory.stop()
        self.layout = layout or workload.layout()
        """How the model is laid out now. Its build part (sharding, resharding, offload) is
        fixed for the session's life; its checkpointing changes at step boundaries."""
        # Same seed on every rank: identical initial parameters without a broadcast.
        torch.manual_seed(workload.seed if seed is None else seed)
        model = workload.model()
        self.blocks = model_blocks(model)
        """Module paths of the model's blocks (what FSDP shards and checkpointing recomputes)."""
        try:
            if self.layout.sharded:  # FSDP places the shards on the device itself
                shard_model(
                    model,
                    self.blocks,
                    self.layout,
                    precision=workload.precision,
                    device=self.device,
                    group=group,
                )
            else:
                model = model.to(self.device)
            self.model = model
            self._checkpointing: BlockCheckpointing | None = None
            self._install_checkpointing(self.layout)
        except ConfigError as exc:
            raise WorkloadError(f"workload {workload.name!r}: {exc}") from None
        self.optimizer = workload.optimizer(self.model.parameters(), workload.lr)
        # The base rates: a scheduler built before the session (tunekit.prepare's) has already
        # moved "lr" to its first point and kept the base as "initial_lr".
        self._base_group_lrs = [g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups]
        self.scheduler = (
            workload.scheduler(self.optimizer) if workload.scheduler is not None else None
        )
        self.scaler = torch.amp.GradScaler(self.device.type) if workload.uses_scaler else None
        self.accumulation = workload.accumulation
        """Micro-batches per optimizer step (a batch tuner may trade it against the batch)."""
        self.batch_size = workload.batch_size
        self.dp_world_size = world_size
        """Data-parallel degree: ranks that each take a different shard of the batch.
        A tuner that makes ranks share samples (model parallelism) lowers it."""
        self.lr = workload.lr
        self.step = 0
        self.data = BatchSource(
            workload,
            rank=rank,
            world_size=world_size,
            device=self.device,
            batch_size=self.batch_size,
            seed=seed,
        )
        self.step_fn: StepFn | None = None
        self.config = TuningConfig()
        self._grad_sync: GradSync | None = None
        self._reset_callbacks: list[Callable[[], None]] = []
        self.set_grad_sync(self.default_grad_sync())

    # -- knobs tuners turn ---------------------------------------------------------

    @property
    def grad_sync(self) -> GradSync:
        sync = self._grad_sync
        # None only while set_grad_sync swaps strategies, which always ends with one set.
        assert sync is not None, "no gradient strategy: set_grad_sync is attaching one"
        return sync

    def default_grad_sync(self) -> GradSync:
        if self.layout.sharded:
            return FSDPSync()
        return DDPSync() if self.world_size > 1 else LocalSync()

    def features(self) -> frozenset[str]:
        """The workload's training features in use now (see ``Workload.features``), with
        the layout's (``sharded``, ``checkpointed``) as the session runs it."""
        out = set(self.workload.features()) - LAYOUT_FEATURES
        out.discard("accumulation")
        if self.accumulation > 1:
            out.add("accumulation")
        if self.layout.sharded:
            out.add("sharded")
        if self._checkpointing is not None and self._checkpointing.blocks:
            out.add("checkpointed")
        return frozenset(out)

    def set_layout(self, layout: Layout) -> None:
        """Lay the model out as ``layout`` says, at a step boundary.

        Its checkpointing changes now; its build part (sharding, resharding, offload) must
        be the session's own: a session cannot re-shard itself, so a config that changes
        it is run by a new session (a relaunch trial, or a live job relaunched from its
        checkpoint). Refused in one line, leaving the layout as it was."""
        if self.layout.needs_rebuild(layout):
            changed = ", ".join(
                f"{k}={v!r}" for k, v in layout.build_part().items() if getattr(self.layout, k) != v
            )
            raise ConfigError(
                f"{changed} needs the model rebuilt: the job must be relaunched with it "
                f"(this session runs {self.layout.describe()})"
            )
        if layout == self.layout:
            return
        previous = self.layout
        self._install_checkpointing(layout)
        try:
            self.check_features(f"gradient strategy {self.grad_sync.name}", self.grad_sync.handles)
            if self.step_fn is not None:
                self.check_features(
                    "the placement's training step", getattr(self.step_fn, "handles", frozenset())
                )
        except ConfigError:
            self._install_checkpointing(previous)
            raise

    def set_checkpointing(
        self, policy: str, every: int = 1, blocks: tuple[str, ...] | list[str] | None = None
    ) -> None:
        """Activation checkpointing at a step boundary: ``none``, ``full`` or ``selective``,
        on every ``every``-th block or on the ``blocks`` named (see :class:`Layout`)."""
        self.set_layout(
            self.layout.with_changes(
                {"checkpointing": policy, "checkpoint_every": every, "checkpoint_blocks": blocks}
            )
        )

    def _install_checkpointing(self, layout: Layout) -> None:
        chosen = checkpointed_blocks(self.blocks, layout)  # raises before anything changes
        if self._checkpointing is not None:
            self._checkpointing.remove()
            self._checkpointing = None
        if chosen:
            self._checkpointing = BlockCheckpointing(self.model, chosen, layout.checkpointing)
        self.layout = layout

    def _optimizer_state(self) -> list[torch.Tensor]:
        return [
            v for state in self.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)
        ]  # fmt: skip

    def resident_bytes(self) -> int | None:
        """Bytes this rank holds between steps: parameters (its shards), buffers, gradients
        still alive, optimizer state, tensors a runtime hook keeps on the session (an
        attribute, a list or dict of them) and the gradient strategy's buffers; None when
        the strategy does not say what it holds."""
        sync = self._grad_sync
        held = sync.resident_bytes() if sync is not None else None
        if held is None:
            return None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        kept: list[torch.Tensor] = []
        for value in vars(self).values():
            items = value.values() if isinstance(value, dict) else value
            if isinstance(items, list | tuple):
                kept += [t for t in items if isinstance(t, torch.Tensor)]
            elif isinstance(value, torch.Tensor):
                kept.append(value)
        return int(
            storage_bytes([*self.model.parameters(), *self.model.buffers(), *grads, *kept])
            + storage_bytes(self._optimizer_state())
            + held
        )

    def memory_breakdown(self) -> dict[str, Any]:
        """What filled this rank's memory at its measured peak: what the rank holds between
        steps, counted (parameters or their shards, buffers, optimizer state), and the rest of
        the peak (activations, gradients, collective buffers, temporaries)."""
        from tunekit.memory import format_bytes

        peak = float(self.memory.max or 0)
        held = {
            "parameters": storage_bytes([*self.model.parameters(), *self.model.buffers()]),
            "optimizer": storage_bytes(self._optimizer_state()),
        }
        parts = {**held, "within_step": max(0.0, peak - sum(held.values()))}
        line = (
            f"memory per rank ({self.layout.describe()}): {format_bytes(peak)} measured peak"
            + (f" of a {format_bytes(self.memory.cap_bytes)} cap" if self.memory.cap_bytes else "")
            + f"; parameters {format_bytes(held['parameters'])}, optimizer state "
            f"{format_bytes(held['optimizer'])}, activations, gradients and buffers of a step "
            f"{format_bytes(parts['within_step'])}"
        )
        return {"peak_bytes": peak, "parts": parts, "line": line, "method": self.memory.method}

    @property
    def checkpointed(self) -> list[str]:
        """The blocks checkpointed now."""
        return list(self._checkpointing.blocks) if self._checkpointing is not None else []

    def check_features(self, who: str, handles: frozenset[str]) -> None:
        """Refuse, in one line, to run ``who`` on a job using a feature it does not honour
        (it would silently train with other arithmetic)."""
        missing = sorted(self.features() - handles)
        if missing:
            raise ConfigError(
                f"{who} does not honour {', '.join(missing)} ({FEATURE_WHY[missing[0]]}); "
                "the job keeps its current configuration"
            )

    def set_grad_sync(self, sync: GradSync) -> None:
        """Replace the gradient synchronisation strategy (at a step boundary)."""
        self.check_features(f"gradient strategy {sync.name}", sync.handles)
        if self._grad_sync is not None:
            self._grad_sync.flush()
            self._grad_sync.detach()
        self._grad_sync = None
        try:
            sync.attach(self)
        except Exception:
            # Never leave the session without a strategy: fall back to the default.
            fallback = self.default_grad_sync()
            fallback.attach(self)
            self._grad_sync = fallback
            raise
        self._grad_sync = sync

    def set_accumulation(self, micro_batches: int) -> None:
        """Micro-batches per optimizer step; the learning rate follows the global batch."""
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ConfigError(f"accumulation must be an int of 1 or more, not {micro_batches!r}")
        if micro_batches > 1 and "accumulation" not in self.grad_sync.handles:
            raise ConfigError(
                f"gradient strategy {self.grad_sync.name} does not honour accumulation"
            )
        self.accumulation = micro_batches
        self.set_lr(self.scaled_lr())

    def set_micro_batches(self, micro_batches: int) -> None:
        """Split the samples each rank takes per step (batch size x accumulation, kept) into
        ``micro_batches`` equal micro-batches: less activation memory per forward, more
        passes. The global batch and learning rate stay, so the workload's ``batch_range``
        does not limit the micro-batch. Refused in one line when they do not divide evenly."""
        per_rank = self.batch_size * self.accumulation
        if not isinstance(micro_batches, int) or micro_batches < 1 or per_rank % micro_batches:
            raise ConfigError(
                f"{micro_batches!r} micro-batches do not divide the {per_rank} samples each rank "
                f"takes per step (batch {self.batch_size} x accumulation {self.accumulation})"
            )
        if micro_batches > 1 and "accumulation" not in self.grad_sync.handles:
            raise ConfigError(
                f"gradient strategy {self.grad_sync.name} does not honour accumulation"
            )
        self.accumulation = micro_batches
        self.batch_size = per_rank // micro_batches
        self.data.set_batch_size(self.batch_size)

    def set_batch_size(self, batch_size: int) -> None:
        """Change the per-rank batch and rescale the learning rate by the workload's rule."""
        rng = self.workload.batch_range
        if batch_size != self.workload.batch_size and (
            rng is None or not rng[0] <= batch_size <= rng[1]
        ):
            allowed = f"within {rng}" if rng else "(the workload sets no batch_range)"
            raise ConfigError(f"batch size {batch_size} is not allowed {allowed}")
        self.batch_size = batch_size
        self.data.set_batch_size(batch_size)
        self.set_lr(self.scaled_lr())

    def set_data_parallel(self, degree: int) -> None:
        """Set the data-parallel degree (global batch = batch_size x degree); rescale the lr."""
        if degree < 1 or self.world_size % degree:
            raise ConfigError(
                f"data-parallel degree {degree} must divide the world size {self.world_size}"
            )
        self.dp_world_size = degree
        self.set_lr(self.scaled_lr())

    @property
    def global_batch(self) -> int:
        """Samples one training step (one optimizer update) consumes, over all ranks."""
        return self.batch_size * self.accumulation * self.dp_world_size

    def scaled_lr(self) -> float:
        """The workload's learning rate for the current global batch, by its scaling rule."""
        base = self.workload.batch_size * self.workload.accumulation * self.world_size
        return self.workload.lr_for_ratio(self.global_batch / base)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate; groups keep their ratios to the workload's lr.

        With a scheduler, ``lr`` is the schedule's base: the scheduler's base rates
        follow it, and each group keeps its current point on the schedule (its rate
        changes by the same factor as its base)."""
        self.lr = lr
        scale = lr / self.workload.lr
        for i, (group, base) in enumerate(
            zip(self.optimizer.param_groups, self._base_group_lrs, strict=True)
        ):
            new_base = base * scale
            if self.scheduler is not None:
                old_base = self.scheduler.base_lrs[i]
                group["lr"] = group["lr"] * (new_base / old_base) if old_base else new_base
                _set_base_lr(self.scheduler, i, new_base)
                group["initial_lr"] = new_base
            else:
                group["lr"] = new_base

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """One update from the (reduced) gradients: unscale (fp16), clip, step, schedule.

        Every gradient strategy that updates the whole model at once calls this
        instead of ``optimizer.step()``, so mixed precision, clipping and the
        scheduler mean the same under every strategy."""
        opt = optimizer or self.optimizer
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        clip = self.workload.clip_grad_norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for g in opt.param_groups for p in g["params"]], clip, foreach=None
            )
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def autocast(self):
        """The forward's mixed-precision context (a no-op in fp32)."""
        precision = self.workload.precision
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled against underflow when the workload uses fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the session next returns to the workload's defaults."""
        self._reset_callbacks.append(callback)

    # -- configs ---------------------------------------------------------------------

    def reset(self) -> None:
        """Return to the workload's defaults, keeping parameters, optimizer state and step
        (and the layout's build part, which only a new session changes)."""
        self.grad_sync.flush()
        while self._reset_callbacks:
            self._reset_callbacks.pop()()
        self.step_fn = None
        self._install_checkpointing(self.layout.with_changes(self.workload.layout().step_part()))
        self.dp_world_size = self.world_size
        self.accumulation = self.workload.accumulation
        if self.batch_size != self.workload.batch_size:
            self.set_batch_size(self.workload.batch_size)
        self.set_lr(self.workload.lr)
        self.set_grad_sync(self.default_grad_sync())
        self.config = TuningConfig()

    def apply_config(self, config: TuningConfig, tuners: Mapping[str, Any]) -> None:
        """Reset, then run each tuner's runtime hook in aspect order."""
        plan = resolve(config, tuners)
        layout = config_layout(plan, self.workload.layout())
        if self.layout.needs_rebuild(layout):  # before reset: a refused config changes nothing
            self.set_layout(layout)
        self.reset()
        self.set_layout(layout)
        for tuner, knobs in plan:
            tuner.apply(self, knobs)
        if self.step_fn is not None:
            if self.layout.sharded:
                raise ConfigError(
                    "a placement's own training step cannot run a sharded (FSDP) model; "
                    "the job keeps its current configuration"
                )
            # A placement's own training step lists what it honours on the function.
            self.check_features(
                "the placement's training step", getattr(self.step_fn, "handles", frozenset())
            )
        self.config = TuningConfig({t.name: k for t, k in plan})

    # -- the loop --------------------------------------------------------------------

    def train_step(self) -> StepRecord:
        """Run one training step and time it (and measure its peak memory, when measuring).

        Raises ``MemoryCapExceeded`` (an out-of-memory error) when the step's peak went over
        the session's memory cap."""
        window = self.memory.open()
        start = time.perf_counter()
        if self.step_fn is not None:
            data_s = 0.0
            loss = self.step_fn(self, self.step)
        else:
            data_s = 0.0
            sync = self.grad_sync
            sync.before_forward()
            total = 0.0
            for micro in range(self.accumulation):
                t0 = time.perf_counter()
                with record_function("tunekit.data"):
                    inputs, targets = self.data.batch(self.micro_step(micro))
                data_s += time.perf_counter() - t0
                last = micro == self.accumulation - 1
                # Micro-batches before the last only accumulate: no reduction yet.
                with sync.accumulating() if not last else contextlib.nullcontext():
                    with self.autocast():
                        loss = self.workload.loss(sync.module(inputs), targets)
                    self.backward(loss / self.accumulation if self.accumulation > 1 else loss)
                total += float(loss.detach()) if self.accumulation > 1 else 0.0
            sync.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
            if self.accumulation > 1:
                loss = torch.tensor(total / self.accumulation)
        loss_value = float(loss.detach())  # also waits for the device
        elapsed = time.perf_counter() - start
        metrics: dict[str, Any] = {}
        peak = self.memory.close(window, self.step)
        if peak is not None:
            metrics["peak_bytes"] = peak
        records = self.grad_sync.comm_records()
        if records:
            metrics["overlap_R"] = overlap_ratio(records)
            metrics["comm"] = [r.__dict__ for r in records]
        rec = StepRecord(self.step, loss_value, elapsed, data_s, metrics)
        self.step += 1
        return rec

    def micro_step(self, micro: int) -> int:
        """The data index of micro-batch ``micro`` of the current step: batches stay a pure
        function of (seed, index, rank) with accumulation too."""
        return self.step * self.accumulation + micro

    def flush(self) -> None:
        self.grad_sync.flush()

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (call on a flushed session).

        Replicated (DDP): the model's and optimizer's own state dicts, whole on every rank.
        Sharded (FSDP): this rank's shards, keyed by parameter name
        (``torch.distributed.checkpoint.state_dict.get_state_dict``), for
        ``torch.distributed.checkpoint`` to save (see :mod:`tunekit.runtime.checkpoint`)."""
        self.flush()
        if self.layout.sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(self.model, self.optimizer)
        else:
            model_state, optim_state = self.model.state_dict(), self.optimizer.state_dict()
        return {
            "step": self.step,
            "model": model_state,
            "optimizer": optim_state,
            "layout": self.layout.to_dict(),
            "config": self.config.to_dict(),
            "base_group_lrs": list(self._base_group_lrs),
            "rng": torch.get_rng_state(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s output, of this layout or of a replicated job's
        (a sharded session takes a whole model and optimizer and keeps its shards)."""
        if self.layout.sharded:
            from tunekit.runtime.checkpoint import load_into_sharded

            load_into_sharded(self, state["model"], state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.restore_progress(state)

    def restore_progress(self, state: Mapping[str, Any]) -> None:
        """What a checkpoint holds besides the model and optimizer: the step, the learning
        rates' bases, the scheduler's and scaler's states, the RNG (a tensor, or its bytes
        as a list from a sharded checkpoint's JSON)."""
        # The saved groups hold the lr of the saved config; the caller re-applies
        # that config, which rescales from these bases.
        self._base_group_lrs = list(state["base_group_lrs"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.set_lr(self.lr)
        self.step = int(state["step"])
        rng = state["rng"]
        torch.set_rng_state(
            rng if isinstance(rng, torch.Tensor) else torch.tensor(rng, dtype=torch.uint8)
        )

    def close(self) -> None:
        self.grad_sync.flush()
        self.grad_sync.detach()
        self.data.close()
        self.memory.stop()


def storage_bytes(tensors) -> float:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: this rank's shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return float(sum(seen.values()))


def _set_base_lr(scheduler, group: int, lr: float) -> None:
    """A scheduler's base rate of one parameter group, and its parts' (SequentialLR,
    ChainedScheduler keep schedulers of their own)."""
    scheduler.base_lrs[group] = lr
    for part in getattr(scheduler, "_schedulers", ()):
        _set_base_lr(part, group, lr)
