"""Gradient synchronisation strategies: how a step's gradients become global.

A :class:`GradSync` is installed in a worker's :class:`Session` (by default
:class:`DDPSync` with PyTorch's own defaults, or :class:`LocalSync` on one
rank); ``grad_sync`` tuners install their own. The training loop drives it::

    sync.before_forward()
    loss = workload.loss(sync.module(inputs), targets)
    loss.backward()
    sync.step(optimizer)      # wait for reductions, update parameters
    optimizer.zero_grad(set_to_none=True)

Each strategy can report, per communication, its own time ``T_c`` and the time
the rank was blocked waiting on it ``T_b`` (Lee et al., Eq. 11's inputs).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from tunekit.runtime.session import Session


@dataclass
class CommRecord:
    """One communication of one step, as this rank saw it."""

    name: str
    """What was communicated (``bucket3``, ``chunk1``, ``gather_fc1_acts``)."""
    nbytes: int
    own_s: float
    """T_c: from posting the communication to its completion."""
    blocked_s: float
    """T_b: how long this rank waited for it (0 when fully hidden)."""


def overlap_ratio(records: list[CommRecord]) -> float | None:
    """Lee et al. Eq. 11: R = 100 * sum(T_c - T_b) / sum(T_c); None without communication."""
    total = sum(r.own_s for r in records)
    if total <= 0:
        return None
    # Clamped: rounding, and timestamps taken on different threads, can put a
    # fully hidden or fully exposed communication a hair outside [0, 100].
    return min(100.0, max(0.0, 100.0 * sum(r.own_s - r.blocked_s for r in records) / total))


ALL_FEATURES = frozenset({"amp", "grad_scaler", "accumulation", "scheduler", "clipping"})
"""The workload's training features (``Workload.features``)."""

LAYOUT_FEATURES = frozenset({"sharded", "checkpointed"})
"""How the model is laid out (``tunekit.layout.Layout``), also in ``Workload.features``:
``sharded`` (FSDP holds parameters, gradients and optimizer state in shards) and
``checkpointed`` (some blocks recompute their forward in backward). A strategy lists the
ones it works with in ``handles``, as it lists training features."""


def declined_features(
    features: frozenset[str], handles: frozenset[str], needs: dict[str, str]
) -> str | None:
    """A diagnosis line for a job using features a tuner cannot honour, or None.

    ``needs`` says per feature what honouring it would take: "does not apply: clipping
    needs the whole gradient before any update; ..." (one clause per feature)."""
    missing = sorted(set(features) - set(handles))
    if not missing:
        return None
    return "does not apply: " + "; ".join(
        f"{f} needs {needs.get(f, 'what this tuner does not do')}" for f in missing
    )


class GradSync:
    """Base strategy: no communication (one rank, or a strategy-free session)."""

    name = "local"
    handles: frozenset[str] = frozenset()
    """Training features (:data:`ALL_FEATURES`) this strategy honours. A session refuses
    to install a strategy on a job using a feature it does not list, rather than train
    with other arithmetic. A strategy that reduces the whole gradient and then calls
    ``session.optimizer_step`` once per step honours them all; one that updates in
    pieces (per chunk) must handle each feature itself before it lists it."""

    def attach(self, session: Session) -> None:
        """Install on ``session``: wrap its model, register hooks."""
        self.session = session

    @property
    def module(self) -> nn.Module:
        """The module the loop calls forward on."""
        return self.session.model

    def before_forward(self) -> None:
        """Called before each forward pass (deferred updates land here)."""

    def accumulating(self):
        """Context for the backward of a micro-batch that is not the step's last: gradients
        only accumulate (DDP: ``no_sync``)."""
        return contextlib.nullcontext()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``backward()``: wait for this step's reductions and update parameters."""
        self.session.optimizer_step(optimizer)

    def flush(self) -> None:
        """Finish deferred work (before a checkpoint, a config change, the end)."""

    def detach(self) -> None:
        """Remove everything :meth:`attach` installed; the model is left unwrapped."""

    def comm_records(self) -> list[CommRecord]:
        """Communications since the last call (then forgotten)."""
        return []

    def resident_bytes(self) -> float | None:
        """Bytes this strategy holds between steps (its buffers), for the session's count of
        what a rank holds; None (the default) when it does not say, and the count is not made."""
        return None


class HookedAccumulation:
    """``accumulating()`` for a strategy whose gradient hooks post communication: inside it,
    ``self._accumulating`` tells the hooks a micro-batch before the step's last is running, so
    gradients only accumulate in ``.grad`` and the last micro-batch's hooks post their sum."""

    _accumulating = False

    @contextlib.contextmanager
    def accumulating(self):
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False


class LocalSync(GradSync):
    """One rank: nothing to synchronise."""

    handles = ALL_FEATURES | {"checkpointed"}

    def resident_bytes(self) -> float | None:
        return 0.0


def ddp_supports_bucket_list() -> bool:
    """Whether this torch's DDP accepts ``bucket_cap_mb_list`` (a settable first bucket)."""
    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def sync_replicas(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank takes the group's first rank's parameters and buffers, as DDP does when it
    wraps a model, but in place, tensor by tensor: DDP's own sync packs them into one buffer
    that gloo may free in its own thread, where a memory tracker does not see it go."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=src, group=group)


class DDPSync(GradSync):
    """PyTorch DistributedDataParallel, with its bucket knobs exposed.

    ``bucket_cap_mb=None`` and ``first_bucket_mb=None`` keep PyTorch's defaults
    (25 MiB buckets, 1 MiB first bucket). Note that in PyTorch an explicit
    ``bucket_cap_mb`` also makes the first bucket that size unless a first
    bucket size is given too.
    """

    name = "ddp"
    handles = ALL_FEATURES | {"checkpointed"}

    def __init__(
        self,
        bucket_cap_mb: float | None = None,
        first_bucket_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        measure: bool = False,
    ):
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.measure = measure
        self._records: list[CommRecord] = []
        self._pending: list[tuple[str, int, float, list[float]]] = []
        self.ddp: DistributedDataParallel | None = None

    def ddp_kwargs(self) -> dict:
        """Keyword arguments for ``DistributedDataParallel`` that this strategy uses."""
        kw: dict = {
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
        }
        if self.first_bucket_mb is not None and ddp_supports_bucket_list():
            cap = self.bucket_cap_mb if self.bucket_cap_mb is not None else 25
            # One explicit cap per possible bucket: the first, then the rest.
            kw["bucket_cap_mb_list"] = [self.first_bucket_mb] + [cap] * 1024
        elif self.bucket_cap_mb is not None:
            kw["bucket_cap_mb"] = self.bucket_cap_mb
        return kw

    def attach(self, session: Session) -> None:
        super().attach(session)
        device_ids = [session.device.index] if session.device.type == "cuda" else None
        sync_replicas(session.model, session.group)
        self.ddp = DistributedDataParallel(
            session.model,
            device_ids=device_ids,
            process_group=session.group,
            init_sync=False,  # done above, in place
            **self.ddp_kwargs(),
        )
        if self.measure:
            self.ddp.register_comm_hook(None, self._timed_allreduce)

    @property
    def module(self) -> nn.Module:
        return self.ddp

    def accumulating(self):
        return self.ddp.no_sync()

    # No annotations: DDP compares them to its own types, and this module's
    # postponed (string) annotations would not match.
    def _timed_allreduce(self, _state, bucket):
        """DDP's default all-reduce (sum, then divide by the world), timed per bucket."""
        buf = bucket.buffer()
        posted = time.perf_counter()
        done: list[float] = []
        world = dist.get_world_size(self.session.group)
        fut = dist.all_reduce(buf, group=self.session.group, async_op=True).get_future()

        def finish(f):
            done.append(time.perf_counter())
            return f.value()[0].div_(world)

        self._pending.append(
            (f"bucket{bucket.index()}", buf.numel() * buf.element_size(), posted, done)
        )
        return fut.then(finish)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._pending:
            self._records += self._settle(self._pending, time.perf_counter())
            self._pending = []
        self.session.optimizer_step(optimizer)

    @staticmethod
    def _settle(pending: list, now: float) -> list[CommRecord]:
        """T_c and T_b of each bucket of one backward pass.

        DDP posts the last bucket when backward's last gradient is ready and
        then waits, inside ``backward()``, until every bucket is done. That wait
        is split among the buckets in the order they finished: each is charged
        the part of the wait that ended with it, so the T_b sum is the whole
        wait and a bucket that finished before backward's end has T_b = 0.
        """
        cursor = max(p[2] for p in pending)  # the last post: backward's last gradient
        finished = {i: (p[3][0] if p[3] else now) for i, p in enumerate(pending)}
        blocked = {}
        for i in sorted(finished, key=lambda k: finished[k]):
            blocked[i] = max(0.0, finished[i] - cursor)
            cursor = max(cursor, finished[i])
        return [
            CommRecord(name, nbytes, finished[i] - posted, blocked[i])
            for i, (name, nbytes, posted, _done) in enumerate(pending)
        ]

    def detach(self) -> None:
        # Dropping the wrapper frees its reducer, which removes its autograd hooks.
        self.ddp = None

    def resident_bytes(self) -> float | None:
        """DDP's buckets: one flat buffer the size of every gradient (the gradients are views
        into it with ``gradient_as_bucket_view``, counted once then)."""
        if self.ddp is None:
            return 0.0
        return float(
            sum(
                p.numel() * p.element_size()
                for p in self.session.model.parameters()
                if p.requires_grad
            )
        )

    def comm_records(self) -> list[CommRecord]:
        out, self._records = self._records, []
        return out
