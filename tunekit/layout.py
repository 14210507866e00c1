"""How a job's model is laid out over its ranks: replicated or sharded, with or without
activation checkpointing. Plain data, no torch (the workload imports it).

Two kinds of field, because they change at different costs:

* **build** fields (``sharding``, ``reshard_after_forward``, ``cpu_offload``) decide how the
  model is wrapped before its optimizer is built: changing one rebuilds the model, so a
  trial builds its session with them from the start and a live job relaunches from its
  sharded checkpoint;
* **step** fields (``checkpointing``, ``checkpoint_every``, ``checkpoint_blocks``) change
  at a step boundary: a block's forward is wrapped or unwrapped, nothing is rebuilt.

:mod:`tunekit.runtime.sharding` applies a layout to a model; :mod:`tunekit.memory`
predicts what it costs in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

from tunekit.errors import ConfigError

Sharding = Literal["ddp", "fsdp"]
CheckpointPolicy = Literal["none", "full", "selective"]

SHARDINGS: tuple[str, ...] = ("ddp", "fsdp")
CHECKPOINT_POLICIES: tuple[str, ...] = ("none", "full", "selective")
BUILD_FIELDS = ("sharding", "reshard_after_forward", "cpu_offload")
"""Fields that need the model rebuilt (a relaunch in a live job)."""
STEP_FIELDS = ("checkpointing", "checkpoint_every", "checkpoint_blocks")
"""Fields that change at a step boundary."""


@dataclass(frozen=True)
class Layout:
    """Sharding and activation checkpointing of one job (every rank alike)."""

    sharding: Sharding = "ddp"
    """``ddp``: every rank holds the whole model (DistributedDataParallel). ``fsdp``:
    parameters, gradients and optimizer state are sharded over the ranks
    (``torch.distributed.fsdp.fully_shard`` on each block, then on the root)."""
    reshard_after_forward: bool = True
    """FSDP only. True: a block's parameters are freed after its forward and gathered
    again for its backward (ZeRO-3-like, least memory). False: they stay gathered from
    forward to backward (ZeRO-2-like, one all-gather fewer per block)."""
    cpu_offload: bool = False
    """FSDP only: keep the sharded parameters, gradients and optimizer state in host memory
    (``CPUOffloadPolicy``); the optimizer steps on the CPU."""
    checkpointing: CheckpointPolicy = "none"
    """Activation checkpointing of blocks: ``none``; ``full`` (a checkpointed block keeps
    only its input and recomputes the rest in backward); ``selective`` (it keeps the
    outputs of its matrix multiplications and recomputes the cheap operations around them)."""
    checkpoint_every: int = 1
    """Checkpoint every k-th block (blocks 0, k, 2k ...); 1: every block."""
    checkpoint_blocks: tuple[str, ...] | None = None
    """The blocks to checkpoint by name (``("blocks.0", "blocks.3")``), instead of every
    k-th; None: chosen by ``checkpoint_every``."""

    def __post_init__(self) -> None:
        found = layout_problem(asdict(self))
        if found:
            name, problem = found
            raise ConfigError(f"layout {name} {problem}")

    # -- parts ---------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return self.sharding == "fsdp"

    @property
    def checkpointed(self) -> bool:
        return self.checkpointing != "none"

    def build_part(self) -> dict[str, Any]:
        """The fields that need the model rebuilt."""
        return {name: getattr(self, name) for name in BUILD_FIELDS}

    def step_part(self) -> dict[str, Any]:
        """The fields that change at a step boundary."""
        return {name: getattr(self, name) for name in STEP_FIELDS}

    def with_changes(self, changes: Mapping[str, Any]) -> Layout:
        """This layout with ``changes`` (field -> value), checked; unknown fields refused."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"layout has no field {unknown[0]!r}; fields: {', '.join(known)}")
        values = dict(changes)
        if isinstance(values.get("checkpoint_blocks"), list):
            values["checkpoint_blocks"] = tuple(values["checkpoint_blocks"])
        return replace(self, **values)

    def needs_rebuild(self, other: Layout) -> bool:
        """Whether going from this layout to ``other`` rebuilds the model."""
        return self.build_part() != other.build_part()

    # -- words and JSON ------------------------------------------------------------------

    def describe(self) -> str:
        """``fsdp (reshard after forward, offload) + full checkpointing of every 2nd block``."""
        if self.sharded:
            opts = ["reshard after forward" if self.reshard_after_forward else "no reshard"]
            if self.cpu_offload:
                opts.append("CPU offload")
            text = f"fsdp ({', '.join(opts)})"
        else:
            text = "ddp"
        if self.checkpointed:
            if self.checkpoint_blocks is not None:
                which = f"of {', '.join(self.checkpoint_blocks)}"
            elif self.checkpoint_every == 1:
                which = "of every block"
            else:
                which = f"of every {_ordinal(self.checkpoint_every)} block"
            text += f" + {self.checkpointing} checkpointing {which}"
        return text

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.checkpoint_blocks is not None:
            out["checkpoint_blocks"] = list(self.checkpoint_blocks)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        return cls().with_changes(data)


def layout_problem(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of a layout (given as field -> value) that is not acceptable, and why;
    None when all are. Shared by :class:`Layout` and the workload's own fields."""
    sharding = values.get("sharding", "ddp")
    if sharding not in SHARDINGS:
        return "sharding", f"must be 'ddp' or 'fsdp', not {sharding!r}"
    for name in ("reshard_after_forward", "cpu_offload"):
        if not isinstance(values.get(name, False), bool):
            return name, f"must be True or False, not {values[name]!r}"
    if values.get("cpu_offload") and sharding != "fsdp":
        return "cpu_offload", "needs sharding='fsdp' (it offloads FSDP's shards to the host)"
    policy = values.get("checkpointing", "none")
    if policy not in CHECKPOINT_POLICIES:
        return "checkpointing", f"must be 'none', 'full' or 'selective', not {policy!r}"
    every = values.get("checkpoint_every", 1)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        return "checkpoint_every", f"must be an int of 1 or more, not {every!r}"
    blocks = values.get("checkpoint_blocks")
    if blocks is not None:
        if isinstance(blocks, str) or not all(isinstance(b, str) and b for b in blocks):
            return "checkpoint_blocks", f"must be a list of block names, not {blocks!r}"
        if not blocks:
            return "checkpoint_blocks", "names no block (leave it None to use checkpoint_every)"
        if policy == "none":
            return "checkpoint_blocks", "names blocks but checkpointing is 'none'"
    return None


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
