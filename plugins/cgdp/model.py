"""Cost model of CGDP training (Le et al., Sec. 3.2) and of the baselines it competes with.

Per layer ``i`` (listed in backward order, layer ``l`` first):

* ``t_bp``  backward time of the layer on the device,
* ``t_as``  the host synchronisation before its gradient leaves (Step B-4-1),
* ``t_aa``  copy to the host and accumulation there (Step B-4-2),
* ``t_bc``  copy of the accumulated gradient back to the device (Step B-4-3).

The paper's model (Def. 3.1-3.4)::

    T_BP^i = sum_{j=l..i} (t_bp^j + t_as^j) + t_aa^i + t_bc^i
    T      = max_i T_BP^i                                   (CGDP backward)
    T'     = sum_i t_bp^i + sum_i (t_aa^i + t_bc^i)         (typical DP backward)
    T_O    = sum_i t_as^i + t_aa^1 + t_bc^1,   T'_O = sum_i (t_aa^i + t_bc^i)

Erratum (NOTES.md §4): Def. 3.2's printed formula is garbled and the text's
"the next t_bp^j, l >= j > i" should read j < i; this module uses the reading
consistent with the paper's derivations, above.

The paper lets every layer's host work run in parallel with every other's
(one host thread per GPU and layer). :func:`cgdp_backward_time_queued` is the
other bound: one host pipeline serving chunks in order, which is what a
single gloo group does. The typical DP of the paper (Caffe: reduce after
backward, no overlap) is not today's baseline; :func:`ddp_backward_time`
models PyTorch DDP, whose bucketed all-reduce over the peer links overlaps
backward too. Everything here is pure arithmetic on seconds and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tunekit.plugins.cgdp.search import Layout, as_layout

MiB = 1024 * 1024


@dataclass(frozen=True)
class LayerCost:
    """The four costs of one layer (or one chunk of layers), in seconds."""

    t_bp: float
    t_as: float
    t_aa: float
    t_bc: float


# -- the paper's model ------------------------------------------------------------------


def total_processing_times(costs: Sequence[LayerCost]) -> list[float]:
    """``T_BP^i`` of Def. 3.2 for each layer, ``costs`` in backward order."""
    out, ready = [], 0.0
    for c in costs:
        ready += c.t_bp + c.t_as
        out.append(ready + c.t_aa + c.t_bc)
    return out


def cgdp_backward_time(costs: Sequence[LayerCost]) -> float:
    """``T`` (Def. 3.3): the slowest layer's total processing time."""
    return max(total_processing_times(costs), default=0.0)


def typical_backward_time(costs: Sequence[LayerCost]) -> float:
    """``T'`` (Def. 3.4): backward, then every layer's accumulation and broadcast (t_as = 0)."""
    return sum(c.t_bp for c in costs) + sum(c.t_aa + c.t_bc for c in costs)


def backprop_time(costs: Sequence[LayerCost]) -> float:
    """``T_BP`` (Def. 3.1)."""
    return sum(c.t_bp for c in costs)


def cgdp_overhead(costs: Sequence[LayerCost]) -> float:
    """``T_O = sum t_as + t_aa^1 + t_bc^1``: CGDP's overhead when all but layer 1 hide."""
    if not costs:
        return 0.0
    return sum(c.t_as for c in costs) + costs[-1].t_aa + costs[-1].t_bc


def typical_overhead(costs: Sequence[LayerCost]) -> float:
    """``T'_O = sum (t_aa + t_bc)``."""
    return sum(c.t_aa + c.t_bc for c in costs)


# -- chunks and the queued bound ----------------------------------------------------------


def chunk_costs(costs: Sequence[LayerCost], k: int | Layout) -> list[LayerCost]:
    """Per-chunk costs of :func:`~tunekit.plugins.cgdp.search.chunk_layout` ``(l, k)``.

    A chunk's backward and host work are its layers' sums; it synchronises
    once, with the ``t_as`` of the layer whose completion triggers it (its
    last in backward), so that ``sum t_as`` runs over chunks (Sec. 4.1).
    """
    n = len(costs)
    out = []
    for chunk in as_layout(n, k):
        members = [costs[n - layer] for layer in chunk]  # paper layer l is index 0
        out.append(
            LayerCost(
                t_bp=sum(c.t_bp for c in members),
                t_as=members[-1].t_as,
                t_aa=sum(c.t_aa for c in members),
                t_bc=sum(c.t_bc for c in members),
            )
        )
    return out


def cgdp_backward_time_queued(costs: Sequence[LayerCost]) -> float:
    """CGDP backward when one host pipeline serves the chunks in order.

    Chunk ``i`` is ready at ``sum_{j<=i}(t_bp + t_as)``; its host work
    ``t_aa + t_bc`` starts when it is ready and the previous chunk's is done.
    An upper bound to the paper's :func:`cgdp_backward_time` (which lets all
    host work run in parallel); the truth lies between the two.
    """
    ready = free = 0.0
    for c in costs:
        ready += c.t_bp + c.t_as
        free = max(free, ready) + c.t_aa + c.t_bc
    return max(ready, free)


def ddp_backward_time(
    t_bp: Sequence[float],
    nbytes: Sequence[float],
    allreduce_s: Callable[[float], float],
    bucket_bytes: float = 25 * MiB,
    first_bucket_bytes: float = 1 * MiB,
) -> float:
    """Backward under PyTorch DDP: buckets filled in backward order (:func:`ddp_buckets`),
    each all-reduced when it is full and the previous one has finished."""
    ready = _cumulative(t_bp)
    free = 0.0
    for last, size in ddp_buckets(nbytes, bucket_bytes, first_bucket_bytes):
        free = max(free, ready[last]) + allreduce_s(size)
    return max(ready[-1] if ready else 0.0, free)


# -- a timeline of one backward pass with its reductions ------------------------------------
#
# The calibrated predictions (``calibrated.py``) run DDP and CGDP through the same
# timeline: messages (DDP's buckets, CGDP's chunks) are posted by the backward thread
# when their last layer's gradients are ready, reduced one at a time in order, and
# each reduction runs at one speed while backward still computes beside it and at
# another once backward is done: on CPU ranks the two share the cores (on the
# development machine a 1 MiB gloo all-reduce took 60-80 ms during backward and a
# 17 MiB one 12-30 ms after it).


@dataclass(frozen=True)
class AllReduceCost:
    """Seconds of one all-reduce of ``n`` bytes: ``latency + n / bandwidth``."""

    latency: float
    bandwidth: float

    def __call__(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0

    def scaled(self, factor: float) -> AllReduceCost:
        """The same shape, ``factor`` times slower."""
        return AllReduceCost(self.latency * factor, self.bandwidth / factor)


@dataclass(frozen=True)
class ReduceCosts:
    """All-reduce costs while backward computes beside them, and once it is done."""

    during: AllReduceCost
    after: AllReduceCost

    @classmethod
    def uniform(cls, cost: AllReduceCost) -> ReduceCosts:
        """One speed throughout (the reduction does not share the backward's cores)."""
        return cls(cost, cost)


@dataclass(frozen=True)
class Message:
    """One reduction: a DDP bucket or a CGDP chunk."""

    ready_s: float
    """When the backward thread posts it (seconds after backward began)."""
    nbytes: float
    host_after_s: float = 0.0
    """Host work after the all-reduce on the same pipeline (a chunk's copy back)."""


def _finish(start: float, during_s: float, after_s: float, backward_end: float) -> float:
    """End of a reduction started at ``start``: at the during-backward speed until backward
    ends, at the after-backward speed for what is left."""
    if start >= backward_end or during_s <= 0:
        return start + after_s
    if start + during_s <= backward_end:
        return start + during_s
    left = 1.0 - (backward_end - start) / during_s
    return backward_end + left * after_s


GLOO_THREADS = 2
"""Collectives a gloo process group runs at once (its worker threads; PyTorch's default 2)."""


def drain(
    messages: Sequence[Message], backward_end: float, costs: ReduceCosts, lanes: int = GLOO_THREADS
) -> float:
    """When the last of ``messages`` is done: started in order, each on the first of
    ``lanes`` free workers (a gloo group's threads), its host work after it on the same one."""
    free = [0.0] * max(1, lanes)
    for m in messages:
        lane = min(range(len(free)), key=free.__getitem__)
        start = max(free[lane], m.ready_s)
        end = _finish(start, costs.during(m.nbytes), costs.after(m.nbytes), backward_end)
        free[lane] = end + m.host_after_s
    return max(free)


@dataclass(frozen=True)
class Timeline:
    """One modelled backward pass with its reductions, in seconds."""

    backward_s: float
    """Backward, including the host work the backward thread does (posting chunks)."""
    exposed_s: float
    """Reduction left after backward: the exposed communication."""
    messages: int


def ddp_buckets(
    nbytes: Sequence[float], bucket_bytes: float = 25 * MiB, first_bucket_bytes: float = 1 * MiB
) -> list[tuple[int, float]]:
    """DDP's buckets in backward order as (index of its last layer, bytes).

    As DDP assigns them: layers are added in backward order and a bucket
    closes once it holds at least its cap (the first bucket has its own
    cap). Layer granularity stands in for DDP's parameters: a layer's bias
    comes before its weight in backward order, so it is the weight that
    fills a bucket and the layer stays whole.
    """
    out: list[tuple[int, float]] = []
    size, cap = 0.0, first_bucket_bytes
    for i, b in enumerate(nbytes):
        size += b
        if size >= cap:
            out.append((i, size))
            size, cap = 0.0, bucket_bytes
    if size > 0 or not out and nbytes:
        out.append((len(nbytes) - 1, size))
    return out


def ddp_timeline(
    t_bp: Sequence[float],
    nbytes: Sequence[float],
    costs: ReduceCosts,
    bucket_bytes: float = 25 * MiB,
    first_bucket_bytes: float = 1 * MiB,
) -> Timeline:
    """DDP: buckets posted as backward fills them, all-reduced in order.

    DDP's own host work (copies into its buckets) is part of the measured
    backward it is calibrated on, so it is not added here.
    """
    ready = list(_cumulative(t_bp))
    end = ready[-1] if ready else 0.0
    msgs = [Message(ready[i], b) for i, b in ddp_buckets(nbytes, bucket_bytes, first_bucket_bytes)]
    return Timeline(end, max(0.0, drain(msgs, end, costs) - end), len(msgs))


def cgdp_timeline(
    t_bp: Sequence[float],
    nbytes: Sequence[float],
    k: int | Layout,
    costs: ReduceCosts,
    post_s: float = 0.0,
    copy_back_s_per_byte: float = 0.0,
) -> Timeline:
    """CGDP with chunks of ``k`` layers: each chunk is posted by the backward thread
    (``post_s`` of hook and Python work, which delays the layers after it), then
    all-reduced in layout order and copied back on the host pipeline."""
    n = len(t_bp)
    msgs, clock, done = [], 0.0, 0
    for chunk in as_layout(n, k):
        idx = [n - layer for layer in chunk]  # paper layer l is index 0
        for i in range(done, max(idx) + 1):
            clock += t_bp[i]
        done = max(idx) + 1
        clock += post_s
        size = sum(nbytes[i] for i in idx)
        msgs.append(Message(clock, size, size * copy_back_s_per_byte))
    return Timeline(clock, max(0.0, drain(msgs, clock, costs) - clock), len(msgs))


def _cumulative(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out


def fit_after_latency(
    t_bp: Sequence[float],
    nbytes: Sequence[float],
    during: AllReduceCost,
    bandwidth: float,
    exposed_s: float,
    tolerance_s: float = 1e-5,
) -> float | None:
    """The latency of an all-reduce after backward (at ``bandwidth``) that makes DDP's
    modelled exposed communication ``exposed_s``; None when none can (the reductions
    during backward alone already leave more exposed than that).

    Under load a message's cost after backward is mostly waiting to be scheduled,
    so it is the latency that is fitted; exposed communication grows with it.
    """

    def exposed(latency: float) -> float:
        costs = ReduceCosts(during, AllReduceCost(latency, bandwidth))
        return ddp_timeline(t_bp, nbytes, costs).exposed_s

    if exposed(0.0) > exposed_s + tolerance_s:
        return None
    lo, hi = 0.0, max(exposed_s, 1e-6)
    while exposed(hi) < exposed_s:
        lo, hi = hi, hi * 2
    while hi - lo > tolerance_s / 10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exposed(mid) < exposed_s else (lo, mid)
    return (lo + hi) / 2


# -- per-layer costs from rates -----------------------------------------------------------


@dataclass(frozen=True)
class HostRates:
    """How fast gradients travel to the host, get reduced there, and come back.

    ``t_aa(n) = n / d2h_bw + reduce_latency + n / reduce_bw`` and
    ``t_bc(n) = n / h2d_bw``; ``sync_s`` is ``t_as``, the cost of one
    synchronisation point on the device's backward thread.
    """

    d2h_bw: float
    """Bytes/s device to host (a plain memory copy for a CPU rank)."""
    h2d_bw: float
    reduce_bw: float
    """Effective bytes/s of the host-side reduction across the G ranks."""
    reduce_latency: float = 0.0
    sync_s: float = 0.0
    source: str = ""
    """Where the numbers came from (measured, hardware profile ...)."""

    def t_aa(self, nbytes: float) -> float:
        return nbytes / self.d2h_bw + (
            self.reduce_latency + nbytes / self.reduce_bw if nbytes else 0.0
        )

    def t_bc(self, nbytes: float) -> float:
        return nbytes / self.h2d_bw


def host_sum_bandwidth(sum_bw: float, world_size: int) -> float:
    """Effective reduction bandwidth when the host adds G contributions at ``sum_bw`` each.

    G contributions of n bytes need G-1 additions of n bytes: time
    ``(G-1) n / sum_bw``, i.e. an effective ``sum_bw / (G-1)``.
    """
    return math.inf if world_size <= 1 else sum_bw / (world_size - 1)


def layer_costs(
    t_bp: Sequence[float], nbytes: Sequence[float], rates: HostRates
) -> list[LayerCost]:
    """The paper's per-layer costs from measured backward times and host rates."""
    return [
        LayerCost(t_bp=bp, t_as=rates.sync_s, t_aa=rates.t_aa(b), t_bc=rates.t_bc(b))
        for bp, b in zip(t_bp, nbytes, strict=True)
    ]


def chunked_layer_costs(
    t_bp: Sequence[float], nbytes: Sequence[float], rates: HostRates, k: int | Layout
) -> list[LayerCost]:
    """Per-chunk costs from rates: one synchronisation and one reduction per chunk.

    Unlike :func:`chunk_costs` (the paper's sum of per-layer costs), a chunk
    pays the reduction's start-up latency once, as one message does.
    """
    n = len(t_bp)
    out = []
    for chunk in as_layout(n, k):
        idx = [n - layer for layer in chunk]
        size = sum(nbytes[i] for i in idx)
        out.append(
            LayerCost(
                t_bp=sum(t_bp[i] for i in idx),
                t_as=rates.sync_s,
                t_aa=rates.t_aa(size),
                t_bc=rates.t_bc(size),
            )
        )
    return out


# -- the paper's Table 3 ------------------------------------------------------------------


@dataclass(frozen=True)
class IterationPhases:
    """One training iteration split into the phases of the paper's Table 3 (seconds)."""

    forward: float
    backward: float
    update: float
    broadcast: float = 0.0
    """Parameter broadcast at the start (typical DP only)."""
    grad_acc: float = 0.0
    """Gradient accumulation after backward (typical DP only)."""
    exposed: float = 0.0
    """Remaining gradients broadcast from the host after backward (CGDP only)."""

    @property
    def total(self) -> float:
        return (
            self.broadcast
            + self.forward
            + self.backward
            + self.exposed
            + self.grad_acc
            + self.update
        )

    @property
    def overhead(self) -> float:
        """Time spent on gradient exchange outside forward, backward and update."""
        return self.broadcast + self.exposed + self.grad_acc


# -- comparing CGDP with the baselines ------------------------------------------------------


@dataclass
class Prediction:
    """What the model predicts for one job: backward times in seconds."""

    num_layers: int
    backprop_s: float
    """T_BP: backward without any gradient exchange."""
    typical_s: float
    """T': the paper's typical DP (reduce after backward)."""
    ddp_s: float
    """DDP: bucketed all-reduce over the peer links, overlapped."""
    cgdp_s: dict[int, float]
    """Chunk size -> CGDP backward, queued bound (one host pipeline)."""
    cgdp_paper_s: dict[int, float]
    """Chunk size -> CGDP backward, the paper's model (host work in parallel)."""
    overhead_s: dict[int, float]
    """Chunk size -> T_O of the chunked costs."""
    typical_overhead_s: float
    best_chunk: int
    gradient_bytes: float
    details: dict = field(default_factory=dict)

    @property
    def best_cgdp_s(self) -> float:
        return self.cgdp_s[self.best_chunk]

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "backprop_s": self.backprop_s,
            "typical_s": self.typical_s,
            "ddp_s": self.ddp_s,
            "cgdp_s": {str(k): v for k, v in self.cgdp_s.items()},
            "cgdp_paper_s": {str(k): v for k, v in self.cgdp_paper_s.items()},
            "overhead_s": {str(k): v for k, v in self.overhead_s.items()},
            "typical_overhead_s": self.typical_overhead_s,
            "best_chunk": self.best_chunk,
            "gradient_bytes": self.gradient_bytes,
            **self.details,
        }


def candidate_chunk_sizes(num_layers: int) -> list[int]:
    """One chunk size per distinct layout, small sizes densely, then powers of two, then ``l - 1``."""
    if num_layers <= 1:
        return [1]
    ks = set(range(1, min(num_layers, 10)))
    k = 16
    while k < num_layers:
        ks.add(k)
        k *= 2
    ks.add(num_layers - 1)
    return sorted(ks)


def predict(
    t_bp: Sequence[float],
    nbytes: Sequence[float],
    rates: HostRates,
    peer_allreduce_s: Callable[[float], float],
    chunk_candidates: Sequence[int] | None = None,
) -> Prediction:
    """CGDP at each chunk size against the paper's typical DP and against DDP.

    ``t_bp`` and ``nbytes`` per parameterised layer in backward order;
    ``peer_allreduce_s(n)`` is the time of one all-reduce of ``n`` bytes over
    the devices' peer links (the DDP baseline).
    """
    if len(t_bp) != len(nbytes) or not t_bp:
        raise ValueError("t_bp and nbytes need one entry per layer, and at least one layer")
    costs = layer_costs(t_bp, nbytes, rates)
    ks = list(chunk_candidates or candidate_chunk_sizes(len(costs)))
    queued, paper, overhead = {}, {}, {}
    for k in ks:
        chunked = chunked_layer_costs(t_bp, nbytes, rates, k)
        queued[k] = cgdp_backward_time_queued(chunked)
        paper[k] = cgdp_backward_time(chunked)
        overhead[k] = cgdp_overhead(chunked)
    best = min(ks, key=lambda k: (queued[k], k))
    return Prediction(
        num_layers=len(costs),
        backprop_s=backprop_time(costs),
        typical_s=typical_backward_time(costs),
        ddp_s=ddp_backward_time(t_bp, nbytes, peer_allreduce_s),
        cgdp_s=queued,
        cgdp_paper_s=paper,
        overhead_s=overhead,
        typical_overhead_s=typical_overhead(costs),
        best_chunk=best,
        gradient_bytes=float(sum(nbytes)),
    )


# -- memory -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a rank holds for parameters, gradients, reduction buffers and optimizer state."""

    device_bytes: float
    host_bytes: float


def memory_estimates(
    param_bytes: float, state_bytes: float, ddp_bucket_view: bool = False
) -> dict[str, MemoryEstimate]:
    """Model-state memory per rank under DDP, CGDP and CGDP with optimizer offload.

    DDP keeps its gradient buckets on the device (a second copy of the
    gradients unless ``gradient_as_bucket_view``); CGDP's reduction buffers are
    on the host, which is the paper's Table 5 effect. Offload moves the
    optimizer state and a master copy of the parameters to the host too, and
    frees each device gradient once it has been copied out.
    """
    grads = param_bytes
    buckets = 0.0 if ddp_bucket_view else grads
    return {
        "ddp": MemoryEstimate(param_bytes + grads + buckets + state_bytes, 0.0),
        "cgdp": MemoryEstimate(param_bytes + grads + state_bytes, grads),
        "cgdp+offload": MemoryEstimate(param_bytes + grads, grads + param_bytes + state_bytes),
    }
