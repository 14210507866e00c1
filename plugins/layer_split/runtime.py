"""The executor: one training step of a layer_split plan on real ranks.

Every rank runs the same layer sequence (SPMD). For a layer whose config has
``P`` workers, ranks ``0 .. P-1`` each compute their disjoint slice of its
output (:func:`~tunekit.plugins.layer_split.model.owned_boxes`); the other
ranks sit that layer out (a sub-group). Between layers the producer's slices
are redistributed to the regions each consumer worker needs with
point-to-point messages -- exactly the intersecting boxes, nothing else --
which covers sample/channel re-splits, all-gathers before FC layers, halo
rows and columns for spatially split convolutions and pools, and moving
work onto fewer workers. The backward pass runs layer by layer in reverse:
each worker back-propagates its slice, and the gradients of the input regions
it received travel back to their owners, who add them up.

How each op runs on its slice is :mod:`~tunekit.plugins.layer_split.slices`.

Parameters stay whole on every rank (the session's optimizer steps them):
after backward one all-reduce sums every rank's partial gradients, so all
ranks take the same optimizer step, equal to single-process training up to
float summation order. DeePa itself keeps a channel-split layer's weights on
their owners only; a replicated-parameter contract needs this one all-reduce
instead (see docs/tuners/layer_split.md).

Why not DTensor: its ``redistribute`` moves between Shard/Replicate placements
of ONE device mesh; DeePa's neighbouring layers use meshes of different sizes
and shapes (four workers for one layer, sixteen for the next), and spatial
splits need halos, which placements do not express. Boxes and point-to-point
messages cover all of it with one mechanism.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tunekit.errors import PluginError
from tunekit.plugins.layer_split.model import (
    SplitConfig,
    Use,
    canonical,
    clip_boxes,
    config_space,
    input_boxes,
    owned_boxes,
    specs_from_graph,
)
from tunekit.plugins.layer_split.slices import build_programs
from tunekit.plugins.layer_split.units import split_graph

# -- redistribution --------------------------------------------------------------------------


def _intersect(a, b):
    """Intersection of two (4, 2) boxes, or None when empty."""
    if a is None or b is None:
        return None
    lo = [max(int(a[d][0]), int(b[d][0])) for d in range(4)]
    hi = [min(int(a[d][1]), int(b[d][1])) for d in range(4)]
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return list(zip(lo, hi, strict=True))


def _region(t: torch.Tensor, box, origin) -> torch.Tensor:
    """``t`` (a canonical 4-D tensor starting at ``origin``) restricted to ``box``."""
    idx = tuple(
        slice(int(box[d][0]) - int(origin[d][0]), int(box[d][1]) - int(origin[d][0]))
        for d in range(4)
    )
    return t[idx]


def _nonempty(box) -> bool:
    return box is not None and all(int(hi) > int(lo) for lo, hi in box)


@dataclass
class _Exchange:
    """Static schedule of moving one producer's output to one consumer's workers."""

    producer: str
    owned: list[Any]
    """Per rank: the box it holds of the producer's output (None: nothing)."""
    need: list[Any]
    """Per rank: the clipped box it needs (None: nothing)."""
    pad: tuple[int, int, int, int]
    """This rank's reach past the image border (top, bottom, left, right)."""
    replicated: bool = False


class PlanExecutor:
    """Trains ``model`` under a plan on this rank; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        graph,
        plan: Mapping[str, SplitConfig],
        global_batch: int,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None = None,
    ):
        self.model, self.rank, self.world, self.group = model, rank, world, group
        self.global_batch = global_batch
        self.specs = specs_from_graph(graph, global_batch)
        self.programs, self.ops = build_programs(model, graph, self.specs)
        self.plan = self._complete(plan)
        self.order = list(self.specs)
        self.boxes = {v: self._owned(v) for v in self.order}
        self.exchanges = {
            v: [self._exchange(v, use) for use in self.specs[v].uses] for v in self.order
        }
        self.norms = self._norm_owners()
        self._tag = 0
        self._pending_loss: torch.Tensor | None = None
        """The local loss of micro-batches not yet reduced (gradient accumulation)."""

    # -- set-up ---------------------------------------------------------------------------

    def _complete(self, plan: Mapping[str, SplitConfig]) -> dict[str, SplitConfig]:
        unknown = sorted(set(plan) - set(self.specs))
        if unknown:
            raise PluginError(
                f"layer_split: the plan names layer {unknown[0]!r}, which this model lacks"
            )
        out = {}
        for v, spec in self.specs.items():
            if spec.replicated:  # the input batch, a layer without a batch dimension
                if spec.kind != "input":
                    self.ops.check(self.programs[v], SplitConfig())
                out[v] = SplitConfig()
                continue
            if spec.kind == "output" and len(spec.uses) != 1:
                raise PluginError("layer_split: the executor needs a model that returns one tensor")
            if v not in plan:
                if spec.kind != "output":
                    raise PluginError(f"layer_split: the plan has no config for layer {v!r}")
                out[v] = SplitConfig()
                continue
            cfg = plan[v]
            if cfg not in config_space(spec, self.world):
                raise PluginError(
                    f"layer_split: {cfg.label()} is not a config of layer {v!r} ({spec.kind}, "
                    f"shape {list(spec.shape)}) on {self.world} ranks"
                )
            self.ops.check(self.programs[v], cfg)
            out[v] = cfg
        return out

    def _norm_owners(self) -> list[tuple[nn.Module, tuple[int, int] | None]]:
        """Batch norms and the channels whose running statistics this rank keeps for everyone:
        those of its slice when it is the first replica (sample, height and width index 0)."""
        out = []
        for v, prog in self.programs.items():
            nodes = [prog.anchor, *prog.members]
            for node in nodes:
                if node.op != "call_module":
                    continue
                mod = self.ops.module(node)
                if (
                    not isinstance(mod, nn.BatchNorm1d | nn.BatchNorm2d)
                    or not mod.track_running_stats
                ):
                    continue
                box = self.boxes[v][self.rank]
                co = self.plan[v].coords(self.rank) if box is not None else None
                first = co is not None and co[0] == co[2] == co[3] == 0
                out.append((mod, (int(box[1][0]), int(box[1][1])) if first else None))
        return out

    def _owned(self, v: str) -> list[Any]:
        cfg = self.plan[v]
        if self.specs[v].replicated:  # every rank holds (computes) all of it
            return [[[0, s] for s in self.specs[v].shape] for _ in range(self.world)]
        boxes = owned_boxes(self.specs[v], cfg)
        return [boxes[r].tolist() if r < cfg.workers else None for r in range(self.world)]

    def _exchange(self, v: str, use: Use) -> _Exchange:
        spec, prod = self.specs[v], self.specs[use.producer]
        owned = self.boxes[use.producer]
        need, pad = [], (0, 0, 0, 0)
        for r in range(self.world):
            out_box = self.boxes[v][r]
            if out_box is None:
                need.append(None)
                continue
            raw = input_boxes(spec, use, prod, torch.tensor(out_box).numpy())
            clipped = clip_boxes(raw, prod.shape)
            need.append(clipped.tolist() if _nonempty(clipped.tolist()) else None)
            if r == self.rank:
                pad = (
                    int(clipped[2][0] - raw[2][0]),
                    int(raw[2][1] - clipped[2][1]),
                    int(clipped[3][0] - raw[3][0]),
                    int(raw[3][1] - clipped[3][1]),
                )
        return _Exchange(use.producer, owned, need, pad, prod.replicated)

    # -- messages ----------------------------------------------------------------------------

    def _dtype_of(self, layer: str) -> torch.dtype:
        """What a layer's output travels as: its recorded dtype when not floating point (token
        ids), else the step's floating-point dtype (float64 in a float64 run)."""
        recorded = self.specs[layer].dtype
        if recorded and not getattr(torch, recorded).is_floating_point:
            return getattr(torch, recorded)
        return self._float

    def _next_tag(self) -> int:
        self._tag += 1
        return self._tag

    @torch.no_grad()
    def _forward_exchange(
        self, ex: _Exchange, local: torch.Tensor | None, full_input: torch.Tensor | None
    ):
        """This rank's needed region of the producer's output, assembled from its owners."""
        me = self.rank
        need = ex.need[me]
        if ex.replicated:  # every rank built the whole batch (or computed the whole layer)
            return None if need is None else _region(local, need, [(0, s) for s in local.shape])
        tag = self._next_tag()
        works, buffers = [], []
        mine = ex.owned[me]
        for r in range(self.world):
            if r == me:
                continue
            part = _intersect(mine, ex.need[r])
            if part is not None:
                works.append(
                    dist.isend(_region(local, part, mine).contiguous(), r, self.group, tag)
                )
        out = None
        if need is not None:
            shape = [int(hi - lo) for lo, hi in need]
            out = torch.empty(shape, dtype=self._dtype_of(ex.producer), device=self._device)
            for s in range(self.world):
                part = _intersect(ex.owned[s], need)
                if part is None:
                    continue
                dst = _region(out, part, need)
                if s == me:
                    dst.copy_(_region(local, part, mine))
                else:
                    buf = torch.empty(dst.shape, dtype=out.dtype, device=out.device)
                    works.append(dist.irecv(buf, s, self.group, tag))
                    buffers.append((dst, buf))
        for w in works:
            w.wait()
        for dst, buf in buffers:
            dst.copy_(buf)
        return out

    @torch.no_grad()
    def _backward_exchange(
        self, ex: _Exchange, grad_in: torch.Tensor | None, grad_out: torch.Tensor | None
    ):
        """Send the gradient of this rank's received region back to its owners; add theirs to ours."""
        if ex.replicated:  # a layer every rank computed whole: this rank's share of its gradient
            need = ex.need[self.rank]
            if grad_in is not None and grad_out is not None and need is not None:
                _region(grad_out, need, [(0, s) for s in grad_out.shape]).add_(grad_in)
            return
        me = self.rank
        need, mine = ex.need[me], ex.owned[me]
        tag = self._next_tag()
        works, buffers = [], []
        if need is not None:
            for s in range(self.world):
                part = _intersect(ex.owned[s], need)
                if part is None:
                    continue
                piece = _region(grad_in, part, need)
                if s == me:
                    _region(grad_out, part, mine).add_(piece)
                else:
                    works.append(dist.isend(piece.contiguous(), s, self.group, tag))
        for r in range(self.world):
            if r == me:
                continue
            part = _intersect(mine, ex.need[r])
            if part is not None:
                dst = _region(grad_out, part, mine)
                buf = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
                works.append(dist.irecv(buf, r, self.group, tag))
                buffers.append((dst, buf))
        for w in works:
            w.wait()
        for dst, buf in buffers:
            dst.add_(buf)

    # -- the step ------------------------------------------------------------------------------

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, reduce: bool = True
    ) -> torch.Tensor | None:
        """Forward and backward of one global batch; leaves full gradients in ``.grad`` on every
        rank and returns the global loss (the same value on every rank).

        ``reduce=False`` (a micro-batch before the step's last): no all-reduce; this rank's
        partial gradients and batch-norm statistics accumulate in place and its loss is
        kept, until a step with ``reduce=True`` reduces them all at once (returns None)."""
        if not isinstance(inputs, torch.Tensor):
            raise PluginError("layer_split: the executor needs a single input tensor")
        self._dtype, self._device = inputs.dtype, inputs.device
        self.ops.device = inputs.device
        self._float = (
            inputs.dtype
            if inputs.dtype.is_floating_point
            else next(
                (p.dtype for p in self.model.parameters() if p.is_floating_point()),
                torch.get_default_dtype(),
            )
        )
        self._tag = 0
        full_input = inputs.reshape(canonical(inputs.shape))
        outs: dict[str, torch.Tensor | None] = {}
        leaves: dict[str, list[torch.Tensor | None]] = {}
        loss_local = None
        for v in self.order:
            spec, cfg, box = self.specs[v], self.plan[v], self.boxes[v][self.rank]
            if spec.kind == "input":
                outs[v] = full_input  # every rank built the whole batch
                continue
            gathered = [
                self._forward_exchange(ex, outs.get(ex.producer), full_input)
                for ex in self.exchanges[v]
            ]
            if box is None:
                outs[v] = None
                leaves[v] = [None] * len(gathered)
                continue
            self._dtype = next((g.dtype for g in gathered if g is not None), self._dtype)
            xs, leaf_list = [], []
            for ex, use, g in zip(self.exchanges[v], spec.uses, gathered, strict=True):
                if g is None:  # an empty region (a concat input this worker does not cover)
                    g = torch.zeros([0, 0, 0, 0], dtype=self._dtype, device=self._device)
                trainable = not ex.replicated or self.specs[ex.producer].kind != "input"
                leaf = g.detach().requires_grad_(trainable and g.is_floating_point())
                leaf_list.append(leaf)
                xs.append(self._consumer_view(leaf, use, box))
            leaves[v] = leaf_list
            if spec.kind == "output":
                n0, n1 = box[0]
                t = targets[n0:n1]
                # The workload's loss is a mean over samples: weight each shard by its share.
                loss_local = loss_fn(xs[0], t) * ((n1 - n0) / self.global_batch)
                outs[v] = None
                continue
            pads = [ex.pad for ex in self.exchanges[v]]
            y = self.ops.run(self.programs[v], cfg, box, xs, pads)
            outs[v] = (
                y.reshape(canonical(y.shape)) if y.dim() <= 4 else y.reshape(y.shape[0], -1, 1, 1)
            )
        self._backward(outs, leaves, loss_local)
        if loss_local is not None:
            loss_local = loss_local.detach()
            if self._pending_loss is not None:
                loss_local = loss_local + self._pending_loss
        elif self._pending_loss is not None:
            loss_local = self._pending_loss
        if not reduce:
            self._pending_loss = loss_local
            for bn, _ in self.norms:
                if bn.training:
                    bn.num_batches_tracked.add_(1)
            return None
        self._pending_loss = None
        return self._all_reduce_grads(loss_local)

    def _consumer_view(self, leaf: torch.Tensor, use: Use, box) -> torch.Tensor:
        """The gathered region (canonical 4-D) shaped as the consumer's op reads it."""
        view = use.shape
        if leaf.numel() == 0 and leaf.shape[0] == 0:
            return leaf  # a concat input this worker does not cover
        if use.direct and len(view) <= 4:
            return leaf.reshape(leaf.shape[: len(view)])
        return leaf.reshape(leaf.shape[0], *view[1:])

    def _backward(self, outs, leaves, loss_local) -> None:
        grads: dict[str, torch.Tensor | None] = {}
        for v in self.order:
            if outs.get(v) is not None and self.specs[v].kind != "input":
                grads[v] = torch.zeros_like(outs[v])
        for v in reversed(self.order):
            spec = self.specs[v]
            if spec.kind == "input":
                continue
            mine = leaves.get(v, [])
            if spec.kind == "output":
                if loss_local is not None:
                    loss_local.backward()
            elif outs.get(v) is not None and outs[v].requires_grad:
                torch.autograd.backward(outs[v], grads[v])
            for ex, leaf in zip(
                self.exchanges[v], mine or [None] * len(self.exchanges[v]), strict=True
            ):
                g = None
                if leaf is not None and leaf.requires_grad:
                    g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._backward_exchange(ex, g, grads.get(ex.producer))

    def _all_reduce_grads(self, loss_local) -> torch.Tensor:
        """One all-reduce: everyone's partial gradients, the owners' batch-norm statistics, the loss."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        parts = [
            p.grad.reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in params
        ]
        stats = []
        for bn, channels in self.norms:
            for buf in (bn.running_mean, bn.running_var):
                mine = torch.zeros_like(buf)
                if channels is not None:
                    mine[channels[0] : channels[1]] = buf[channels[0] : channels[1]]
                stats.append((buf, mine))
                parts.append(mine)
        dtype = parts[0].dtype if parts else torch.float32
        loss = (
            loss_local.detach().reshape(1)
            if loss_local is not None
            else torch.zeros(1, device=self._device)
        )
        flat = torch.cat([x.to(dtype) for x in parts] + [loss.to(dtype)])
        if self.world > 1:
            dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in params:
            chunk = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += p.numel()
        with torch.no_grad():
            for buf, _ in stats:
                buf.copy_(flat[offset : offset + buf.numel()])
                offset += buf.numel()
            for bn, _ in self.norms:
                if bn.training:
                    bn.num_batches_tracked.add_(1)
        return flat[offset].clone()


# -- session hook ---------------------------------------------------------------------------


def named_plan(session, name: str, trace_batch: int = 2) -> dict[str, SplitConfig]:
    """``image`` or ``owt`` for the session's model on its ranks."""
    from tunekit.api import trace_model
    from tunekit.plugins.layer_split.search import named_configs

    graph = split_graph(trace_model(session.model, session.workload.example_batch(trace_batch)[0]))
    specs = specs_from_graph(graph, session.batch_size * session.world_size)
    spaces = {v: config_space(s, session.world_size) for v, s in specs.items()}
    return named_configs(specs, spaces, name)


def apply_plan(session, plan: Mapping[str, SplitConfig], trace_batch: int = 2) -> None:
    """Make ``session`` train under ``plan``: install the executor as its step function.

    Gradient synchronisation is the executor's own (the session's default DDP
    wrapper is replaced by a local no-op strategy until the next reset). The
    executor is rebuilt if the global batch changes (a ``batch`` tuner applies
    after placement).
    """
    from tunekit.api import LocalSync, trace_model

    graph = split_graph(trace_model(session.model, session.workload.example_batch(trace_batch)[0]))
    built: dict[int, PlanExecutor] = {}

    def executor_for(sess) -> PlanExecutor:
        global_batch = sess.batch_size * sess.world_size
        if global_batch not in built:
            built.clear()
            built[global_batch] = PlanExecutor(
                sess.model, graph, plan, global_batch, sess.rank, sess.world_size, sess.group
            )
        return built[global_batch]

    executor_for(session)  # refuse a plan the model cannot run now, not at the first step
    session.set_grad_sync(LocalSync())

    def step_fn(sess, step: int) -> torch.Tensor:
        acc = sess.accumulation
        loss_fn = sess.workload.loss
        if acc > 1:  # each micro-batch's loss weighs 1/acc of the step's, as under DDP

            def loss_fn(out, target, loss=sess.workload.loss):
                return loss(out, target) / acc

        executor = executor_for(sess)
        for micro in range(acc):
            # Only the last micro-batch reduces (the activations' exchanges are the split's own).
            inputs, targets = sess.data.global_batch(step * acc + micro)
            loss = executor.step(inputs, targets, loss_fn, reduce=micro == acc - 1)
        # Every rank holds the whole reduced gradient: clip by its global norm, step,
        # schedule (Session.optimizer_step, as under DDP).
        sess.optimizer_step(sess.optimizer)
        sess.optimizer.zero_grad(set_to_none=True)
        return loss

    step_fn.handles = LAYER_SPLIT_HANDLES
    session.step_fn = step_fn


LAYER_SPLIT_HANDLES = frozenset({"accumulation", "scheduler", "clipping"})
"""Training features the executor honours (``StepFn.handles``)."""

LAYER_SPLIT_DECLINES = {
    "amp": "the executor's exchanges and per-region ops to run under autocast; they run in "
    "the model's dtype",
    "grad_scaler": "a scaled loss through the executor's layer-by-layer backward; it "
    "backpropagates the unscaled loss",
    "sharded": "whole parameters on every rank to slice; FSDP holds them as shards, gathered "
    "per block only inside the model's own forward",
    "checkpointed": "the blocks' checkpointed forward; its executor runs the layers one by one, "
    "outside the blocks, and would keep every activation",
}
"""Why each feature it does not honour does not apply (its diagnosis says so)."""
