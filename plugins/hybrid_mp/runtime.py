"""Runtime: run a DLPlacer placement for real, as an N × M mesh of gloo/NCCL ranks.

The world of ``W = N × M`` ranks is a 2-D mesh (``data`` × ``model``):
rank ``r`` is model-parallel index ``r % M`` of data-parallel replica
``r // M``. Each replica trains on its own mini-batch of B samples (global
batch N × B, Pal et al.'s hybrid), and within a replica the traced model runs
split by the placement:

* The ``torch.fx`` graph is cut into **segments**: maximal runs of nodes on
  one device in the planned execution order (where the placement's schedule
  has each op: the midpoint of its interval, so a zero-duration op runs
  between the ops it sits between, never later).
  Segments are intervals of a topological order, so every rank can walk the
  same list and run only its own.
* **Forward**: a segment's inputs from another device are received
  (``recv``), its outputs needed elsewhere are sent (``isend``), each value
  once per consuming device. Received values become leaf tensors.
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

import heapq
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from tunekit.api import ALL_FEATURES, BatchSource, CommRecord, GradSync, Session, broadcast_object
from tunekit.errors import ConfigError, PluginError

__all__ = [
    "HybridSync",
    "SplitProgram",
    "build_program",
    "install_hybrid",
    "mesh_coords",
]


def mesh_coords(rank: int, mp: int) -> tuple[int, int]:
    """(data-parallel index, model-parallel index) of ``rank`` in an N × ``mp`` mesh."""
    return rank // mp, rank % mp


# -- the split program ---------------------------------------------------------------------


@dataclass
class Segment:
    """A run of fx nodes on one model-parallel device."""

    index: int
    device: int
    nodes: list[torch.fx.Node]
    inputs: list[str] = field(default_factory=list)
    """Values (node names) this segment reads from other segments."""
    outputs: list[str] = field(default_factory=list)
    """Values it produces that later segments read."""
    has_loss: bool = False


@dataclass
class SplitProgram:
    """The traced model cut into segments by device, in execution order."""

    gm: torch.fx.GraphModule
    segments: list[Segment]
    mp: int
    producer: dict[str, int]
    """Value -> index of the segment that produces it."""
    consumers: dict[str, list[int]]
    """Value -> indices of the segments that read it (in order)."""
    replicated: list[torch.fx.Node]
    """Placeholders and attribute reads: evaluated on every rank."""
    output_node: torch.fx.Node
    param_devices: dict[int, set[int]]
    """id(parameter) -> model-parallel devices that use it."""
    buffer_devices: dict[int, set[int]]

    @property
    def loss_device(self) -> int:
        return next(s.device for s in self.segments if s.has_loss)

    def describe(self) -> list[dict[str, Any]]:
        """Segments as plain data (for logs and tests)."""
        return [
            {
                "index": s.index,
                "device": s.device,
                "nodes": [n.name for n in s.nodes],
                "inputs": list(s.inputs),
                "outputs": list(s.outputs),
            }
            for s in self.segments
        ]


def build_program(
    model: nn.Module,
    node_device: Mapping[str, int],
    order: Mapping[str, float] | None = None,
    mp: int | None = None,
) -> SplitProgram:
    """Trace ``model`` and cut it into per-device segments.

    ``node_device`` maps fx node names to model-parallel device indices
    (nodes it leaves out run where their first input runs); ``order`` maps
    node names to their planned place in time (``placement_nodes`` gives the
    midpoint of each op's scheduled interval), which leads the execution order
    among nodes whose inputs are ready: each device then runs its nodes in the
    schedule's order for that device.
    """
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as exc:
        raise PluginError(
            f"hybrid_mp: torch.fx cannot trace {type(model).__name__} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); model parallelism needs a traceable model"
        ) from exc
    nodes = list(gm.graph.nodes)
    fx_pos = {n: i for i, n in enumerate(nodes)}
    replicated = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    rep = set(replicated)
    output_node = next(n for n in nodes if n.op == "output")
    mp = mp or (max(node_device.values(), default=0) + 1)
    device: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n in rep:
            continue
        if n.name in node_device:
            device[n] = int(node_device[n.name])
        else:
            producers = [a for a in n.all_input_nodes if a not in rep]
            device[n] = device[producers[0]] if producers else 0
        if not 0 <= device[n] < mp:
            raise ConfigError(
                f"hybrid_mp: node {n.name} placed on device {device[n]}, outside 0..{mp - 1}"
            )
    # Execution order: Kahn's algorithm led by the planned times; a node without
    # one inherits the latest of its inputs'.
    order = order or {}
    prio: dict[torch.fx.Node, float] = {}
    for n in nodes:
        inherited = max((prio[a] for a in n.all_input_nodes if a in prio), default=0.0)
        prio[n] = float(order[n.name]) if n.name in order else inherited
    pending = {n: sum(1 for a in n.all_input_nodes if a not in rep) for n in nodes if n not in rep}
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for a in n.all_input_nodes:
            users[a].append(n)
    ready = [(prio[n], fx_pos[n]) for n, k in pending.items() if k == 0]
    heapq.heapify(ready)
    ordered: list[torch.fx.Node] = []
    while ready:
        _, pos = heapq.heappop(ready)
        n = nodes[pos]
        ordered.append(n)
        for u in users[n]:
            if u in pending:
                pending[u] -= 1
                if pending[u] == 0:
                    heapq.heappush(ready, (prio[u], fx_pos[u]))
    # The output node belongs with whatever produces the model's output.
    segments: list[Segment] = []
    for n in ordered:
        if not segments or segments[-1].device != device[n]:
            segments.append(Segment(len(segments), device[n], []))
        segments[-1].nodes.append(n)
        if n is output_node:
            segments[-1].has_loss = True
    seg_of = {n: s.index for s in segments for n in s.nodes}
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for s in segments:
        for n in s.nodes:
            for a in n.all_input_nodes:
                if a in rep or seg_of[a] == s.index:
                    continue
                if a.name not in s.inputs:
                    s.inputs.append(a.name)
                    consumers.setdefault(a.name, []).append(s.index)
                    producer[a.name] = seg_of[a]
                    src = segments[seg_of[a]]
                    if a.name not in src.outputs:
                        src.outputs.append(a.name)
    # Who uses which parameters and buffers (a module called on two devices shares them).
    modules = dict(gm.named_modules())
    param_devices: dict[int, set[int]] = {}
    buffer_devices: dict[int, set[int]] = {}
    for n in ordered:
        owned: list[torch.Tensor] = []
        bufs: list[torch.Tensor] = []
        if n.op == "call_module":
            owned = list(modules[n.target].parameters())
            bufs = list(modules[n.target].buffers())
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                attr = _attr(gm, str(a.target))
                if isinstance(attr, nn.Parameter):
                    owned.append(attr)
                elif isinstance(attr, torch.Tensor):
                    bufs.append(attr)
        for p in owned:
            param_devices.setdefault(id(p), set()).add(device[n])
        for b in bufs:
            buffer_devices.setdefault(id(b), set()).add(device[n])
    return SplitProgram(
        gm=gm,
        segments=segments,
        mp=mp,
        producer=producer,
        consumers=consumers,
        replicated=replicated,
        output_node=output_node,
        param_devices=param_devices,
        buffer_devices=buffer_devices,
    )


def _attr(root: nn.Module, path: str):
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# -- moving tensors between ranks ----------------------------------------------------------

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims


class _Channel:
    """Point-to-point transfers, received in the order they were sent.

    Shapes travel in a small header the first time a value crosses for a
    given input signature. No tags: NCCL has none and matches sends to
    receives in order, so :meth:`take` receives from a peer strictly in the
    peer's send order (which both ends compute from the segment list),
    holding early arrivals until they are needed; gloo runs the same way.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self.records: list[CommRecord] = []
        self.inbox: dict[tuple, dict[str, torch.Tensor]] = {}
        self.cursor: dict[tuple, int] = {}

    def start_step(self) -> None:
        self.inbox.clear()
        self.cursor.clear()

    def take(
        self,
        key: tuple,
        order: Sequence[str],
        value: str,
        src: int,
        signature: tuple,
        wanted=lambda _v: True,
    ) -> torch.Tensor:
        """``value`` from rank ``src``, which sends the values of ``order`` in that order
        (those ``wanted`` says it skips are never sent)."""
        box = self.inbox.setdefault(key, {})
        pos = self.cursor.get(key, 0)
        while value not in box:
            if pos >= len(order):
                raise PluginError(f"hybrid_mp: {value} never arrives from rank {src}")
            nxt, pos = order[pos], pos + 1
            if wanted(nxt):
                box[nxt] = self.recv(src, f"{key[0]} {nxt}", signature)
        self.cursor[key] = pos
        return box.pop(value)

    def send(self, t: torch.Tensor, dst: int, name: str, signature: tuple) -> None:
        if not isinstance(t, torch.Tensor):
            raise PluginError(
                f"hybrid_mp: value {name} ({type(t).__name__}) must cross devices but is not a tensor; "
                "place its producer and consumers together"
            )
        t = t.detach().contiguous()
        key = (signature, name, dst)
        if key not in self.shapes:
            if t.dim() > _HEADER_LEN - 2 or t.dtype not in _DTYPES:
                raise PluginError(f"hybrid_mp: cannot send {name} ({t.dtype}, {t.dim()} dims)")
            header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
            header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            header = header.to(self.device)
            self.pending.append((dist.isend(header, dst), header))
            self.shapes[key] = (t.shape, t.dtype)
        self.pending.append((dist.isend(t, dst), t))

    def recv(self, src: int, name: str, signature: tuple) -> torch.Tensor:
        key = (signature, name, src)
        start = time.perf_counter()
        if key not in self.shapes:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.recv(header, src)
            h = header.cpu().tolist()
            self.shapes[key] = (torch.Size(h[2 : 2 + h[1]]), _DTYPES[h[0]])
        shape, dtype = self.shapes[key]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src)
        waited = time.perf_counter() - start
        self.records.append(
            CommRecord(f"recv {name}", buf.numel() * buf.element_size(), waited, waited)
        )
        return buf

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


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
        self.channel = _Channel(session.device)
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
        prog, me = self.program, self.mp_index
        self.channel.start_step()
        args = inputs if isinstance(inputs, tuple | list) else (inputs,)
        env: dict[torch.fx.Node, Any] = {}
        self.runner.env = env
        placeholders = [n for n in prog.replicated if n.op == "placeholder"]
        for n, a in zip(placeholders, args, strict=False):
            env[n] = a
        for n in prog.replicated:
            if n.op == "get_attr":
                env[n] = self.runner.run_node(n)
        signature = _signature(args)
        nodes = {n.name: n for n in prog.gm.graph.nodes}
        received: dict[str, torch.Tensor] = {}
        leaves: dict[tuple[str, int], torch.Tensor] = {}  # (value, consuming segment) -> leaf
        values: dict[str, Any] = {}
        loss = None
        mine = [s for s in prog.segments if s.device == me]
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
                if value.requires_grad and total is not None:
                    roots.append(value)
                    grads.append(total)
            if roots:
                torch.autograd.backward(roots, grads)
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
        return loss

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
HYBRID_NEEDS: dict[str, str] = {}
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
