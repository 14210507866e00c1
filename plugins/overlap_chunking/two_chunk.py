"""The two-chunk gradient reducer of Lee et al. (Algorithm 2), as a :class:`GradSync`.

Per step, on every rank:

* forward: before each replicated fully-connected layer runs, its deferred
  update from the previous step lands (Algorithm 2, lines 7-9), then an
  all-gather of its input activations is posted (line 12);
* backward: post-accumulate-grad hooks count the gradients of each chunk; chunk
  1 (the last k layers) is all-reduced asynchronously the moment backprop has
  passed them (line 19), chunk 2 when backprop is done (line 20); the replicated
  layers compute no local weight gradient (their weights stop requiring grad),
  a hook on their output keeps the local errors instead;
* :meth:`TwoChunkSync.step`: wait for chunk 1 and update its parameters while
  chunk 2 is still in flight (lines 21-23); wait for chunk 2, post the
  all-gathers of the replicated layers' errors (lines 24-26), update chunk 2.

Torch optimizers skip parameters whose ``.grad`` is None, so a subset is stepped
by hiding the other gradients for the call (:func:`step_subset`); per-parameter
optimizer state (momentum, Adam moments, step counts) then evolves exactly as
with one step over all parameters.

Every communication is timed: ``T_c`` from posting to completion (a callback on
the work's future) and ``T_b`` the time this rank spent in ``wait()`` on it.
On NCCL the completion callback is a host-side approximation.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tunekit.api import ALL_FEATURES, CommRecord, GradSync, HookedAccumulation
from tunekit.errors import ConfigError
from tunekit.plugins.overlap_chunking.model import PIECE_BYTES

if TYPE_CHECKING:
    from tunekit.api import Session


def step_subset(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """``optimizer.step()`` for ``params`` only: other parameters' gradients are hidden for the call."""
    keep = {id(p) for p in params}
    hidden = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in keep and p.grad is not None:
                hidden.append((p, p.grad))
                p.grad = None
    try:
        optimizer.step()
    finally:
        for p, grad in hidden:
            p.grad = grad


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


class _Comm:
    """One posted communication (possibly in several pieces) and its timings."""

    def __init__(self, name: str, nbytes: int, post: Callable[[], list[dist.Work]]):
        self.name = name
        self.nbytes = nbytes
        self.blocked: float | None = None
        self.done: float | None = None
        self.posted = time.perf_counter()
        self.works = post()
        futures = [w.get_future() for w in self.works]
        torch.futures.collect_all(futures).then(self._mark_done)

    def _mark_done(self, _fut) -> None:
        self.done = time.perf_counter()

    def wait(self) -> None:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        end = time.perf_counter()
        self.blocked = end - start
        # The completion callback may run a moment after wait() returns.
        self.done = end if self.done is None else min(self.done, end)

    def record(self) -> CommRecord:
        return CommRecord(self.name, self.nbytes, self.done - self.posted, self.blocked)


@dataclass
class _Chunk:
    name: str
    params: list[nn.Parameter]
    ready: int = 0
    comm: _Comm | None = None
    flat: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        return self.ready >= len(self.params)


@dataclass
class _Replicated:
    """A fully-connected layer whose weight gradient is computed from gathered data."""

    name: str
    module: nn.Linear
    params: list[nn.Parameter]
    requires_grad: list[bool]
    acts: tuple[torch.Tensor, _Comm] | None = None
    """This step's gathered input activations (buffer, communication)."""
    errors: torch.Tensor | None = None
    """This step's local output errors, kept until the gather is posted."""
    pending: tuple[tuple[torch.Tensor, _Comm], tuple[torch.Tensor, _Comm]] | None = None
    """The previous step's (activations, errors) gathers: the deferred update."""
    handles: list = field(default_factory=list)


class TwoChunkSync(HookedAccumulation, GradSync):
    """Lee et al.'s two gradient chunks, with replicated fully-connected gradients.

    ``chunk1`` names the parameters reduced first (the last k layers, from
    :func:`~tunekit.plugins.overlap_chunking.layers.chunk_plan`); every other
    parameter that requires grad, except those of the ``replicated`` Linear
    modules, forms chunk 2. A chunk is posted at once as all-reduces of pieces
    of at most ``piece_bytes`` (see :data:`PIECE_BYTES`).
    """

    name = "two_chunk"

    def __init__(
        self,
        chunk1: Sequence[str],
        replicated: Sequence[str] = (),
        label: str = "",
        piece_bytes: int = PIECE_BYTES,
    ):
        self.chunk1_names = tuple(chunk1)
        self.piece_bytes = piece_bytes
        self.replicated_names = tuple(replicated)
        self.label = label
        self._records: list[CommRecord] = []
        self._handles: list = []
        self._chunks: list[_Chunk] = []
        self._fcs: list[_Replicated] = []
        self._next_post = 0
        self._optimizer: torch.optim.Optimizer | None = None
        self._accumulating = False
        # Without replicated layers every chunk is reduced before the step ends, so each
        # training feature holds (see step()). A replicated layer's update is deferred to
        # its next forward, from one micro-batch's gathered data: it would miss the other
        # micro-batches, the global norm, the loss scale's inf check and this step's lr.
        # Checkpointing (tested against DDP): the chunks' hooks fire once per gradient, recomputed
        # or not; a replicated layer's forward hook would fire again in a recomputation.
        self.handles = ALL_FEATURES | {"checkpointed"} if not self.replicated_names else frozenset()

    # -- install -------------------------------------------------------------------------

    def attach(self, session: Session) -> None:
        super().attach(session)
        if isinstance(session.optimizer, torch.optim.LBFGS):
            raise ConfigError(
                "overlap_chunking two_chunk: LBFGS needs a closure over all parameters; "
                "use mode ddp_buckets"
            )
        self.group = session.group
        self.world = dist.get_world_size(self.group)
        model = session.model
        # Every name of a tied parameter (a GPT head sharing the embedding's weight) resolves.
        named_all = dict(model.named_parameters(remove_duplicate=False))
        named = dict(model.named_parameters())
        missing = [n for n in self.chunk1_names if n not in named_all]
        if missing:
            raise ConfigError(
                f"overlap_chunking two_chunk: the model has no parameter {missing[0]!r}"
            )
        modules = dict(model.named_modules())
        for name in self.replicated_names:  # check all before changing anything
            if not isinstance(modules.get(name), nn.Linear):
                raise ConfigError(
                    f"overlap_chunking two_chunk: {name!r} is not an nn.Linear; only "
                    "fully-connected layers can replicate their gradient"
                )
        self._fcs = [self._replicate(name, modules[name]) for name in self.replicated_names]
        replicated = {id(p) for fc in self._fcs for p in fc.params}
        first = {id(named_all[n]) for n in self.chunk1_names}
        trained = [p for p in named.values() if p.requires_grad and id(p) not in replicated]
        chunks = [
            _Chunk("chunk1", [p for p in trained if id(p) in first]),
            _Chunk("chunk2", [p for p in trained if id(p) not in first]),
        ]
        self._chunks = [c for c in chunks if c.params]
        for index, chunk in enumerate(self._chunks):
            for p in chunk.params:
                hook = functools.partial(self._grad_ready, index)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
        # DDP broadcasts rank 0's buffers (BatchNorm statistics) before each
        # forward; doing the same keeps a switch between the two exact.
        self._buffers = [b for b in model.buffers()]

    def _replicate(self, name: str, module: nn.Linear) -> _Replicated:
        params = [p for p in (module.weight, module.bias) if p is not None]
        fc = _Replicated(name, module, params, [p.requires_grad for p in params])
        for p in params:
            # No local weight gradient: every rank computes the full-batch one itself.
            p.requires_grad_(False)
        fc.handles = [
            module.register_forward_pre_hook(functools.partial(self._fc_pre_forward, fc)),
            module.register_forward_hook(functools.partial(self._fc_forward, fc)),
        ]
        return fc

    # -- forward -------------------------------------------------------------------------

    def before_forward(self) -> None:
        if not self._buffers or self.world == 1:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buf in self._buffers:
            by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = _flatten_dense_tensors(bufs)
            dist.broadcast(flat, src=src, group=self.group)
            for buf, synced in zip(bufs, _unflatten_dense_tensors(flat, bufs), strict=True):
                buf.copy_(synced)

    def _fc_pre_forward(self, fc: _Replicated, _module, args):
        self._apply_deferred(fc)  # the update must land before the layer's next forward
        if not torch.is_grad_enabled():
            return None
        if fc.acts is not None:
            raise ConfigError(
                f"overlap_chunking two_chunk: {fc.name} runs more than once per step; "
                "its gradient cannot be replicated (lower f)"
            )
        x = args[0]
        # A copy: the gather reads it while forward goes on, and nothing may change it.
        acts = x.detach().reshape(-1, fc.module.in_features).clone()
        out = acts.new_empty((self.world * acts.shape[0], acts.shape[1]))
        comm = _Comm(
            f"gather_{fc.name}_acts",
            out.numel() * out.element_size(),
            lambda: [_all_gather(out, acts, self.group)],
        )
        fc.acts = (out, comm)
        if not x.requires_grad:
            # The model's first layer: without a gradient path there would be
            # no output errors to gather.
            return (x.detach().requires_grad_(), *args[1:])
        return None

    def _fc_forward(self, fc: _Replicated, _module, _args, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._keep_errors, fc))

    def _keep_errors(self, fc: _Replicated, grad: torch.Tensor) -> None:
        fc.errors = grad.detach().reshape(-1, fc.module.out_features).contiguous()

    # -- backward ------------------------------------------------------------------------

    def _grad_ready(self, index: int, _param) -> None:
        if self._accumulating:
            return
        self._chunks[index].ready += 1
        self._post_complete_chunks()

    def _post_complete_chunks(self) -> None:
        # Chunks are posted in order, so every rank posts collectives in the same order.
        while self._next_post < len(self._chunks) and self._chunks[self._next_post].complete:
            chunk = self._chunks[self._next_post]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in chunk.params]
            chunk.flat = torch.cat([g.reshape(-1) for g in grads])
            flat = chunk.flat
            pieces = flat.split(max(1, self.piece_bytes // flat.element_size()))
            chunk.comm = _Comm(
                chunk.name,
                flat.numel() * flat.element_size(),
                lambda pieces=pieces: [
                    dist.all_reduce(piece, group=self.group, async_op=True) for piece in pieces
                ],
            )
            self._next_post += 1

    # -- update --------------------------------------------------------------------------

    def whole_update(self) -> bool:
        """Whether this step must see every chunk before updating any: clipping by the
        global norm and fp16's loss-scale inf check need the whole gradient."""
        session = self.session
        return session.workload.clip_grad_norm is not None or session.scaler is not None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        for chunk in self._chunks:
            chunk.ready = len(chunk.params)  # a parameter without a gradient reduces zeros
        self._post_complete_chunks()
        whole = self.whole_update()
        for index, chunk in enumerate(self._chunks):
            chunk.comm.wait()
            chunk.flat.div_(self.world)
            offset = 0
            for p in chunk.params:
                p.grad = chunk.flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            if index == len(self._chunks) - 1:
                self._post_error_gathers()
            if not whole:
                # Chunk 1's layers are updated while chunk 2 is still in flight.
                step_subset(optimizer, chunk.params)
            self._records.append(chunk.comm.record())
            chunk.ready, chunk.comm, chunk.flat = 0, None, None
        if not self._chunks:
            self._post_error_gathers()
        self._next_post = 0
        if whole:
            # One update once every chunk is in: unscale, clip by the global norm, skip on
            # inf, step, schedule (the overlap of chunk 1's update with chunk 2 is lost).
            self.session.optimizer_step(optimizer)
        elif self.session.scheduler is not None:
            self.session.scheduler.step()  # once per optimizer step, after every chunk's

    def _post_error_gathers(self) -> None:
        for fc in self._fcs:
            if fc.acts is None or fc.errors is None:
                fc.acts = fc.errors = None
                continue
            errors = fc.errors
            out = errors.new_empty((self.world * errors.shape[0], errors.shape[1]))
            comm = _Comm(
                f"gather_{fc.name}_errors",
                out.numel() * out.element_size(),
                lambda out=out, errors=errors: [_all_gather(out, errors, self.group)],
            )
            fc.pending = (fc.acts, (out, comm))
            fc.acts = fc.errors = None

    def _apply_deferred(self, fc: _Replicated) -> None:
        """The full-batch gradient of a replicated layer from gathered data, and its update."""
        if fc.pending is None:
            return
        (acts, acts_comm), (errors, errors_comm) = fc.pending
        fc.pending = None
        acts_comm.wait()
        errors_comm.wait()
        self._records += [acts_comm.record(), errors_comm.record()]
        # Each rank's errors are those of its own mean loss, so the sum over the
        # gathered rows divided by the world size is DDP's averaged gradient.
        weight = fc.module.weight
        weight.grad = (errors.t() @ acts).div_(self.world).view_as(weight)
        if fc.module.bias is not None:
            fc.module.bias.grad = errors.sum(0).div_(self.world)
        step_subset(self._optimizer, fc.params)
        for p in fc.params:
            p.grad = None

    # -- lifecycle -----------------------------------------------------------------------

    def flush(self) -> None:
        for fc in self._fcs:
            self._apply_deferred(fc)

    def detach(self) -> None:
        self.flush()
        for handle in self._handles:
            handle.remove()
        for fc in self._fcs:
            for handle in fc.handles:
                handle.remove()
            for p, flag in zip(fc.params, fc.requires_grad, strict=True):
                p.requires_grad_(flag)
        self._handles, self._fcs, self._chunks = [], [], []

    def comm_records(self) -> list[CommRecord]:
        out, self._records = self._records, []
        return out
