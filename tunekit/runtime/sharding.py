"""A :class:`~tunekit.layout.Layout` applied to a model: FSDP2 sharding and activation checkpointing.

Where the blocks come from. A block is the unit FSDP gathers in one collective
and checkpointing recomputes as one: the model's transformer blocks as
:mod:`tunekit.observe.blocks` finds them (``blocks.3``, ``transformer.h.3``),
else each top-level child that holds parameters (a CNN's ``features`` and
``classifier``, a ResNet's ``layer1`` ... ``layer4``). The same list names
blocks for sharding, for checkpointing and for the memory model.

Sharding follows torchtitan's order: ``fully_shard`` on each block, then on the
root (which keeps its parameters gathered from forward to backward: they are
the first that backward needs). It happens before the optimizer is built, so
the optimizer holds the sharded parameters (DTensors).

Checkpointing does not replace modules (no ``CheckpointWrapper``, whose extra
path component would rename every parameter): a checkpointed block's instance
gets a ``forward`` that runs the class's forward under
``torch.utils.checkpoint.checkpoint`` (non-reentrant). Removing it restores the
block; nothing is rebuilt, which is why checkpointing switches at a step
boundary. FSDP's hooks stay outside the checkpointed call, so a block's
parameters are gathered before its forward and again (by FSDP's pre-backward
hook) before its recomputation.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from tunekit.errors import ConfigError
from tunekit.layout import Layout
from tunekit.observe.blocks import block_of, block_units
from tunekit.runtime.sync import ALL_FEATURES, LAYOUT_FEATURES, GradSync

# -- blocks ---------------------------------------------------------------------------------


def model_blocks(model: nn.Module) -> list[str]:
    """Module paths of the model's blocks, in model order: its transformer blocks, or each
    top-level child that holds parameters (see the module docstring)."""
    leaves = [
        (name, type(module).__name__)
        for name, module in model.named_modules()
        if name and not any(True for _ in module.children())
    ]
    if block_units(leaves) is not None:
        out: list[str] = []
        for name, _ in leaves:
            block = block_of(name)
            if block is not None and block not in out:
                out.append(block)
        return out
    return [name for name, child in model.named_children() if any(True for _ in child.parameters())]


def checkpointed_blocks(blocks: Sequence[str], layout: Layout) -> list[str]:
    """The blocks ``layout`` checkpoints: those it names, or every k-th (0, k, 2k ...).

    Raises ConfigError naming ``checkpoint_blocks`` when it names a block the model lacks."""
    if not layout.checkpointed:
        return []
    if layout.checkpoint_blocks is None:
        return list(blocks[:: layout.checkpoint_every])
    missing = [b for b in layout.checkpoint_blocks if b not in blocks]
    if missing:
        shown = ", ".join(blocks[:8]) + (" ..." if len(blocks) > 8 else "")
        raise ConfigError(
            f"checkpoint_blocks names {', '.join(missing)}, which the model does not have "
            f"(its blocks: {shown or 'none'})"
        )
    return [b for b in blocks if b in layout.checkpoint_blocks]


def check_layout(model: nn.Module, layout: Layout) -> list[str]:
    """The model's blocks, after checking that ``layout`` can lay this model out: FSDP needs
    parameters to shard, checkpointing blocks the model has. ConfigError names the field."""
    blocks = model_blocks(model)
    if layout.sharded and not any(True for _ in model.parameters()):
        raise ConfigError("sharding='fsdp' needs a model with parameters to shard; it has none")
    if layout.checkpointed and not blocks:
        raise ConfigError(
            f"checkpointing={layout.checkpointing!r} needs blocks to checkpoint; the model has none"
        )
    checkpointed_blocks(blocks, layout)
    return blocks


# -- activation checkpointing ---------------------------------------------------------------

SAVED_OPS = frozenset(
    {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.linear.default,
        torch.ops.aten.convolution.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)
"""Selective checkpointing keeps these ops' outputs (matrix multiplications, convolutions,
fused attention: the costly ones) and recomputes everything else (norms, activations,
softmax, dropout, reshapes: cheap per byte)."""


def _selective_policy(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed_forward(module: nn.Module, selective: bool) -> Callable[..., Any]:
    inner = type(module).forward.__get__(module)
    context_fn = _selective_context if selective else None

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    forward.tunekit_checkpoint = "selective" if selective else "full"  # type: ignore[attr-defined]
    return forward


class BlockCheckpointing:
    """Activation checkpointing installed on some blocks of a model; :meth:`remove` undoes it."""

    def __init__(self, model: nn.Module, blocks: Sequence[str], policy: str):
        self.model, self.blocks, self.policy = model, list(blocks), policy
        for name in self.blocks:
            module = model.get_submodule(name)
            if "forward" in vars(module):
                raise ConfigError(
                    f"block {name} already has a forward of its own on the instance; "
                    "it cannot be checkpointed"
                )
            module.forward = _checkpointed_forward(module, policy == "selective")

    def remove(self) -> None:
        for name in self.blocks:
            module = self.model.get_submodule(name)
            if hasattr(vars(module).get("forward"), "tunekit_checkpoint"):
                del module.forward
        self.blocks = []


# -- FSDP2 ----------------------------------------------------------------------------------

_PARAM_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard_model(
    model: nn.Module,
    blocks: Sequence[str],
    layout: Layout,
    *,
    precision: str,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> None:
    """``fully_shard`` each block, then the root, as ``layout`` says (in place).

    Mixed precision follows the workload's ``precision``: bf16/fp16 gather the parameters
    in that dtype and reduce gradients in fp32; fp32 casts nothing."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not any(True for _ in model.parameters()):
        raise ConfigError("sharding='fsdp' needs a model with parameters to shard; it has none")
    if not dist.is_initialized():
        raise ConfigError(
            "sharding='fsdp' needs a process group: run the job under torchrun or tunekit"
        )
    group = group or dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device.type)
    param_dtype = _PARAM_DTYPE.get(precision)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
        ),
    }
    if layout.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    try:
        for name in blocks:
            fully_shard(
                model.get_submodule(name),
                reshard_after_forward=layout.reshard_after_forward,
                **kwargs,
            )
        fully_shard(model, reshard_after_forward=False, **kwargs)
    except (ValueError, RuntimeError, AssertionError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(f"sharding='fsdp' could not shard this model: {first}") from exc


class FSDPSync(GradSync):
    """FSDP2's own gradient reduction: each block's gradients are reduce-scattered into the
    ranks' shards during backward; the optimizer then updates the shards.

    Under accumulation every micro-batch reduce-scatters (FSDP2's default): the shards
    accumulate the sum, and no rank ever holds a whole unsharded gradient, which is the
    memory FSDP is chosen for. One reduce-scatter per micro-batch instead of one per step is
    its communication cost."""

    name = "fsdp"
    # Not fp16's loss scale: GradScaler would look for overflow in this rank's shards only.
    handles = (ALL_FEATURES - {"grad_scaler"}) | LAYOUT_FEATURES

    def attach(self, session) -> None:
        if not session.layout.sharded:
            raise ConfigError(
                "the fsdp gradient strategy needs a session built with sharding='fsdp'"
            )
        super().attach(session)

    def accumulating(self):
        return contextlib.nullcontext()

    def resident_bytes(self) -> float | None:
        return 0.0  # between steps FSDP holds only the shards (the session counts them)
