"""The step-time model: a training step under a layout and a split of its samples into
micro-batches, in parts, from per-sample block times, parameter bytes and collective fits.

Pure arithmetic (no torch, no processes). :mod:`.calibrated` fills it from what was
measured and makes it reproduce the measured baseline; candidates are predicted as changes
to that baseline, part by part.

Parts of a step on one rank (seconds):

* ``compute`` — one pass per micro-batch: as timed at that micro-batch where it was
  (``pass_times``), else forward and backward of every sample (per-sample times from the
  layer profile, scaled to the measured step line) and a fixed cost per pass
  (``per_pass_s``: launches, Python, the loss; under FSDP also its copies into and out of
  the collectives' buffers and its hooks, ``fsdp_pass_s``), and the recomputation of checkpointed
  blocks in backward: a fully checkpointed block runs its forward again, a selectively
  checkpointed one only its cheap operations (everything but matrix multiplications).
* ``comm_total`` / ``comm_exposed`` — DDP: one all-reduce of every gradient per step,
  in buckets that overlap backward, so what is exposed is the last bucket or what backward
  cannot cover. FSDP, per micro-batch: an all-gather of each unit's parameters in forward
  (in the compute dtype), again for each block in backward when it was resharded after
  forward, and a reduce-scatter of each unit's gradients in backward. Backward prefetches
  the next unit's all-gather and overlaps a unit's reduce-scatter with the next unit's
  compute (a pipeline: at each boundary what the compute before it cannot cover is
  exposed). Forward prefetching runs ahead only on an accelerator, where the host queues
  work ahead of the device; on a CPU the host computes, so every forward all-gather waits.
  CPU offload (accelerator only) adds the shards' host-to-device copies before each
  all-gather and the gradients' copy back, exposed.
* ``optimizer`` — the step over the parameters a rank holds (a shard under FSDP), on the
  host under offload (``host_optimizer_slowdown`` times slower: an assumption, said so).

All-gather and reduce-scatter move half of what an all-reduce of the same bytes moves (a
ring all-reduce is a reduce-scatter then an all-gather); without a fit of their own they
are derived from the probed all-reduce fit that way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tunekit.api import Layout

PARTS = ("compute", "comm_exposed", "optimizer")
"""The step parts a candidate changes (data loading and idle time carry over as measured)."""


@dataclass(frozen=True)
class Wire:
    """``latency + bytes / bandwidth`` of one collective (or copy)."""

    latency_s: float
    bytes_per_s: float

    def time(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_s + nbytes / self.bytes_per_s

    def slower(self, factor: float) -> Wire:
        """This wire ``factor`` times slower (a collective beside the job's compute)."""
        return Wire(self.latency_s * factor, self.bytes_per_s / factor)


@dataclass(frozen=True)
class Collectives:
    all_reduce: Wire
    all_gather: Wire
    """By the gathered (output) bytes."""
    reduce_scatter: Wire
    """By the reduced (input) bytes."""
    h2d: Wire | None = None
    d2h: Wire | None = None

    @classmethod
    def from_all_reduce(cls, all_reduce: Wire, **copies: Wire | None) -> Collectives:
        """All-gather and reduce-scatter as halves of a ring all-reduce (module docstring)."""
        half = Wire(all_reduce.latency_s / 2, all_reduce.bytes_per_s * 2)
        return cls(all_reduce, half, half, **copies)

    def slower(self, factor: float) -> Collectives:
        return Collectives(
            self.all_reduce.slower(factor),
            self.all_gather.slower(factor),
            self.reduce_scatter.slower(factor),
            self.h2d,
            self.d2h,
        )


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: a block, or the root (every parameter outside the blocks)."""

    name: str
    forward_s: float
    """Forward seconds per sample."""
    backward_s: float
    """Backward seconds per sample."""
    selective_s: float
    """Forward seconds per sample of what selective checkpointing recomputes."""
    param_bytes: float


@dataclass(frozen=True)
class Setting:
    """What a candidate changes: the layout and the micro-batches of a step."""

    layout: Layout
    micro_batches: int
    """Forward/backward passes per step; each takes ``samples / micro_batches`` samples."""
    samples: int
    """Samples one rank takes per step."""

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.samples % self.micro_batches:
            raise ValueError(
                f"{self.micro_batches} micro-batches do not divide {self.samples} samples"
            )

    @property
    def micro_batch(self) -> int:
        return self.samples // self.micro_batches

    def describe(self) -> str:
        split = (
            f"{self.micro_batches} micro-batches of {self.micro_batch}"
            if self.micro_batches > 1
            else f"one pass of {self.samples}"
        )
        return f"{self.layout.describe()}, {split}"


@dataclass(frozen=True)
class StepModel:
    root: Unit
    blocks: tuple[Unit, ...]
    per_pass_s: float
    """Fixed seconds of one forward/backward pass, whatever its size."""
    optimizer_s: float
    """The optimizer step over every parameter (unsharded, on the device)."""
    world_size: int
    gather_ratio: float
    """Bytes gathered per parameter byte (the compute dtype's size over the parameters')."""
    collectives: Collectives
    device_type: str
    bucket_bytes: float = 25 * 2**20
    """DDP's gradient bucket (its default, 25 MiB): the last one cannot overlap backward."""
    host_optimizer_slowdown: float = 8.0
    """How much slower the optimizer runs on the host under CPU offload (assumed)."""
    pass_times: tuple[tuple[int, float], ...] = ()
    """``(micro_batch, seconds)``: forward and backward of one pass of that many samples, as
    timed (a split into one of these uses it instead of the per-sample sum)."""
    fsdp_pass_s: tuple[float, float] = (0.0, 0.0)
    """What FSDP adds to a pass's compute (copies into and out of the collectives' buffers,
    hooks), resharded after forward and not (timed on one rank)."""
    recompute_factor: float = 1.0
    """A recomputed forward's cost over the block's profiled forward (1 until a checkpointed
    baseline's measured compute says otherwise: checkpoint's own work comes on top)."""

    # -- pieces ------------------------------------------------------------------------

    def checkpointed(self, layout: Layout) -> list[str]:
        names = [b.name for b in self.blocks]
        if not layout.checkpointed:
            return []
        if layout.checkpoint_blocks is not None:
            return [n for n in names if n in layout.checkpoint_blocks]
        return names[:: layout.checkpoint_every]

    def recompute_per_sample(self, layout: Layout) -> dict[str, float]:
        """Per block checkpointed: the seconds per sample its recomputation costs."""
        chosen = set(self.checkpointed(layout))
        full = layout.checkpointing == "full"
        return {
            b.name: (b.forward_s if full else b.selective_s) * self.recompute_factor
            for b in self.blocks
            if b.name in chosen
        }

    def compute_s(self, s: Setting) -> float:
        per_sample = sum(u.forward_s + u.backward_s for u in (self.root, *self.blocks))
        recompute = sum(self.recompute_per_sample(s.layout).values())
        fsdp = 0.0
        if s.layout.sharded:
            fsdp = self.fsdp_pass_s[0 if s.layout.reshard_after_forward else 1]
        timed = dict(self.pass_times)
        if s.micro_batch in timed:
            one_pass = timed[s.micro_batch]
        else:
            one_pass = self.per_pass_s + s.micro_batch * per_sample
        return s.micro_batches * (one_pass + fsdp) + s.samples * recompute

    def _sharded(self, layout: Layout) -> bool:
        return layout.sharded and self.world_size > 1

    def _offloaded(self, layout: Layout) -> bool:
        return layout.sharded and layout.cpu_offload and self.device_type != "cpu"

    def comm_s(self, s: Setting) -> tuple[float, float]:
        """(all communication, the part compute does not hide) per step."""
        if self.world_size <= 1:
            return 0.0, 0.0
        if not self._sharded(s.layout):
            return self._ddp_comm(s)
        total, exposed = self._fsdp_micro_batch(s)
        copies = self._offload_copies(s)
        return s.micro_batches * (total + copies), s.micro_batches * (exposed + copies)

    def _ddp_comm(self, s: Setting) -> tuple[float, float]:
        c = self.collectives
        grads = self.root.param_bytes + sum(b.param_bytes for b in self.blocks)
        total = c.all_reduce.time(grads)
        backward = s.micro_batch * sum(u.backward_s for u in (self.root, *self.blocks))
        last_bucket = c.all_reduce.time(min(grads, self.bucket_bytes))
        return total, max(last_bucket, total - backward)

    def _fsdp_micro_batch(self, s: Setting) -> tuple[float, float]:
        """(all, exposed) communication of one micro-batch's forward and backward."""
        c, n = self.collectives, s.micro_batch
        layout = s.layout
        recompute = self.recompute_per_sample(layout)

        def gather(u: Unit) -> float:
            return c.all_gather.time(u.param_bytes * self.gather_ratio)

        def scatter(u: Unit) -> float:
            return c.reduce_scatter.time(u.param_bytes)

        forward = [self.root, *self.blocks]
        fwd_comm = [gather(u) for u in forward]
        if self.device_type == "cpu":
            fwd_exposed = sum(fwd_comm)
        else:
            fwd_exposed = pipeline_exposed(fwd_comm, [u.forward_s * n for u in forward])
        # Backward: blocks last to first, then the root (still gathered from forward).
        order = [*reversed(self.blocks), self.root]
        before = [
            gather(u) if (u is not self.root and layout.reshard_after_forward) else 0.0
            for u in order
        ]
        after = [scatter(u) for u in order]
        work = [(u.backward_s + recompute.get(u.name, 0.0)) * n for u in order]
        bwd_exposed = backward_exposed(before, after, work)
        total = sum(fwd_comm) + sum(before) + sum(after)
        return total, fwd_exposed + bwd_exposed

    def _offload_copies(self, s: Setting) -> float:
        if not self._offloaded(s.layout):
            return 0.0
        c = self.collectives
        units = [self.root, *self.blocks]
        shard = [u.param_bytes / self.world_size for u in units]
        gathers = 2 if s.layout.reshard_after_forward else 1
        h2d = c.h2d or Wire(1e-5, 10e9)
        d2h = c.d2h or Wire(1e-5, 10e9)
        return sum(gathers * h2d.time(b) + d2h.time(b) for b in shard)

    def optimizer_part_s(self, layout: Layout) -> float:
        shards = self.world_size if self._sharded(layout) else 1
        slow = self.host_optimizer_slowdown if self._offloaded(layout) else 1.0
        return self.optimizer_s / shards * slow

    # -- the step ----------------------------------------------------------------------

    def parts(self, s: Setting) -> dict[str, float]:
        """The model's figures for ``s``, by part (:data:`PARTS`, and ``comm_total``)."""
        total, exposed = self.comm_s(s)
        return {
            "compute": self.compute_s(s),
            "comm_exposed": exposed,
            "optimizer": self.optimizer_part_s(s.layout),
            "comm_total": total,
        }

    def with_collectives(self, collectives: Collectives) -> StepModel:
        return replace(self, collectives=collectives)


def pipeline_exposed(comm: Sequence[float], work: Sequence[float]) -> float:
    """Communication before each stage, prefetched during the stage before it: the first
    waits whole, each later one for what the previous stage's work does not cover."""
    exposed = comm[0] if comm else 0.0
    for i in range(1, len(comm)):
        exposed += max(0.0, comm[i] - work[i - 1])
    return exposed


def backward_exposed(
    before: Sequence[float], after: Sequence[float], work: Sequence[float]
) -> float:
    """Backward's stages in order: ``before[k]`` (an all-gather) must arrive before stage k
    computes, ``after[k]`` (a reduce-scatter) leaves once it has. While stage k computes,
    the link carries the reduce-scatter of stage k-1 and the prefetched all-gather of stage
    k+1; what stage k's work cannot cover is exposed. The first all-gather and the last
    reduce-scatter wait whole."""
    n = len(work)
    if not n:
        return 0.0
    exposed = before[0] + after[-1]
    for k in range(n):
        link = (after[k - 1] if k >= 1 else 0.0) + (before[k + 1] if k + 1 < n else 0.0)
        exposed += max(0.0, link - work[k])
    return exposed
