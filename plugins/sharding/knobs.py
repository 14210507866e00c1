"""The tuner's knobs, and what a set of them asks of the layout and the step.

Every knob's default keeps what the workload does (``workload``, or 0 for the numbers),
so the defaults reproduce the untuned job whether it was written replicated or sharded.
The build knobs (sharding, resharding, offload) rebuild the model: a live job takes them by
relaunching from its checkpoint. Checkpointing and micro-batches switch at a step boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.contract import Knob
from tunekit.errors import ConfigError
from tunekit.plugins.sharding.model import Setting
from tunekit.plugins.sharding.search import parse_variants

KEEP = "workload"
MAX_MICRO_BATCHES = 1024


def _block_names(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if text.strip() and not names:
        raise ConfigError(f"{text!r} names no block (blocks.0,blocks.2 ...)")
    return names


def declare() -> list[Knob]:
    return [
        Knob(
            "sharding",
            "choice",
            KEEP,
            "ddp: every rank holds the whole model; fsdp: parameters, gradients and "
            "optimizer state sharded over the ranks (FSDP2)",
            choices=(KEEP, "ddp", "fsdp"),
            live="relaunch",
        ),
        Knob(
            "reshard_after_forward",
            "choice",
            KEEP,
            "FSDP: free a block's gathered parameters after its forward (true: least "
            "memory) or keep them for its backward (false: one all-gather fewer)",
            choices=(KEEP, True, False),
            live="relaunch",
        ),
        Knob(
            "cpu_offload",
            "choice",
            KEEP,
            "FSDP: keep parameter, gradient and optimizer shards in host memory "
            "(an accelerator's memory freed for host copies and a host optimizer)",
            choices=(KEEP, True, False),
            live="relaunch",
        ),
        Knob(
            "checkpointing",
            "choice",
            KEEP,
            "activation checkpointing of blocks: none, full (recompute a block's forward "
            "in backward) or selective (keep its matmul outputs, recompute the rest)",
            choices=(KEEP, "none", "full", "selective"),
        ),
        Knob(
            "checkpoint_every",
            "int",
            0,
            "checkpoint every k-th block (1: all); 0 keeps the workload's",
            low=0,
            high=1024,
        ),
        Knob(
            "checkpoint_blocks",
            "str",
            "",
            "checkpoint these blocks by name (blocks.0,blocks.3) instead of every k-th; "
            "empty: by checkpoint_every",
            parse=_block_names,
        ),
        Knob(
            "micro_batches",
            "int",
            0,
            "split each rank's samples per step into this many micro-batches (the same "
            "samples per step, less activation memory, more passes); 0 keeps the workload's",
            low=0,
            high=MAX_MICRO_BATCHES,
        ),
        Knob(
            "search",
            "str",
            "",
            "in-job search: step-level variants POLICY[/EVERY]:MICRO_BATCHES to time in "
            "turn (full/2:4,none:2), each predicted by the plan to fit; empty: none",
            parse=parse_variants,
        ),
    ]


def layout_changes(knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The layout fields ``knobs`` ask for (the rest stay the workload's)."""
    out: dict[str, Any] = {}
    for name in ("sharding", "reshard_after_forward", "cpu_offload"):
        value = knobs.get(name, KEEP)
        if value != KEEP:
            out[name] = value
    policy = knobs.get("checkpointing", KEEP)
    if policy != KEEP:
        out["checkpointing"] = policy
    blocks = _block_names(str(knobs.get("checkpoint_blocks", "") or ""))
    every = int(knobs.get("checkpoint_every", 0) or 0)
    if blocks:
        out["checkpoint_blocks"] = blocks
    elif every or policy == "none":
        out["checkpoint_blocks"] = None
        if every:
            out["checkpoint_every"] = every
    return out


def knobs_of(s: Setting, base: Setting) -> dict[str, Any]:
    """The knobs that turn the workload's setting ``base`` into ``s`` (only what differs)."""
    out: dict[str, Any] = {}
    a, b = s.layout, base.layout
    for name in ("sharding", "reshard_after_forward", "cpu_offload"):
        if getattr(a, name) != getattr(b, name):
            out[name] = getattr(a, name)
    if (a.checkpointing, a.checkpoint_every, a.checkpoint_blocks) != (
        b.checkpointing,
        b.checkpoint_every,
        b.checkpoint_blocks,
    ):
        out["checkpointing"] = a.checkpointing
        if a.checkpoint_blocks is not None:
            out["checkpoint_blocks"] = ",".join(a.checkpoint_blocks)
        elif a.checkpointing != "none":
            out["checkpoint_every"] = a.checkpoint_every
    if s.micro_batches != base.micro_batches:
        out["micro_batches"] = s.micro_batches
    return out
