"""CGDP inside a worker: host-side, chunk-by-chunk gradient reduction during backward.

:class:`CgdpSync` is a :class:`~tunekit.runtime.sync.GradSync`. Every
parameter gets a post-accumulate-grad hook; the hooks count a chunk's
gradients, and when a chunk is complete:

* on a GPU its gradients are copied into pinned host buffers on a D2H side
  stream; a communication thread waits for the copy, all-reduces the host
  buffer across ranks (gloo, on a gloo group beside the job's NCCL group),
  averages it by 1/G and copies it back on an H2D stream (Le et al.'s three
  streams);
* on a CPU the copy into the host buffer is a plain copy on the backward
  thread; the all-reduce is gloo's asynchronous one, and the copy back with
  the 1/G average runs in its completion callback, beside backward.

Chunks are posted in layout order on every rank, so collectives match across
ranks whatever order autograd finishes them in. The optimizer steps once
every chunk is back. With ``offload_optimizer`` the reduced gradients stay
on the host, where the optimizer's state and step live (ZeRO-Offload
style); only the updated parameters are copied to the device.

One module, though long: the executor's hooks, host buffers, the chunk
reducer and the offloaded optimizer share one per-step state machine
(``CgdpSync``), whose ordering guarantees are easier to check in one place.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tunekit.api import (
    ALL_FEATURES,
    CommRecord,
    GradSync,
    HookedAccumulation,
    block_units,
    broadcast_object,
)
from tunekit.contract import SearchResult
from tunekit.errors import PluginError
from tunekit.plugins.cgdp.search import chunk_layout, unit_layout

if TYPE_CHECKING:
    from tunekit.api import Session


CHUNK_BY = ("layers", "blocks")
"""What ``chunk_size`` counts: layers (the paper's k), or whole transformer blocks."""

# -- layers -------------------------------------------------------------------------------


@dataclass
class Layer:
    """A parameterised module: the paper's unit of gradient readiness."""

    name: str
    params: list[nn.Parameter]
    path: str = ""
    """Module path in the model ("" for the root; ``name`` then shows its class)."""
    kind: str = ""
    """The module's class name (``Linear``, ``LayerNorm``)."""


def parameterised_layers(model: nn.Module) -> list[Layer]:
    """Modules owning trainable parameters directly, in registration (≈ forward) order.

    A parameter shared by several modules belongs to the first.
    """
    seen: set[int] = set()
    layers = []
    for name, module in model.named_modules():
        own = []
        for p in module.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                own.append(p)
        if own:
            layers.append(Layer(name or type(module).__name__, own, name, type(module).__name__))
    return layers


# -- host process group -----------------------------------------------------------------------

_HOST_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks for reducing host tensors (one per process, reused).

    Our own group keeps CGDP's collectives, which the communication thread
    issues, from interleaving with anybody else's; on GPU jobs it is the gloo
    group beside NCCL that host tensors need. Creating it is collective.
    """
    ranks = (
        tuple(dist.get_process_group_ranks(group))
        if group is not None
        else tuple(range(dist.get_world_size()))
    )
    key = (id(dist.group.WORLD), ranks)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(ranks=list(ranks), backend="gloo")
    return _HOST_GROUPS[key]


# -- host buffers ---------------------------------------------------------------------------------


class HostBuffers:
    """One flat host buffer per dtype, parameters in backward order.

    A chunk is a run of consecutive layers in backward order, so within each
    dtype's buffer its gradients are one contiguous slice.
    """

    def __init__(self, params: Sequence[nn.Parameter], pin: bool):
        self.pin = pin
        sizes: dict[torch.dtype, int] = defaultdict(int)
        self.offsets: list[tuple[torch.dtype, int, int]] = []
        for p in params:
            start = sizes[p.dtype]
            sizes[p.dtype] += p.numel()
            self.offsets.append((p.dtype, start, start + p.numel()))
        self.flat = {dt: torch.zeros(n, dtype=dt, pin_memory=pin) for dt, n in sizes.items()}

    def view(self, i: int, shape: torch.Size) -> torch.Tensor:
        """Parameter ``i``'s slot, shaped like it."""
        dt, a, b = self.offsets[i]
        return self.flat[dt][a:b].view(shape)

    def slices(self, first: int, last: int) -> list[torch.Tensor]:
        """The contiguous slices (one per dtype) holding parameters ``first..last-1``."""
        span: dict[torch.dtype, list[int]] = {}
        for dt, a, b in self.offsets[first:last]:
            lo_hi = span.setdefault(dt, [a, b])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], a), max(lo_hi[1], b)
        return [self.flat[dt][a:b] for dt, (a, b) in span.items()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())


# -- optimizer offload ------------------------------------------------------------------------------

_DEVICE_PATHS = ("fused", "foreach", "capturable")
_HOST_PATHS = {"fused": None, "foreach": None, "capturable": False}


class HostOptimizer:
    """The session optimizer's state and step moved to the host (ZeRO-Offload style).

    Holds a host master copy of every parameter whose ``grad`` is a view of
    the reduced host gradient buffer; a step updates the masters on the host
    and copies them into the device parameters. The device optimizer's
    ``state`` entries point at the host state, so checkpoints taken meanwhile
    see it; :meth:`restore` moves state back when offload is removed.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[nn.Parameter],
        grads: Sequence[torch.Tensor],
        pin: bool,
    ):
        self.device_opt = optimizer
        self.params = list(params)
        self.masters: list[torch.Tensor] = []
        master_of: dict[int, torch.Tensor] = {}
        for p, g in zip(self.params, grads, strict=True):
            m = torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
            m.copy_(p.detach())
            m.requires_grad_(True)
            m.grad = g
            self.masters.append(m)
            master_of[id(p)] = m
        missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in master_of]
        if missing:
            raise PluginError(
                "cgdp: offload_optimizer needs every optimizer parameter to be a trainable "
                f"model parameter ({len(missing)} are not)"
            )
        # Device-specific fast paths do not apply on the host; remember the device's settings.
        self._device_paths = [
            {k: g[k] for k in _DEVICE_PATHS if k in g} for g in optimizer.param_groups
        ]
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [master_of[id(p)] for p in g["params"]],
            }
            for g in optimizer.param_groups
        ]
        try:
            self.host_opt = type(optimizer)(groups)
            self.host_opt.load_state_dict(optimizer.state_dict())  # casts state to the host
        except (TypeError, ValueError, RuntimeError) as exc:
            raise PluginError(
                f"cgdp: cannot rebuild {type(optimizer).__name__} on the host for offload_optimizer: {exc}"
            ) from exc
        for g in self.host_opt.param_groups:
            for k, v in _HOST_PATHS.items():
                if k in g:
                    g[k] = v
        optimizer.state.clear()  # frees the device copies of the state
        self._link_state()

    def _link_state(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            st = self.host_opt.state.get(m)
            if st:
                self.device_opt.state[p] = st

    def step(self) -> None:
        # Hyperparameters follow the device optimizer (Session.set_lr, schedulers).
        for dg, hg in zip(self.device_opt.param_groups, self.host_opt.param_groups, strict=True):
            for k, v in dg.items():
                if k != "params" and k not in _HOST_PATHS:
                    hg[k] = v
        self.host_opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m, non_blocking=p.device.type == "cuda" and m.is_pinned())
        self._link_state()

    def regrad(self, grads: Sequence[torch.Tensor]) -> None:
        """Point the masters' gradients at new host views (after the buffers were rebuilt)."""
        for m, g in zip(self.masters, grads, strict=True):
            m.grad = g

    @property
    def state_bytes(self) -> int:
        return sum(
            v.numel() * v.element_size()
            for st in self.host_opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )

    @property
    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters)

    def restore(self) -> None:
        """Move the state back to the device optimizer (the masters equal the parameters)."""
        state = self.host_opt.state_dict()
        self.device_opt.state.clear()
        self.device_opt.load_state_dict(state)  # casts state to each parameter's device
        for g, paths in zip(self.device_opt.param_groups, self._device_paths, strict=True):
            g.update(paths)


# -- the executor -------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    first: int
    """Index of its first parameter (backward order)."""
    last: int
    """One past its last parameter."""
    nbytes: int
    slices: list[torch.Tensor] = field(default_factory=list)


class CgdpSync(HookedAccumulation, GradSync):
    """CPU-GPU data parallel gradient synchronisation (Le et al.), one chunk at a time.

    ``chunk_size`` is the paper's ``k`` (layers per chunk; the last layers of
    backward are singletons); with ``chunk_by="blocks"`` it counts whole
    transformer blocks instead (layers outside the blocks count one each), so
    no chunk ends inside a block. ``offload_optimizer`` keeps the optimizer's
    state and step on the host. Change ``k`` at a step boundary with
    :meth:`set_chunk_size`.
    """

    name = "cgdp"

    def __init__(
        self, chunk_size: int = 1, offload_optimizer: bool = False, chunk_by: str = "layers"
    ):
        if chunk_size < 1:
            raise PluginError(f"cgdp: chunk_size must be at least 1, not {chunk_size}")
        if chunk_by not in CHUNK_BY:
            raise PluginError(
                f"cgdp: chunk_by must be one of {', '.join(CHUNK_BY)}, not {chunk_by!r}"
            )
        self.chunk_size = int(chunk_size)
        self.chunk_by = chunk_by
        self.offload_optimizer = offload_optimizer
        # Every chunk is reduced before the one update (Session.optimizer_step: unscale,
        # clip by the global norm, step, schedule). With offload the update runs on the
        # host's copy, where fp16's GradScaler (tied to the device optimizer) cannot see it.
        # Checkpointing (tested against DDP): a recomputed block's gradients reach the chunk
        # hooks as any other's.
        self.handles = (ALL_FEATURES - {"grad_scaler"} if offload_optimizer else ALL_FEATURES) | {
            "checkpointed"
        }
        self._accumulating = False
        self._records: list[CommRecord] = []
        self._handles: list[Any] = []
        self._offload: HostOptimizer | None = None
        self._thread: threading.Thread | None = None
        self.hook_s = 0.0
        """Time the last step spent launching chunks on the backward thread (its sum of t_as)."""

    # -- install / remove ---------------------------------------------------------------

    def attach(self, session: Session) -> None:
        super().attach(session)
        self.world = session.world_size
        self.device = session.device
        self.cuda = self.device.type == "cuda"
        self._group = host_group(session.group) if self.world > 1 else None
        self.layers = list(reversed(parameterised_layers(session.model)))  # backward order
        if not self.layers:
            raise PluginError("cgdp: the model has no trainable parameters")
        self._order_checked = False
        self._build()
        self._set_layout(self.chunk_size)
        self._buffers_to_sync = list(session.model.buffers())
        self._broadcast_module_state()
        try:
            if self.offload_optimizer:
                self._offload = HostOptimizer(
                    session.optimizer, self.params, self._grad_views(), pin=self.cuda
                )
            if self.cuda:
                self._d2h = torch.cuda.Stream(self.device)
                self._h2d = torch.cuda.Stream(self.device)
                self._queue: queue.Queue = queue.Queue()
                self._thread = threading.Thread(
                    target=self._comm_loop, name="cgdp-comm", daemon=True
                )
                self._thread.start()
            self._register_hooks()
        except BaseException:
            self.detach()  # leave the model as it was
            raise
        self._new_iteration()

    def _register_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
            for i, p in enumerate(self.params)
        ]

    def _build(self) -> None:
        """Parameters in backward order, their layers, and the host buffers."""
        self.params = [p for layer in self.layers for p in layer.params]
        self.layer_of = [li for li, layer in enumerate(self.layers) for _ in layer.params]
        self.buffers = HostBuffers(self.params, pin=self.cuda)
        self._views = [self.buffers.view(i, p.shape) for i, p in enumerate(self.params)]

    def _grad_views(self) -> list[torch.Tensor]:
        return list(self._views)

    def detach(self) -> None:
        self.flush()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._offload is not None:
            self._offload.restore()
            self._offload = None

    # -- layout ---------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Units the chunk size counts: layers, or with ``chunk_by="blocks"`` blocks and the
        layers outside them."""
        units = self.units()
        return len(self.layers) if units is None else len(set(units))

    def units(self) -> list[str] | None:
        """Each layer's unit in forward order when chunking by blocks (None: by layers)."""
        if self.chunk_by != "blocks":
            return None
        forward = [(layer.name, layer.kind) for layer in reversed(self.layers)]
        units = block_units(forward)
        # A model without transformer blocks: every layer is its own unit (chunks of layers).
        return units if units is not None else [name for name, _ in forward]

    def set_chunk_size(self, k: int) -> None:
        """Use chunks of ``k`` layers from the next iteration (call at a step boundary)."""
        if k < 1:
            raise PluginError(f"cgdp: chunk_size must be at least 1, not {k}")
        self.flush()
        self.chunk_size = int(k)
        self._set_layout(self.chunk_size)
        self._new_iteration()

    def _set_layout(self, k: int) -> None:
        n = len(self.layers)
        first_param = [0]
        for layer in self.layers:
            first_param.append(first_param[-1] + len(layer.params))
        self.chunks: list[_Chunk] = []
        self.chunk_of = [0] * len(self.params)
        units = self.units()
        layout = chunk_layout(n, k) if units is None else unit_layout(units, k)
        for ci, members in enumerate(layout):
            lo, hi = n - members[0], n - members[-1]  # paper layer l is index 0
            first, last = first_param[lo], first_param[hi + 1]
            for i in range(first, last):
                self.chunk_of[i] = ci
            nbytes = sum(p.numel() * p.element_size() for p in self.params[first:last])
            self.chunks.append(_Chunk(first, last, nbytes, self.buffers.slices(first, last)))

    def layout(self) -> list[list[str]]:
        """Layer names per chunk, in backward order."""
        return [
            [
                self.layers[li].name
                for li in range(self.layer_of[c.first], self.layer_of[c.last - 1] + 1)
            ]
            for c in self.chunks
        ]

    # -- per iteration ---------------------------------------------------------------------------

    def _new_iteration(self) -> None:
        """Counters and bookkeeping reset every iteration."""
        self._arrived = [False] * len(self.params)
        self._left = [c.last - c.first for c in self.chunks]
        self._layer_left = [len(layer.params) for layer in self.layers]
        self._layer_done_order: list[int] = []
        self._next_post = 0
        self._posted_at: list[float | None] = [None] * len(self.chunks)
        self._done_at: list[float | None] = [None] * len(self.chunks)
        self._futures: list[Any] = [None] * len(self.chunks)
        self._events: list[threading.Event] = (
            [threading.Event() for _ in self.chunks] if self.cuda else []
        )
        self._back: list[Any] = [None] * len(self.chunks)
        self._error: BaseException | None = None
        self._hook_s = 0.0

    def _broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank, one collective per dtype."""
        if self.world <= 1 or not tensors:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for t in tensors:
            by_dtype[t.dtype].append(t)
        group = self.session.group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for same in by_dtype.values():
                flat = torch._utils._flatten_dense_tensors(same)
                dist.broadcast(flat, src=src, group=group)
                for t, v in zip(
                    same, torch._utils._unflatten_dense_tensors(flat, same), strict=True
                ):
                    t.copy_(v)

    def _broadcast_module_state(self) -> None:
        """Like DDP at construction (and the paper's Step T-5): start from rank 0's replica."""
        self._broadcast(
            [p.detach() for p in self.session.model.parameters()] + self._buffers_to_sync
        )

    def before_forward(self) -> None:
        # DDP's default broadcast_buffers: every rank runs with rank 0's buffers.
        self._broadcast(self._buffers_to_sync)

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        if self._accumulating:
            return
        if self._arrived[i]:
            raise RuntimeError(
                "cgdp: a gradient was accumulated twice before the optimizer step "
                "(accumulate micro-batches inside Session's accumulating() context)"
            )
        self._arrived[i] = True
        li = self.layer_of[i]
        self._layer_left[li] -= 1
        if self._layer_left[li] == 0:
            self._layer_done_order.append(li)
        c = self.chunk_of[i]
        self._left[c] -= 1
        if self._left[c] == 0:
            self._post_ready()

    def _post_ready(self) -> None:
        """Post complete chunks in layout order, so every rank issues the same collectives."""
        while self._next_post < len(self.chunks) and self._left[self._next_post] == 0:
            self._post(self._next_post)
            self._next_post += 1

    def _post(self, ci: int) -> None:
        t0 = time.perf_counter()
        chunk = self.chunks[ci]
        if self.cuda:
            self._post_cuda(ci, chunk)
        else:
            self._post_cpu(ci, chunk)
        self._hook_s += time.perf_counter() - t0

    # CPU: plain copies; gloo's async all-reduce; copy back in its callback.

    def _post_cpu(self, ci: int, chunk: _Chunk) -> None:
        for i in range(chunk.first, chunk.last):
            p = self.params[i]
            view = self._views[i]
            if p.grad is None:
                view.zero_()  # unused on this rank: contributes nothing
            else:
                view.copy_(p.grad)
        self._posted_at[ci] = time.perf_counter()
        if self._group is None:
            fut = torch.futures.Future()
            fut.set_result(None)
        else:
            futs = [
                dist.all_reduce(s, group=self._group, async_op=True).get_future()
                for s in chunk.slices
            ]
            fut = futs[0] if len(futs) == 1 else torch.futures.collect_all(futs)
        self._futures[ci] = fut.then(functools.partial(self._finish_cpu, ci))

    def _finish_cpu(self, ci: int, fut: torch.futures.Future) -> None:
        value = fut.value()  # re-raises a failed all-reduce
        for f in value if isinstance(value, list) else ():
            if isinstance(f, torch.futures.Future):
                f.value()  # one per dtype slice (collect_all)
        chunk = self.chunks[ci]
        if self._offload is not None:
            for s in chunk.slices:
                s.div_(self.world)
        else:
            self._copy_back(chunk)
        self._done_at[ci] = time.perf_counter()

    def _copy_back(self, chunk: _Chunk) -> None:
        for i in range(chunk.first, chunk.last):
            p = self.params[i]
            view = self._views[i]
            if p.grad is None:
                if bool(view.any()):  # another rank used it: every rank takes the average
                    p.grad = (view / self.world).to(p.device)
            elif p.grad.is_contiguous():
                torch.div(view, self.world, out=p.grad)
            else:
                p.grad.copy_(view).div_(self.world)

    # GPU: D2H on a side stream; the communication thread reduces and copies back on an H2D stream.

    def _post_cuda(self, ci: int, chunk: _Chunk) -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._d2h.wait_event(ready)
        missing = []
        with torch.cuda.stream(self._d2h):
            for i in range(chunk.first, chunk.last):
                p = self.params[i]
                view = self._views[i]
                if p.grad is None:
                    missing.append(i)  # zeroed by the thread, once earlier H2D reads are done
                    continue
                view.copy_(p.grad, non_blocking=True)
                if self._offload is not None:
                    # The gradient lives on in the host buffer: free the device copy now.
                    p.grad.record_stream(self._d2h)
                    p.grad = None
        copied = torch.cuda.Event()
        copied.record(self._d2h)
        self._posted_at[ci] = time.perf_counter()
        self._queue.put((ci, copied, missing))

    def _comm_loop(self) -> None:
        with torch.cuda.device(self.device):
            while True:
                item = self._queue.get()
                if item is None:
                    return
                ci, copied, missing = item
                try:
                    copied.synchronize()
                    for i in missing:
                        self._views[i].zero_()
                    chunk = self.chunks[ci]
                    if self._group is not None:
                        for s in chunk.slices:
                            dist.all_reduce(s, group=self._group)
                    for s in chunk.slices:
                        s.div_(self.world)
                    if self._offload is None:
                        with torch.cuda.stream(self._h2d):
                            for i in range(chunk.first, chunk.last):
                                p = self.params[i]
                                view = self._views[i]
                                if p.grad is None:
                                    if bool(view.any()):
                                        p.grad = view.to(p.device, non_blocking=True)
                                else:
                                    p.grad.copy_(view, non_blocking=True)
                        back = torch.cuda.Event()
                        back.record(self._h2d)
                        self._back[ci] = back
                except BaseException as exc:  # surfaced on the training thread in step()
                    self._error = exc
                self._done_at[ci] = time.perf_counter()
                self._events[ci].set()

    # -- step ---------------------------------------------------------------------------------------

    def _finish_posting(self) -> None:
        """Chunks with a gradient no rank produced this step are posted now, still in order."""
        for c in range(self._next_post, len(self.chunks)):
            self._left[c] = 0
        self._post_ready()

    def _wait_all(self, records: bool) -> None:
        for ci in range(len(self.chunks)):
            if self._posted_at[ci] is None:
                continue
            t0 = time.perf_counter()
            if self.cuda:
                self._events[ci].wait()
                if self._error is not None:
                    err, self._error = self._error, None
                    raise RuntimeError(f"cgdp: host reduction failed: {err}") from err
                if self._back[ci] is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._back[ci])
            else:
                self._futures[ci].wait()
            blocked = time.perf_counter() - t0
            if records:
                own = (self._done_at[ci] or time.perf_counter()) - self._posted_at[ci]
                self._records.append(CommRecord(f"chunk{ci}", self.chunks[ci].nbytes, own, blocked))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self._finish_posting()
        self.hook_s = self._hook_s
        self._wait_all(records=True)
        if self._offload is not None:
            self._offload_step()
        else:
            self.session.optimizer_step(optimizer)
        if not self._order_checked:
            self._adopt_observed_order()
        self._new_iteration()

    def _offload_step(self) -> None:
        """The host update with the workload's clipping (over every reduced host gradient)
        and its scheduler, as ``Session.optimizer_step`` does on the device."""
        clip = self.session.workload.clip_grad_norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self._offload.masters, clip, foreach=None)
        self._offload.step()
        if self.session.scheduler is not None:
            self.session.scheduler.step()

    def _adopt_observed_order(self) -> None:
        """After the first iteration, order layers as backward really finished them (rank 0's order).

        Registration order is only a guess at backward order; like DDP's
        bucket rebuild, the layout follows the observed order from then on.
        """
        self._order_checked = True
        observed = self._layer_done_order + [
            li for li in range(len(self.layers)) if li not in set(self._layer_done_order)
        ]
        if self._group is not None:
            observed = broadcast_object(
                observed, src=dist.get_global_rank(self._group, 0), group=self._group
            )
        if observed == list(range(len(self.layers))):
            return
        self.layers = [self.layers[li] for li in observed]
        old_params = self.params
        self._build()
        if self._offload is not None:
            # Masters follow their parameters into the new order.
            pos = {id(p): i for i, p in enumerate(old_params)}
            off = self._offload
            off.params = self.params
            off.masters = [off.masters[pos[id(p)]] for p in self.params]
            off.regrad(self._grad_views())
        self._register_hooks()
        self._set_layout(self.chunk_size)

    def flush(self) -> None:
        """Wait for every posted reduction (nothing is stepped)."""
        if hasattr(self, "_posted_at"):  # attached
            self._wait_all(records=False)

    def comm_records(self) -> list[CommRecord]:
        out, self._records = self._records, []
        return out

    # -- reporting ------------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, Any]:
        """Host bytes CGDP holds, and the device bytes offload moved off the device."""
        report: dict[str, Any] = {
            "host_gradient_buffer_bytes": self.buffers.nbytes,
            "pinned": self.buffers.pin,
            "chunks": len(self.chunks),
        }
        if self._offload is not None:
            report["host_master_param_bytes"] = self._offload.master_bytes
            report["host_optimizer_state_bytes"] = self._offload.state_bytes
            report["device_bytes_saved"] = self._offload.state_bytes + (
                self.buffers.nbytes if self.cuda else 0
            )
        if self.cuda:
            report["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report


SHARDED_WHY = (
    "does not apply: the job is sharded (FSDP), whose parameters and gradients are DTensor "
    "shards reduce-scattered by FSDP per block; CGDP's chunked all-reduce and host optimizer "
    "need every rank to hold whole gradients (a config of this tuner is refused on a sharded job)"
)


def declines(knobs: dict[str, Any], features: frozenset[str]) -> str | None:
    """Why a config cannot train a job using ``features`` ("does not apply: ..."), or None."""
    from tunekit.api import declined_features

    if not knobs.get("offload_optimizer"):
        return None
    return declined_features(
        features,
        ALL_FEATURES - {"grad_scaler"},
        {"grad_scaler": "the device optimizer's GradScaler to see the gradients, which "
         "offload_optimizer keeps on the host"},
    )  # fmt: skip


# -- the in-job search -----------------------------------------------------------------------------------


def search_in_job(session: Session, sync: CgdpSync, searcher, max_steps: int) -> SearchResult:
    """Drive a chunk-size search (:class:`~tunekit.plugins.cgdp.search.Algorithm1` or
    :class:`~tunekit.plugins.cgdp.search.NoiseAwareChunkSearch`) inside the running job.

    Rank 0 times each interval and decides; every rank trains with the chunk
    size rank 0 broadcasts. Stops when the searcher is done or when another
    interval would pass ``max_steps``, and leaves the best chunk installed.
    """
    group = sync._group
    src = dist.get_global_rank(group, 0) if group is not None else 0
    leader = session.rank == 0
    trace: list[dict[str, Any]] = []
    steps = 0
    while steps + searcher.interval <= max_steps:
        chunk = broadcast_object(searcher.next_chunk() if leader else None, src=src, group=group)
        if chunk is None:
            break
        sync.set_chunk_size(chunk)
        t0 = time.perf_counter()
        times = [session.train_step().step_s for _ in range(searcher.interval)]
        lapse = time.perf_counter() - t0
        steps += searcher.interval
        if leader:
            searcher.record(times, lapse)
            rec = searcher.history[-1]
            trace.append(
                {
                    "knobs": {"chunk_size": chunk},
                    "steps": searcher.interval,
                    "time_s": lapse,
                    "median_step_s": sorted(times)[len(times) // 2],
                    "interval": rec.interval,
                    "action": rec.action,
                    "best_chunk": rec.best_chunk,
                }
            )
    done, best = broadcast_object(
        [searcher.done, searcher.best_chunk] if leader else None, src=src, group=group
    )
    sync.set_chunk_size(best)
    trace = broadcast_object(trace if leader else None, src=src, group=group)
    how = "finished" if done else f"ran out of steps ({max_steps})"
    return SearchResult(
        knobs={"chunk_size": best},
        trace=trace,
        summary=(
            f"{searcher.name} {how} after {len(trace)} intervals of {searcher.interval} "
            f"iterations: chunk size {best} of {sync.num_layers} layers"
        ),
    )
