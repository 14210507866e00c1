"""The per-rank memory model: what fills a rank's memory under a layout, a batch and an
accumulation, predicted from facts measured on one process and calibrated on a measured peak.

Pure arithmetic on :class:`MemoryFacts` (measured by :mod:`tunekit.observe.memory_facts`
in the workload's process: one rank, no collectives). A prediction is the larger of two
moments of a step, each a sum of named parts, so a report can say what fills memory:

* **backward peak** — the step's activations are all alive and backward starts to free
  them while gradients appear: parameters + optimizer state (held between steps) +
  collective buffers + the activations and backward temporaries at that moment + the
  gradients that exist by then + a recomputed block (checkpointing) + gathered parameters
  (FSDP);
* **optimizer peak** — parameters + optimizer state + every gradient + the optimizer's
  temporaries.

The layout changes the parts, not the facts:

* ``ddp``: every rank holds the whole model and optimizer; DDP's gradient buckets hold a
  second copy of the gradients for the whole job (collective buffers).
* ``fsdp``: parameters, gradients, optimizer state and the optimizer's temporaries are
  divided by the shard count; at backward's start the root's parameters are gathered
  (unsharded), and every block's too without ``reshard_after_forward`` (they stay gathered
  from forward to backward). Under mixed precision the gathered copies are in the
  compute dtype. (Measured on 2 gloo ranks: blocks gathered later in backward, and their
  unsharded gradients waiting for the reduce-scatter, meet fewer live activations and do
  not make the peak.)
* CPU offload moves the sharded parameters, gradients and optimizer state (and its
  temporaries) to the host: on a GPU they leave the device's peak for ``host_bytes``; on
  a CPU the host is the device and they stay.
* checkpointing: a checkpointed block keeps what it keeps under its policy (measured per
  block and policy) instead of all its activations, and backward holds one block's
  recomputation at a time.
* accumulation: from the second micro-batch on, every gradient exists while activations
  are alive.

Calibration (:func:`calibrate`): the model of the configuration that was measured (the
baseline) is compared with its measured peak; the difference is carried into every
prediction as the part ``calibration`` -- added as it is where the model missed something
(allocator slack, a workspace, buffers it does not name), in proportion where it counted
too much -- so the baseline is reproduced and a candidate differs from it only by what
the model says changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tunekit.layout import Layout

POLICIES = ("none", "full", "selective")


@dataclass(frozen=True)
class Line:
    """``intercept + per_sample * batch`` bytes (a fit over measured batches)."""

    intercept: float
    per_sample: float

    def at(self, batch: float) -> float:
        return max(0.0, self.intercept + self.per_sample * batch)

    @classmethod
    def through(cls, points: Mapping[int, float]) -> Line:
        """Least squares through ``{batch: bytes}`` (one point: a line through the origin)."""
        xs = sorted(points)
        if len(xs) == 1:
            return cls(0.0, points[xs[0]] / xs[0] if xs[0] else 0.0)
        n = len(xs)
        mx = sum(xs) / n
        my = sum(points[x] for x in xs) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (points[x] - my) for x in xs) / sxx
        return cls(my - slope * mx, slope)


@dataclass(frozen=True)
class BlockFacts:
    name: str
    param_bytes: float
    """Bytes of the block's own parameters (one FSDP unit)."""
    kept: Mapping[str, Line]
    """Per checkpoint policy: bytes the block's forward leaves allocated (its activations
    and output), by batch."""
    backward: Mapping[str, Line] = field(default_factory=dict)
    """Per checkpoint policy (applied to every block): the peak of this block's backward
    segment above the steady state, gradients excluded (the activations still alive, the
    block's gradient temporaries, its recomputation)."""


@dataclass(frozen=True)
class PolicyFacts:
    """One checkpoint policy applied to every block, measured."""

    forward_end: Line
    """Bytes allocated at the end of forward above the steady state (activations)."""
    backward: Line
    """Backward's peak above the steady state, gradients excluded (activations left,
    gradient temporaries, a recomputed block)."""
    grads_at_peak: float
    """Bytes of gradients that existed at the peak of backward's first segment (the loss's
    and the head's, before any block's): 0 .. all of them."""
    head: Line | None = None
    """The peak of backward's first segment, before any block's, gradients excluded."""


@dataclass(frozen=True)
class MemoryFacts:
    """What one rank of this workload allocates, measured on one process (no collectives)."""

    param_bytes: float
    """All parameters, in their own dtype."""
    grad_bytes: float
    """Gradients of the trainable parameters."""
    buffer_bytes: float
    optimizer_bytes: float
    """Optimizer state once it exists (Adam's two moments ...)."""
    optimizer_temp_bytes: float
    """The optimizer step's peak above parameters, gradients and state (foreach temporaries)."""
    blocks: tuple[BlockFacts, ...]
    """The model's blocks (FSDP units, checkpointing units), in order."""
    policies: Mapping[str, PolicyFacts]
    batches: tuple[int, ...]
    """Per-rank batches the lines were measured at."""
    compute_bytes_per_param: float = 4.0
    """Bytes per parameter element of the compute dtype (2 under bf16/fp16 autocast)."""
    param_elem_bytes: float = 4.0
    method: str = ""
    """How the peaks were measured (``cpu-profiler``, ``cuda-allocator``)."""

    @property
    def block_param_bytes(self) -> float:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def root_param_bytes(self) -> float:
        """Parameters outside every block (embeddings, head, final norm): the root FSDP unit."""
        return max(0.0, self.param_bytes - self.block_param_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryFacts:
        def line(x: Mapping[str, float]) -> Line:
            return Line(float(x["intercept"]), float(x["per_sample"]))

        return cls(
            param_bytes=d["param_bytes"],
            grad_bytes=d["grad_bytes"],
            buffer_bytes=d["buffer_bytes"],
            optimizer_bytes=d["optimizer_bytes"],
            optimizer_temp_bytes=d["optimizer_temp_bytes"],
            blocks=tuple(
                BlockFacts(
                    b["name"],
                    b["param_bytes"],
                    {k: line(v) for k, v in b["kept"].items()},
                    {k: line(v) for k, v in (b.get("backward") or {}).items()},
                )
                for b in d["blocks"]
            ),
            policies={
                k: PolicyFacts(
                    line(v["forward_end"]),
                    line(v["backward"]),
                    v["grads_at_peak"],
                    line(v["head"]) if v.get("head") else None,
                )
                for k, v in d["policies"].items()
            },
            batches=tuple(d["batches"]),
            compute_bytes_per_param=d.get("compute_bytes_per_param", 4.0),
            param_elem_bytes=d.get("param_elem_bytes", 4.0),
            method=d.get("method", ""),
        )


PART_ORDER = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "recompute",
    "gathered_parameters",
    "collective_buffers",
    "optimizer_temporaries",
    "calibration",
)
PART_WORDS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations and backward temporaries",
    "recompute": "a recomputed block",
    "gathered_parameters": "gathered parameters",
    "collective_buffers": "collective buffers",
    "optimizer_temporaries": "optimizer temporaries",
    "calibration": "unexplained (calibration)",
}


@dataclass(frozen=True)
class MemoryPrediction:
    """A rank's predicted peak, with what fills it at that moment."""

    peak_bytes: float
    parts: Mapping[str, float]
    """Bytes per part at the peak (they sum to ``peak_bytes``); see :data:`PART_WORDS`."""
    moment: str
    """``backward`` or ``optimizer``: when in the step the peak falls."""
    host_bytes: float = 0.0
    """Bytes kept in host memory by CPU offload (not in ``peak_bytes`` on a GPU)."""
    layout: Layout = field(default_factory=Layout)
    batch: int = 0
    accumulation: int = 1
    world_size: int = 1

    def describe(self, limit: int = 4) -> str:
        """``1.2 GiB at backward: activations 0.7 GiB, optimizer state 0.3 GiB, ...``."""
        top = sorted(
            ((k, v) for k, v in self.parts.items() if abs(v) >= 0.01 * self.peak_bytes),
            key=lambda kv: -abs(kv[1]),
        )[:limit]
        listed = ", ".join(f"{PART_WORDS.get(k, k)} {format_bytes(v)}" for k, v in top)
        return f"{format_bytes(self.peak_bytes)} at the {self.moment} peak: {listed}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "parts": {k: self.parts[k] for k in PART_ORDER if k in self.parts},
            "moment": self.moment,
            "host_bytes": self.host_bytes,
            "layout": self.layout.to_dict(),
            "batch": self.batch,
            "accumulation": self.accumulation,
            "world_size": self.world_size,
        }


@dataclass(frozen=True)
class MemoryCalibration:
    """The model against a measured configuration, and how every prediction follows it.

    What the model misses (a workspace, a buffer it does not name) is added to every
    prediction as it is; where the model counts more than was measured, every prediction
    is scaled down in proportion instead, so that a small configuration is not cut by a
    large one's excess. Either way the measured configuration is reproduced exactly."""

    residual_bytes: float
    measured_bytes: float
    modelled_bytes: float

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.modelled_bytes if self.modelled_bytes else 1.0

    def adjustment(self, modelled_bytes: float) -> float:
        """The part ``calibration`` of a prediction the model puts at ``modelled_bytes``."""
        if self.residual_bytes >= 0:
            return self.residual_bytes
        return (self.ratio - 1.0) * modelled_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(
    facts: MemoryFacts,
    layout: Layout,
    *,
    batch: int,
    accumulation: int = 1,
    world_size: int = 1,
    device_type: str = "cpu",
    calibration: MemoryCalibration | None = None,
) -> MemoryPrediction:
    """One rank's peak under ``layout`` at per-rank micro-batch ``batch`` (samples per
    forward) and ``accumulation`` micro-batches per step, on ``world_size`` ranks."""
    shards = world_size if layout.sharded else 1
    on_host = layout.sharded and layout.cpu_offload and device_type != "cpu"
    compute = facts.compute_bytes_per_param / facts.param_elem_bytes
    grad_ratio = facts.grad_bytes / facts.param_bytes if facts.param_bytes else 1.0

    # Held between steps (on the host under offload, on a GPU).
    params = facts.param_bytes / shards + facts.buffer_bytes
    optimizer = facts.optimizer_bytes / shards
    grads_all = facts.grad_bytes / shards
    opt_temps = facts.optimizer_temp_bytes / shards
    host = 0.0
    if on_host:
        host = facts.param_bytes / shards + optimizer + grads_all + opt_temps
        params, optimizer, opt_temps = facts.buffer_bytes, 0.0, 0.0
    held_grads = 0.0 if on_host else grads_all
    buckets = facts.grad_bytes if (not layout.sharded and world_size > 1) else 0.0

    # Activations under the layout's checkpointing, block by block.
    ckpt = _checkpointed(facts.blocks, layout)
    policy = layout.checkpointing if ckpt else "none"

    def saved(b: BlockFacts) -> float:
        return b.kept["none"].at(batch) - b.kept[policy].at(batch)

    none = facts.policies["none"]
    # Gradients of the root's parameters (the head's, a tied embedding's) appear at
    # backward's start; FSDP reduce-scatters them only when backward ends.
    root_grads = none.grads_at_peak
    moments: list[tuple[str, dict[str, float]]] = []

    # Backward's first segment: the loss's and the head's gradients, every activation alive.
    head = (none.head or none.backward).at(batch) - sum(
        saved(b) for b in facts.blocks if b.name in ckpt
    )
    gathered = 0.0
    if layout.sharded:
        gathered = facts.root_param_bytes * compute
        if not layout.reshard_after_forward:
            gathered += facts.block_param_bytes * compute
    moments.append(
        (
            "backward",
            {
                "parameters": params,
                "optimizer": optimizer,
                "gradients": (held_grads if accumulation > 1 else 0.0) + root_grads,
                "activations": head,
                "gathered_parameters": gathered,
                "collective_buffers": buckets,
            },
        )
    )

    # Each block's backward segment, last block first.
    blocks = list(facts.blocks)
    saved_before = 0.0  # by checkpointed blocks before this one (still holding less)
    saved_all_before = 0.0  # as if every block were checkpointed (the measured policy)
    segments = []
    for i, b in enumerate(blocks):
        segments.append((i, b, saved_before, saved_all_before))
        if b.name in ckpt:
            saved_before += saved(b)
        if policy != "none":
            saved_all_before += saved(b)
    for i, b, before, all_before in reversed(segments):
        if not b.backward:
            continue
        activations = b.backward["none"].at(batch) - before
        recompute = 0.0
        if b.name in ckpt and policy in b.backward:
            measured = b.backward[policy].at(batch)
            recompute = max(0.0, measured - (b.backward["none"].at(batch) - all_before))
        # The segment's measured peak holds this block's new gradients as they are computed
        # (accumulated into gradients allocated beforehand), so only the others' are added:
        # those of the blocks after it (whole under DDP, shards under FSDP; from the second
        # micro-batch on, every block's) and the root's (its head's, computed first).
        unit = b.param_bytes
        later = sum(x.param_bytes for x in blocks[i + 1 :]) * grad_ratio
        if layout.sharded:
            done = held_grads if accumulation > 1 else later / shards
            grads = root_grads + done
            if layout.reshard_after_forward:
                prev = blocks[i - 1].param_bytes if i > 0 else 0.0
                gathered = (facts.root_param_bytes + unit + prev) * compute
            else:
                gathered = (
                    facts.root_param_bytes + sum(x.param_bytes for x in blocks[: i + 1])
                ) * compute
            collective = unit * grad_ratio  # the reduce-scatter's input, a copy of the gradient
        else:
            grads = held_grads if accumulation > 1 else root_grads + later
            gathered, collective = 0.0, buckets
        moments.append(
            (
                "backward",
                {
                    "parameters": params,
                    "optimizer": optimizer,
                    "gradients": 0.0 if on_host else grads,
                    "activations": activations,
                    "recompute": recompute,
                    "gathered_parameters": gathered,
                    "collective_buffers": collective,
                },
            )
        )

    moments.append(
        (
            "optimizer",
            {
                "parameters": params,
                "optimizer": optimizer,
                "gradients": held_grads,
                "optimizer_temporaries": opt_temps,
                "collective_buffers": buckets,
            },
        )
    )
    moment, parts = max(moments, key=lambda mp: sum(mp[1].values()))
    parts = {k: v for k, v in parts.items() if v}
    if calibration is not None:
        parts["calibration"] = calibration.adjustment(sum(parts.values()))
    return MemoryPrediction(
        peak_bytes=sum(parts.values()),
        parts=parts,
        moment=moment,
        host_bytes=host,
        layout=layout,
        batch=batch,
        accumulation=accumulation,
        world_size=world_size,
    )


def calibrate(
    facts: MemoryFacts,
    layout: Layout,
    measured_peak_bytes: float,
    *,
    batch: int,
    accumulation: int = 1,
    world_size: int = 1,
    device_type: str = "cpu",
) -> MemoryCalibration:
    """The model against a measured peak (the baseline trial's, max over ranks)."""
    modelled = predict(
        facts,
        layout,
        batch=batch,
        accumulation=accumulation,
        world_size=world_size,
        device_type=device_type,
    ).peak_bytes
    return MemoryCalibration(measured_peak_bytes - modelled, measured_peak_bytes, modelled)


def _checkpointed(blocks: Sequence[BlockFacts], layout: Layout) -> set[str]:
    names = [b.name for b in blocks]
    if not layout.checkpointed:
        return set()
    if layout.checkpoint_blocks is not None:
        return {b for b in layout.checkpoint_blocks if b in names}
    return set(names[:: layout.checkpoint_every])


def parse_size(text: str | int | float) -> int:
    """``2GiB``, ``512MiB``, ``1.5GB``, ``300M``, ``1024`` (bytes) -> bytes. ValueError otherwise."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"a size must be positive, not {text}")
        return int(text)
    units = {
        "": 1,
        "b": 1,
        "k": 1000,
        "kb": 1000,
        "kib": 1024,
        "m": 1000**2,
        "mb": 1000**2,
        "mib": 1024**2,
        "g": 1000**3,
        "gb": 1000**3,
        "gib": 1024**3,
        "t": 1000**4,
        "tb": 1000**4,
        "tib": 1024**4,
    }
    raw = str(text).strip()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ").strip()
    unit = raw[len(number) :].strip().lower()
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{raw!r} is not a size like 2GiB, 512MiB or 1.5GB") from None
    if unit not in units:
        raise ValueError(f"{raw!r}: unknown unit {unit!r} (use B, KiB, MiB, GiB, KB, MB, GB)")
    if not value > 0:
        raise ValueError(f"{raw!r} is no memory at all: give more than 0, like 2GiB")
    return int(value * units[unit])


def format_bytes(n: float | None) -> str:
    """``1.4 GiB``, ``312 MiB``, ``96 KiB``: binary units, as memory tools quote them."""
    if n is None:
        return "—"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}" if abs(n) < 10 * size else f"{n / size:,.0f} {unit}"
    return f"{n:,.0f} B"
