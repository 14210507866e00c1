"""Runtime: run a DLPlacer placement for real, as an N × M mesh of gloo/NCCL ranks.

The world of ``W = N × M`` ranks is a 2-D mesh (``data`` × ``model``):
rank ``r`` is model-parallel index ``r % M`` of data-parallel replica
``r // M``. Each replica trains on its own mini-batch of B samples (global
batch N × B, Pal et al.'s hybrid), and within a replica the traced model runs
split by the placement:

* The ``torch.fx`` graph is cut into **segments**: maximal runs of nodes on
  one device in the planned execution order
  (:mod:`~tunekit.plugins.hybrid_mp.split_program`). Every rank walks the
  same list and runs only its own.
* **Forward**: a segment's inputs from another device are received
  (``recv``), its outputs needed elsewhere are sent (``isend``), each value
  once per consuming device (:mod:`~tunekit.plugins.hybrid_mp.channel`).
  Received values become leaf tensors.
* **Backward**: segments run in reverse order; each calls
  ``torch.autograd.backward`` on its outputs with the gradients its consumers
  returned, then sends its inputs' gradients back to their producers.
  Walking one global order with non-blocking sends cannot deadlock: the
  earliest unfinished segment always has everything it waits for.
* **Gradients**: parameters used on several devices are summed across the
  model group; every rank then averages its parameters' gradients across the
  data group and steps the optimizer, which skips the parameters it does not
  own (their gradient stays ``None``).
* **Flush** (checkpoint, config change, end): each parameter, buffer and
  optimizer state is broadcast from its owner, so every rank again holds the
  whole, current model, as :meth:`Session.state_dict` expects.

:class:`HybridSync` is the session's gradient strategy while the placement is
installed (the tuner ``excludes`` the ``grad_sync`` aspect);
:func:`install_hybrid` wires it and ``session.step_fn``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from tunekit.api import ALL_FEATURES, BatchSource, CommRecord, GradSync, Session, broadcast_object
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.channel import Channel
from tunekit.plugins.hybrid_mp.split_program import Segment, SplitProgram, build_program

__all__ = [
    "HybridSync",
    "install_hybrid",
    "mesh_coords",
]


def mesh_coords(rank: int, mp: int) -> tuple[int, int]:
    """(data-parallel index, model-parallel index) of ``rank`` in an N × ``mp`` mesh."""
    return rank // mp, rank % mp


# -- the step --------------------------------------------------------------------------------


class _Runner(torch.fx.Interpreter):
    """Runs single fx nodes against an environment we manage."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)


class HybridSync(GradSync):
    """One rank of an N × M hybrid: split forward/backward, gradient sync, owner broadcasts."""

    name = "hybrid_mp"

    def __init__(
        self,
        program: SplitProgram,
        dp: int,
        mp: int,
        groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
    ):
        self.program = program
        self.dp, self.mp = dp, mp
        self.dp_group, self.mp_group = groups
        self._records: list[CommRecord] = []
        self._dirty = False

    # -- GradSync ------------------------------------------------------------------------------

    def attach(self, session: Session) -> None:
        super().attach(session)
        self.rank = session.rank
        self.dp_index, self.mp_index = mesh_coords(session.rank, self.mp)
        self.channel = Channel(session.device)
        self.runner = _Runner(self.program.gm)
        self.source = BatchSource(
            session.workload,
            rank=self.dp_index,
            world_size=self.dp,
            device=session.device,
            batch_size=session.batch_size,
            seed=session.data.seed,
        )
        params = list(session.model.parameters())
        self.params = params
        mine = {self.mp_index}
        devs = self.program.param_devices
        self.owned = [p for p in params if devs.get(id(p), set()) & mine]
        self.shared = [p for p in params if len(devs.get(id(p), set())) > 1]
        self.fwd_order, self.bwd_order = _receive_orders(self.program, self.mp_index)

    def global_rank(self, mp_index: int) -> int:
        return self.dp_index * self.mp + mp_index

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        start = time.perf_counter()
        if self.mp > 1 and self.shared:
            _all_reduce_grads(self.shared, self.mp_group, average=False)
        if self.dp > 1 and self.owned:
            _all_reduce_grads(self.owned, self.dp_group, average=True)
        if self.dp > 1 or self.shared:
            waited = time.perf_counter() - start
            nbytes = sum(p.numel() * p.element_size() for p in self.owned)
            self._records.append(CommRecord("gradients", nbytes, waited, waited))
        scaler = self.session.scaler
        if scaler is not None:
            # A rank without the loss never scaled anything: this starts its scale, equal
            # to every rank's (they all back off and grow on the same agreed inf flags).
            scaler.scale(torch.zeros((), device=self.session.device))
            scaler.unscale_(optimizer)
            self._agree_on_inf(scaler, optimizer)
        clip = self.session.workload.clip_grad_norm
        if clip is not None:
            self._clip(clip)
        if scaler is not None:
            scaler.step(optimizer)  # skipped on every rank alike when any gradient had an inf
            scaler.update()
        else:
            optimizer.step()
        if self.session.scheduler is not None:
            self.session.scheduler.step()  # once per optimizer step, on every rank

    def _agree_on_inf(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        """fp16: the GradScaler's inf check over the whole model. Each rank's optimizer sees
        only its own devices' gradients, so an inf found by any rank of the model group
        counts on all of them (they then skip the step, and back the scale off, together)."""
        if self.mp <= 1:
            return  # every rank holds the whole (data-parallel averaged) gradient
        # The scaler's per-device inf flags of this optimizer (no public API exposes them).
        found = scaler._found_inf_per_device(optimizer)
        device = str(self.session.device)
        if not found:
            found[device] = torch.zeros((), dtype=torch.float32, device=self.session.device)
        flag = torch.stack([v.reshape(()).to(torch.float32) for v in found.values()]).amax()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mp_group)
        for v in found.values():
            v.fill_(flag.item())

    def _clip(self, max_norm: float) -> None:
        """Clip by the norm of the whole model's gradient, as ``clip_grad_norm_`` on one
        process: each rank holds only its devices' parameters, so the squared norms of the
        parameters it owns (a shared one counted on its first owner only) are summed over
        the model group first; every rank then scales by the same factor."""
        devs = self.program.param_devices
        squares = torch.zeros((), dtype=torch.float64, device=self.session.device)
        for p in self.params:
            owners = devs.get(id(p), set())
            if p.grad is not None and owners and min(owners) == self.mp_index:
                squares += torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
        if self.mp > 1:
            dist.all_reduce(squares, group=self.mp_group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))

    def flush(self) -> None:
        """Give every rank of the model group the owners' parameters, buffers and optimizer state."""
        if self.mp <= 1 or not self._dirty:
            return
        self.channel.wait_all()
        model = self.session.model
        devs = self.program.param_devices
        for p in self.params:
            owners = devs.get(id(p), set())
            if len(owners) == 1:
                (owner,) = owners
                dist.broadcast(p.data, self.global_rank(owner), group=self.mp_group)
        for b in model.buffers():
            owners = self.program.buffer_devices.get(id(b), set())
            if owners:
                dist.broadcast(b.data, self.global_rank(min(owners)), group=self.mp_group)
        _sync_optimizer_state(self, devs)
        self._dirty = False

    def detach(self) -> None:
        """Nothing to undo: the session flushed before replacing this strategy."""

    def comm_records(self) -> list[CommRecord]:
        out = self._records + self.channel.records
        self._records, self.channel.records = [], []
        return out

    # -- the training step -----------------------------------------------------------------------

    def train_step(self, session: Session, step: int) -> torch.Tensor:
        """Forward and backward through the split model, sync gradients, update."""
        if self.source.batch_size != session.batch_size:
            self.source.set_batch_size(session.batch_size)
        self.source.set_options(session.data.options)
        acc = session.accumulation
        self._dirty = True
        total: torch.Tensor | None = None
        for micro in range(acc):
            # Micro-batches only accumulate gradients in .grad (their activations still
            # cross devices: model parallelism needs them); the gradient reductions run
            # once, in step(), on the accumulated sum.
            inputs, targets = self.source.batch(step * acc + micro)
            loss = self._forward_backward(inputs, targets, acc)
            self.channel.wait_all()
            if loss is not None:
                loss = loss.detach() / acc
                total = loss if total is None else total + loss
        self.step(session.optimizer)
        session.optimizer.zero_grad(set_to_none=True)
        return self._global_loss(total)

    def _forward_backward(
        self, inputs: Any, targets: torch.Tensor, micro_batches: int = 1
    ) -> torch.Tensor | None:
        """One micro-batch through this rank's segments: forward in order, then backward in
        reverse; returns the loss on the rank that computes it (else None)."""
        self.channel.start_step()
        args = inputs if isinstance(inputs, tuple | list) else (inputs,)
        mine = [s for s in self.program.segments if s.device == self.mp_index]
        leaves: dict[tuple[str, int], torch.Tensor] = {}  # (value, consuming segment) -> leaf
        values: dict[str, Any] = {}  # value -> its output where this rank produced it
        signature = _signature(args)
        loss = self._forward(mine, args, targets, signature, leaves, values)
        self._backward(mine, loss, micro_batches, signature, leaves, values)
        return loss

    def _forward(
        self,
        mine: list[Segment],
        args: Sequence[Any],
        targets: torch.Tensor,
        signature: tuple,
        leaves: dict[tuple[str, int], torch.Tensor],
        values: dict[str, Any],
    ) -> torch.Tensor | None:
        """Run this rank's segments in order: receive each one's inputs from other devices
        (as leaf tensors), run its nodes, send its outputs to the devices that read them."""
        prog, me = self.program, self.mp_index
        env: dict[torch.fx.Node, Any] = {}
        self.runner.env = env
        placeholders = [n for n in prog.replicated if n.op == "placeholder"]
        for n, a in zip(placeholders, args, strict=False):
            env[n] = a
        for n in prog.replicated:
            if n.op == "get_attr":
                env[n] = self.runner.run_node(n)
        nodes = {n.name: n for n in prog.gm.graph.nodes}
        received: dict[str, torch.Tensor] = {}
        loss = None
        for seg in mine:
            for v in seg.inputs:
                src_seg = prog.segments[prog.producer[v]]
                if src_seg.device == me:
                    base = values[v]
                else:
                    if v not in received:
                        src = src_seg.device
                        received[v] = self.channel.take(
                            ("fwd", src),
                            self.fwd_order[src],
                            v,
                            self.global_rank(src),
                            signature,
                        )
                    base = received[v]
                leaf = base.detach()
                if leaf.is_floating_point():
                    leaf.requires_grad_(True)
                leaves[(v, seg.index)] = leaf
                env[nodes[v]] = leaf
            for n in seg.nodes:
                # The workload's autocast, as around DDP's forward and loss (a no-op in fp32).
                with self.session.autocast():
                    if n is prog.output_node:
                        out = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
                        loss = self.session.workload.loss(out, targets)
                    else:
                        env[n] = self.runner.run_node(n)
            for v in seg.outputs:
                values[v] = env[nodes[v]]
                for dev in sorted({prog.segments[c].device for c in prog.consumers[v]} - {me}):
                    self.channel.send(values[v], self.global_rank(dev), f"fwd {v}", signature)
            # later segments on this rank read their inputs from `leaves`, not env
        return loss

    def _backward(
        self,
        mine: list[Segment],
        loss: torch.Tensor | None,
        micro_batches: int,
        signature: tuple,
        leaves: dict[tuple[str, int], torch.Tensor],
        values: dict[str, Any],
    ) -> None:
        """Run this rank's segments in reverse: backward from each one's outputs with the
        gradients their consumers returned (and from the loss), then send its inputs'
        gradients back to their producers."""
        for seg in reversed(mine):
            roots: list[torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            if seg.has_loss and loss is not None:
                root = loss / micro_batches if micro_batches > 1 else loss
                scaler = self.session.scaler
                roots.append(scaler.scale(root) if scaler is not None else root)
                grads.append(None)
            for v in seg.outputs:
                value = values[v]
                if not _floating(value):
                    continue
                total = self._output_gradient(v, values, leaves, signature)
                if value.requires_grad and total is not None:
                    roots.append(value)
                    grads.append(total)
            if roots:
                torch.autograd.backward(roots, grads)
            self._return_input_gradients(seg, leaves, signature)

    def _output_gradient(
        self,
        v: str,
        values: Mapping[str, Any],
        leaves: Mapping[tuple[str, int], torch.Tensor],
        signature: tuple,
    ) -> torch.Tensor | None:
        """The gradient of output ``v``: its local consumers' leaves' gradients plus what
        each other device that reads it returned (None when nothing reached it)."""
        prog, me = self.program, self.mp_index
        total = None
        for c in prog.consumers[v]:
            c_dev = prog.segments[c].device
            if c_dev == me:
                g = leaves[(v, c)].grad
                if g is not None:
                    total = g if total is None else total + g
        for dev in sorted({prog.segments[c].device for c in prog.consumers[v]} - {me}):
            g = self.channel.take(
                ("bwd", dev),
                self.bwd_order[dev],
                v,
                self.global_rank(dev),
                signature,
                wanted=lambda x: _floating(values[x]),
            )
            total = g if total is None else total + g
        return total

    def _return_input_gradients(
        self, seg: Segment, leaves: Mapping[tuple[str, int], torch.Tensor], signature: tuple
    ) -> None:
        """Send the gradients of ``seg``'s inputs from other devices back to their producers,
        summed over this rank's consumers: the earliest of them sends, as it runs backward last."""
        prog, me = self.program, self.mp_index
        for v in seg.inputs:
            src_dev = prog.segments[prog.producer[v]].device
            local = [c for c in prog.consumers[v] if prog.segments[c].device == me]
            if src_dev == me or seg.index != local[0]:
                continue  # a local value, or not yet every local consumer's gradient
            leaf = leaves[(v, seg.index)]
            if not leaf.is_floating_point():
                continue
            total = torch.zeros_like(leaf)
            for c in local:
                g = leaves[(v, c)].grad
                if g is not None:
                    total = total + g
            self.channel.send(total, self.global_rank(src_dev), f"bwd {v}", signature)

    def _global_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The mean loss over the global batch, the same on every rank."""
        value = torch.zeros((), device=self.session.device)
        if loss is not None:
            value = loss.detach().clone().reshape(())
        if dist.is_initialized() and self.session.world_size > 1:
            dist.all_reduce(value)
            value /= self.dp
        return value


HYBRID_HANDLES = ALL_FEATURES
"""Training features the hybrid honours: all (fp16's inf check is agreed over the model
group, clipping's norm summed over it)."""
HYBRID_NEEDS: dict[str, str] = {
    "sharded": "whole parameters on the devices of its placement; FSDP holds them as shards "
    "gathered only inside the model's own forward",
    "checkpointed": "the blocks' checkpointed forward; its executor runs the placed layers one "
    "by one, outside the blocks, and would keep every activation",
}
"""Why each feature the hybrid does not honour does not apply (its diagnosis says so)."""
HybridSync.handles = HYBRID_HANDLES
HybridSync.train_step.handles = HYBRID_HANDLES


def _floating(value: Any) -> bool:
    """Whether a value crossing devices carries a gradient back."""
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _receive_orders(
    prog: SplitProgram, me: int
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """The order in which each peer sends this device values (forward) and gradients
    (backward): both ends walk the same segment list, so both can compute it."""
    dev_of = [s.device for s in prog.segments]
    fwd: dict[int, list[str]] = {}
    bwd: dict[int, list[str]] = {}
    for seg in prog.segments:
        for v in seg.outputs:
            if seg.device != me and me in {dev_of[c] for c in prog.consumers[v]}:
                fwd.setdefault(seg.device, []).append(v)
    for seg in reversed(prog.segments):
        for v in seg.inputs:
            local = [c for c in prog.consumers[v] if dev_of[c] == seg.device]
            if seg.device != me and dev_of[prog.producer[v]] == me and seg.index == local[0]:
                bwd.setdefault(seg.device, []).append(v)
    return fwd, bwd


def _signature(args: Sequence[Any]) -> tuple:
    return tuple(
        (tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else type(a).__name__
        for a in args
    )


def _all_reduce_grads(params: list[nn.Parameter], group, average: bool) -> None:
    """One flat all-reduce of the parameters' gradients (missing ones count as zero)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def _sync_optimizer_state(sync: HybridSync, devs: Mapping[int, set[int]]) -> None:
    """Broadcast each single-owner parameter's optimizer state from its owner."""
    opt = sync.session.optimizer
    for owner in range(sync.mp):
        owned = [p for p in sync.params if devs.get(id(p), set()) == {owner}]
        meta = None
        if sync.mp_index == owner:
            meta = [
                {
                    k: (["tensor", list(v.shape), str(v.dtype).removeprefix("torch.")]
                        if isinstance(v, torch.Tensor) else ["value", v])
                    for k, v in opt.state.get(p, {}).items()
                }
                for p in owned
            ]  # fmt: skip
        meta = _broadcast_json(meta, sync.global_rank(owner), sync.mp_group)
        for p, entries in zip(owned, meta, strict=True):
            state = opt.state[p] if sync.mp_index == owner else {}
            for key, (kind, *rest) in entries.items():
                if kind == "value":
                    state[key] = rest[0]
                    continue
                shape, dtype = rest
                t = (
                    state[key]
                    if sync.mp_index == owner
                    else torch.empty(shape, dtype=getattr(torch, dtype), device=p.device)
                )
                dist.broadcast(t, sync.global_rank(owner), group=sync.mp_group)
                state[key] = t
            if sync.mp_index != owner and entries:
                opt.state[p] = state


def _broadcast_json(obj: Any, src: int, group) -> Any:
    """``broadcast_object`` from a global rank within ``group`` (JSON, never pickle)."""
    if group is None:
        return broadcast_object(obj, src=src)
    payload = [json.dumps(obj)]
    dist.broadcast_object_list(payload, src=src, group=group)
    return json.loads(payload[0])


# -- installing --------------------------------------------------------------------------------


_MESHES: dict[tuple[int, int], tuple[Any, Any]] = {}
"""(world, mp) -> (the default process group it was built in, the mesh)."""


def make_groups(
    world: int, mp: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, Any]:
    """This rank's (data group, model group) of the N × M mesh, and the mesh itself.

    Every rank must call it (it creates process groups); meshes are kept per
    shape, so re-applying a placement does not create new groups.
    """
    if world % mp:
        raise ConfigError(f"hybrid_mp: {world} ranks cannot form groups of mp_degree={mp}")
    if world == 1:
        return None, None, None
    key = (world, mp)
    world_group = dist.group.WORLD
    built_in, mesh = _MESHES.get(key, (None, None))
    if mesh is None or built_in is not world_group:  # a new process group: the old groups are gone
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (world // mp, mp), mesh_dim_names=("data", "model"))
        _MESHES[key] = (world_group, mesh)
    return mesh.get_group("data"), mesh.get_group("model"), mesh


def install_hybrid(
    session: Session,
    node_device: Mapping[str, int],
    mp: int,
    order: Mapping[str, float] | None = None,
) -> HybridSync:
    """Make ``session`` train as an N × ``mp`` hybrid with the given node placement.

    Model and optimizer state carry over; ``session.reset()`` (a config
    change, a rollback) flushes owners' state to every rank and restores the
    default step.
    """
    if mp < 1 or session.world_size % mp:
        raise ConfigError(
            f"hybrid_mp: mp_degree={mp} must divide the world size {session.world_size}"
        )
    dp = session.world_size // mp
    program = build_program(session.model, node_device, order, mp)
    dp_group, mp_group, _mesh = make_groups(session.world_size, mp)
    sync = HybridSync(program, dp, mp, (dp_group, mp_group))
    session.set_grad_sync(sync)
    session.step_fn = sync.train_step  # its handles: HybridSync.train_step.handles
    # Global batch N x B instead of W x B; the session rescales the lr by the workload's
    # rule and keeps composing it with a batch tuner's changes.
    session.set_data_parallel(dp)
    return sync
