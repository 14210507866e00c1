"""Cost model: predicted step time, exposed communication and overlap ratio R.

One rank's step is simulated as Lee et al.'s Figure 4 draws it: forward
layer by layer, backward from the output end, and every communication on one
channel in the order it is posted (a collective starts when it is posted and
the previous one is done). A rank blocks where it waits for a communication
that has not finished; that wait is the communication's ``T_b``, and ``T_c``
runs from posting to completion, as the runtime measures them, so predicted
and measured R compare directly.

A collective's work is its fitted time (the hardware probe's, measured on
otherwise idle ranks). Inside a step it may run slower: ``comm_scale`` times
while the rank computes (on CPU ranks gloo's threads compete with compute for
the cores), ``comm_idle_scale`` times while the rank waits for it. And the
peer rank may reach the step's last collective later than this rank
(``peer_delay_s``: ranks drift apart by their compute times), which holds that
collective back. With all three at their defaults (1, 1, 0) the simulation is
the paper's.

Where communication runs on the same saturated cores as compute (gloo on a
CPU), a hidden communication still costs compute time: ``comm_cpu_share`` of
the work it does while the rank computes is added to the step (an extension;
the paper's nodes had a core to spare for the communication thread).

Two schemes are modelled:

* ``ddp_buckets``: DDP's gradient buckets, filled in the order backward
  produces gradients, the first capped at the first-bucket size; each bucket's
  all-reduce is launched (in bucket order) when its last gradient is ready; the
  optimizer steps after backward and all buckets are done.
* ``two_chunk``: chunk 1 (last k layers) posted when backprop has passed them,
  chunk 2 after backprop; chunk 1's update overlaps chunk 2's all-reduce; for
  each of the f replicated FC layers an all-gather of its input activations is
  posted in forward, one of its errors after chunk 2 is done, and the
  full-batch weight gradient plus update run just before its next forward.
  Steps are simulated until the pattern repeats (the FC gathers reach into the
  next step).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tunekit.api import CommRecord, overlap_ratio

ELEMENT_BYTES = 4  # fp32 gradients, activations and errors


@dataclass(frozen=True)
class FcCost:
    """What replicating one fully-connected layer's gradient costs."""

    in_features: int
    """K_b: neurons of the layer below."""
    out_features: int
    """K_c: neurons of this layer."""
    rows: int
    """Rows of this rank's activation matrix per step (samples x positions)."""
    local_wgrad_s: float
    """Time of the local weight gradient that replication saves in backward."""
    full_wgrad_s: float
    """Time of the full-batch weight gradient (world x rows) every rank computes."""


@dataclass(frozen=True)
class LayerCost:
    """One layer in the paper's sense, on one rank."""

    name: str
    forward_s: float
    backward_s: float
    """Time backprop spends in this layer (and the activation layers it owns)."""
    param_bytes: tuple[int, ...] = ()
    """Bytes of each parameter tensor, in the order backward produces them."""
    fc: FcCost | None = None
    """Set for fully-connected layers that may replicate their gradient."""

    @property
    def nbytes(self) -> int:
        return sum(self.param_bytes)


@dataclass(frozen=True)
class StepCosts:
    """Everything the simulation needs about one rank's step."""

    layers: tuple[LayerCost, ...]
    """Forward order, output end last."""
    update_s_per_byte: float
    """Optimizer step time per parameter byte."""
    other_s: float
    """Per-step time outside forward, backward and update (getting the batch)."""
    world: int
    allreduce_s: Callable[[float], float]
    """All-reduce time of a buffer of this many bytes."""
    allgather_s: Callable[[float], float]
    """All-gather time, by the bytes of the gathered result."""
    comm_cpu_share: float = 0.0
    """Fraction of its CPU work a hidden communication takes from compute: 0 when
    communication has its own engine (NCCL on a GPU; the paper's dedicated
    communication thread on a 32-core node), up to 1 when the rank's compute
    threads and the collective's threads share saturated cores (gloo on CPU)."""
    compute_scale: float = 1.0
    """Factor the layer times were multiplied by (:meth:`scaled`): how much slower
    compute runs in the job than in the per-layer profile."""
    comm_scale: float = 1.0
    """How many times its fitted time a collective takes while the rank computes."""
    comm_idle_scale: float = 1.0
    """How many times its fitted time a collective takes while the rank waits for it."""
    peer_delay_s: float = 0.0
    """How much later than this rank the peer posts the step's last collective.

    Ranks drift apart by their compute times; the measured step is the later
    rank's, the measured breakdown the mean over ranks, in which the earlier
    rank's wait for the later one is exposed communication. So the delay is a
    rigid wait after backward: work the earlier rank could do meanwhile (an
    update) does not shorten the later rank's step."""

    def allreduce(self, nbytes: float) -> float:
        """All-reduce work of ``nbytes``: its fitted time."""
        return self.allreduce_s(nbytes)

    def allgather(self, nbytes: float) -> float:
        """All-gather work (by gathered bytes): its fitted time."""
        return self.allgather_s(nbytes)

    def channel(self) -> _Channel:
        return _Channel(self.comm_scale, self.comm_idle_scale)

    def cpu_charge_s(self, comms: list[PredictedComm]) -> float:
        """Compute time that hidden communications take on shared cores.

        A collective's CPU work is its fitted time, slowed as compute is slowed
        in the job (``compute_scale``). The work it did while the rank computed
        comes out of compute, at :attr:`displaced_share`.
        """
        busy_work = sum(c.busy_work_s for c in comms)
        return self.displaced_share * self.compute_scale * busy_work

    @property
    def displaced_share(self) -> float:
        """Share of a hidden collective's work that displaces this rank's compute.

        With ``T`` compute threads on ``T`` cores (``comm_cpu_share = 1/T``) a
        collective's thread competing with them alone runs ``1 + 1/T`` times its
        probe time, and what it takes, it takes from them. A collective measured
        ``comm_scale`` times slower than that competes with more than this rank
        (other processes, scheduling delays); only ``(1 + 1/T) / comm_scale`` of
        its competitors are this rank's compute threads.
        """
        share = self.comm_cpu_share
        if share <= 0:
            return 0.0
        return share * min(1.0, (1.0 + share) / self.comm_scale)

    def charge_cpu(self, pred: Prediction) -> Prediction:
        """Add :meth:`cpu_charge_s` of the prediction's communications to its step (as compute)."""
        charge = self.cpu_charge_s(pred.comms)
        pred.step_s += charge
        pred.parts["compute"] = pred.parts.get("compute", 0.0) + charge
        pred.cpu_charge_s = charge
        return pred

    def calibrated(
        self,
        compute: float,
        comm: float = 1.0,
        update: float | None = None,
        other_s: float | None = None,
        peer_delay_s: float | None = None,
    ) -> StepCosts:
        """The job with compute times x ``compute``, collectives x ``comm`` while
        the rank computes, the optimizer x ``update`` (default: ``compute``),
        ``other_s`` per step outside forward, backward and update, and the peer's
        delay (defaults: unchanged)."""
        scaled = self.scaled(compute)
        upd = compute if update is None else update
        return replace(
            scaled,
            update_s_per_byte=self.update_s_per_byte * upd,
            comm_scale=self.comm_scale * comm,
            other_s=self.other_s if other_s is None else other_s,
            peer_delay_s=self.peer_delay_s if peer_delay_s is None else peer_delay_s,
        )

    def scaled(self, factor: float) -> StepCosts:
        """The same job with every compute time (and the optimizer) multiplied by ``factor``."""

        def layer(c: LayerCost) -> LayerCost:
            fc = c.fc
            if fc is not None:
                fc = replace(
                    fc,
                    local_wgrad_s=fc.local_wgrad_s * factor,
                    full_wgrad_s=fc.full_wgrad_s * factor,
                )
            return replace(
                c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor, fc=fc
            )

        return replace(
            self,
            layers=tuple(layer(c) for c in self.layers),
            update_s_per_byte=self.update_s_per_byte * factor,
            compute_scale=self.compute_scale * factor,
        )

    @property
    def compute_s(self) -> float:
        return sum(c.forward_s + c.backward_s for c in self.layers) + self.update_s_per_byte * sum(
            c.nbytes for c in self.layers
        )


@dataclass
class PredictedComm:
    """One communication of the simulated step; times from the start of its step."""

    name: str
    nbytes: int
    posted_s: float
    start_s: float = math.nan
    end_s: float = math.nan
    blocked_s: float = 0.0
    work_s: float = 0.0
    """Its fitted time (the probe's)."""
    not_before_s: float = 0.0
    """It cannot start earlier (the peer posts it then)."""
    busy_work_s: float = 0.0
    """The part of ``work_s`` done while the rank computed."""

    def record(self) -> CommRecord:
        return CommRecord(self.name, self.nbytes, self.end_s - self.posted_s, self.blocked_s)


@dataclass
class Prediction:
    """The model's answer for one setting."""

    step_s: float
    comms: list[PredictedComm] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)
    """The step split as the measured breakdown splits it: ``compute`` (forward,
    backward, replicated FC gradients, and the CPU work of hidden communication),
    ``comm_exposed`` (waiting for communication), ``optimizer``, and ``other``
    (getting the batch, and whatever else the model carries over unchanged)."""
    cpu_charge_s: float = 0.0
    """The part of ``compute`` that is hidden communication's CPU work."""

    @property
    def blocked_s(self) -> float:
        """Exposed communication: time the rank waited on communications."""
        return sum(c.blocked_s for c in self.comms)

    @property
    def overlap_R(self) -> float | None:
        return overlap_ratio([c.record() for c in self.comms])

    @property
    def comm_span_s(self) -> float:
        """Time some communication was in flight (the union of posting-to-end spans),
        as the measured breakdown's ``comm_total`` counts it."""
        span, reach = 0.0, -math.inf
        for c in sorted(self.comms, key=lambda c: c.posted_s):
            start = max(c.posted_s, reach)
            if c.end_s > start:
                span += c.end_s - start
            reach = max(reach, c.end_s)
        return span

    @property
    def hidden_s(self) -> float:
        """Time communication was in flight while the rank did not wait for it."""
        return max(0.0, self.comm_span_s - self.blocked_s)

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "exposed_s": self.blocked_s,
            "overlap_R": self.overlap_R,
            "parts": dict(self.parts),
            "cpu_charge_s": self.cpu_charge_s,
            "comms": [c.record().__dict__ for c in self.comms],
        }


class _Channel:
    """Communications run one at a time, in the order they are posted.

    A communication's work progresses ``busy_scale`` times slower than fitted
    while the rank computes and ``idle_scale`` times while it does not. The
    simulation declares the rank's compute intervals (:meth:`compute`) as it
    goes; a communication's end is worked out when the rank waits for it (from
    then on the rank is idle until it ends), earlier ones first.
    """

    def __init__(self, busy_scale: float = 1.0, idle_scale: float = 1.0) -> None:
        self.busy_scale = busy_scale
        self.idle_scale = idle_scale
        self.free_at = 0.0
        self.intervals: list[list[float]] = []
        self.pending: deque[PredictedComm] = deque()
        self.posted: list[tuple[int, PredictedComm]] = []

    def compute(self, start: float, end: float) -> None:
        """The rank computes from ``start`` to ``end`` (in time order)."""
        if end <= start:
            return
        if self.intervals and self.intervals[-1][1] >= start:
            self.intervals[-1][1] = max(self.intervals[-1][1], end)
        else:
            self.intervals.append([start, end])

    def post(
        self,
        step: int,
        name: str,
        nbytes: int,
        at: float,
        work: float,
        not_before: float | None = None,
    ) -> PredictedComm:
        comm = PredictedComm(name, nbytes, at, work_s=work, not_before_s=max(at, not_before or at))
        self.pending.append(comm)
        self.posted.append((step, comm))
        return comm

    def resolve(self, comm: PredictedComm | None = None) -> None:
        """Work out when ``comm`` (default: every pending one) and those before it end."""
        while self.pending:
            c = self.pending.popleft()
            c.start_s = max(c.not_before_s, self.free_at)
            c.end_s, c.busy_work_s = self._finish(c.start_s, c.work_s)
            self.free_at = c.end_s
            if c is comm:
                return

    def _finish(self, t: float, work: float) -> tuple[float, float]:
        """(end, work done while the rank computed) of ``work`` started at ``t``."""
        left, busy = work, 0.0
        for start, end in self.intervals:
            if end <= t:
                continue
            if start > t:  # the rank is idle until `start`
                can = (start - t) / self.idle_scale
                if can >= left:
                    return t + left * self.idle_scale, busy
                left, t = left - can, start
            can = (end - t) / self.busy_scale
            if can >= left:
                return t + left * self.busy_scale, busy + left
            left, busy, t = left - can, busy + can, end
        return t + left * self.idle_scale, busy


PIECE_BYTES = 25 * 1024 * 1024
"""A chunk is one posting point (the paper's unit) but goes out as all-reduces
of pieces of at most this size, posted together (``TwoChunkSync`` does so):
gloo on CPU all-reduced one 234 MB buffer in 0.55 s and nine 25 MB ones in
0.30 s on the development machine, so huge single messages cost more than the
startup they save. 25 MiB is DDP's default bucket size."""


def chunk_allreduce_s(costs: StepCosts, nbytes: int) -> float:
    """All-reduce time of a chunk posted as pieces of at most :data:`PIECE_BYTES`, back to back."""
    full, rest = divmod(nbytes, PIECE_BYTES)
    return full * costs.allreduce(PIECE_BYTES) + (costs.allreduce(rest) if rest else 0.0)


def _wait(channel: _Channel, comm: PredictedComm, now: float) -> float:
    """The rank waits at ``now`` for ``comm``; returns when it goes on."""
    channel.resolve(comm)
    comm.blocked_s = max(0.0, comm.end_s - now)
    return max(now, comm.end_s)


# -- DDP buckets --------------------------------------------------------------------------


def ddp_buckets(nbytes: list[int], first_cap: float, cap: float) -> list[list[int]]:
    """Indices grouped as DDP's ``compute_bucket_assignment_by_size`` does.

    Tensors in gradient-ready order go into the open bucket; a bucket closes
    once it holds at least its limit (the first bucket's limit is ``first_cap``,
    the others ``cap``), so a bucket may exceed its limit by its last tensor.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, b in enumerate(nbytes):
        current.append(i)
        size += b
        if size >= (first_cap if not buckets else cap):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def predict_ddp(costs: StepCosts, first_cap_bytes: float, cap_bytes: float) -> Prediction:
    """Predicted step of DDP with the given bucket caps."""
    forward_s = sum(c.forward_s for c in costs.layers)
    backward_start = costs.other_s + forward_s
    ready, sizes = [], []
    t = backward_start
    for layer in reversed(costs.layers):
        t += layer.backward_s
        for b in layer.param_bytes:
            ready.append(t)
            sizes.append(b)
    backward_end = t
    channel = costs.channel()
    channel.compute(0.0, backward_end)
    buckets = ddp_buckets(sizes, first_cap_bytes, cap_bytes)
    launched = 0.0
    comms = []
    for index, bucket in enumerate(buckets):
        launched = max(launched, max(ready[i] for i in bucket))  # DDP launches buckets in order
        nbytes = sum(sizes[i] for i in bucket)
        last = index == len(buckets) - 1
        not_before = launched + costs.peer_delay_s if last else None
        comms.append(
            channel.post(0, f"bucket{index}", nbytes, launched, costs.allreduce(nbytes), not_before)
        )
    channel.resolve()
    # The rank blocks after its last gradient until every bucket is done; each
    # bucket is charged the part of that wait that ends with it.
    cursor = backward_end
    for comm in sorted(comms, key=lambda c: c.end_s):
        comm.blocked_s = max(0.0, comm.end_s - cursor)
        cursor = max(cursor, comm.end_s)
    update_s = costs.update_s_per_byte * sum(sizes)
    blocked = sum(c.blocked_s for c in comms)
    step = backward_end + blocked + update_s
    parts = {
        "compute": backward_end - costs.other_s,
        "comm_exposed": blocked,
        "optimizer": update_s,
        "other": costs.other_s,
    }
    return costs.charge_cpu(Prediction(step, comms, parts))


# -- two chunks ---------------------------------------------------------------------------


def predict_two_chunk(costs: StepCosts, k: int, f: int, steps: int = 4) -> Prediction:
    """Predicted steady-state step of Lee et al.'s Algorithm 2 with ``k`` and ``f``."""
    layers = costs.layers
    n = len(layers)
    fcs = [i for i, c in enumerate(layers) if c.fc is not None]
    if not 1 <= k <= n or not 0 <= f <= len(fcs):
        raise ValueError(f"k={k}, f={f} out of range for {n} layers and {len(fcs)} FC layers")
    replicated = set(fcs[:f])
    bytes1 = sum(layers[i].nbytes for i in range(n - k, n) if i not in replicated)
    bytes2 = sum(layers[i].nbytes for i in range(n - k) if i not in replicated)
    upd = costs.update_s_per_byte
    world = costs.world
    channel = costs.channel()
    pending: dict[int, tuple[PredictedComm, PredictedComm]] = {}
    begins = []
    busy: list[dict[str, float]] = []  # per step: seconds of compute, optimizer, other
    t = 0.0

    def work(part: str, seconds: float) -> None:
        """The rank computes (or updates, or fetches the batch) for ``seconds``."""
        nonlocal t
        channel.compute(t, t + seconds)
        busy[-1][part] += seconds
        t += seconds

    for step in range(steps):
        begins.append(t)
        busy.append({"compute": 0.0, "optimizer": 0.0, "other": 0.0})
        work("other", costs.other_s)
        acts: dict[int, PredictedComm] = {}
        for i, layer in enumerate(layers):
            if i in replicated:
                fc = layer.fc
                if i in pending:  # deferred full-batch gradient and update (lines 7-9)
                    gather_a, gather_e = pending.pop(i)
                    t = _wait(channel, gather_e, _wait(channel, gather_a, t))
                    work("compute", fc.full_wgrad_s)
                    work("optimizer", upd * layer.nbytes)
                nbytes = world * fc.rows * fc.in_features * ELEMENT_BYTES
                acts[i] = channel.post(
                    step, f"gather_{layer.name}_acts", nbytes, t, costs.allgather(nbytes)
                )
            work("compute", layer.forward_s)
        chunk1 = chunk2 = None
        for i in reversed(range(n)):
            layer = layers[i]
            saved = layer.fc.local_wgrad_s if i in replicated else 0.0
            work("compute", max(0.0, layer.backward_s - saved))
            if i == n - k and bytes1:  # backprop has passed the last k layers (erratum: l = L-k)
                # The step's last collective if there is no chunk 2: the peer posts it late.
                delay = costs.peer_delay_s if not bytes2 else 0.0
                chunk1 = channel.post(
                    step, "chunk1", bytes1, t, chunk_allreduce_s(costs, bytes1), t + delay
                )
        if bytes2:
            chunk2 = channel.post(
                step, "chunk2", bytes2, t, chunk_allreduce_s(costs, bytes2), t + costs.peer_delay_s
            )
        # Nothing hides the peer's lateness: the step is the later rank's, and
        # the later rank has nothing to wait for (see StepCosts.peer_delay_s).
        t += costs.peer_delay_s
        if chunk1 is not None:
            t = _wait(channel, chunk1, t)
            work("optimizer", upd * bytes1)
        if chunk2 is not None:
            t = _wait(channel, chunk2, t)
        last = chunk2 if chunk2 is not None else chunk1
        if last is not None:
            last.blocked_s += costs.peer_delay_s
        for i in sorted(replicated):
            nbytes = world * layers[i].fc.rows * layers[i].fc.out_features * ELEMENT_BYTES
            errors = channel.post(
                step, f"gather_{layers[i].name}_errors", nbytes, t, costs.allgather(nbytes)
            )
            pending[i] = (acts[i], errors)
        work("optimizer", upd * bytes2)
    begins.append(t)
    channel.resolve()
    # Step `steps - 2` is steady; its FC gathers were waited for in the last step.
    steady = steps - 2
    origin = begins[steady]
    comms = [
        replace(c, posted_s=c.posted_s - origin, start_s=c.start_s - origin, end_s=c.end_s - origin)
        for s, c in channel.posted
        if s == steady
    ]
    step_s = begins[steady + 1] - origin
    parts = dict(busy[steady])
    # Whatever the rank did not spend computing, updating or fetching, it waited.
    parts["comm_exposed"] = max(0.0, step_s - sum(parts.values()))
    return costs.charge_cpu(Prediction(step_s, comms, parts))


def fc_replication_values(in_features: int, out_features: int, rows: int) -> tuple[int, int]:
    """(values all-reduced without replication, values gathered with it) for one FC layer.

    The paper's trade: the K_b x K_c weight gradient against the activations
    and errors of all rows, (K_b + K_c) x N.
    """
    return in_features * out_features, (in_features + out_features) * rows


def calibrate(
    costs: StepCosts, measured_step_s: float, predict: Callable[[StepCosts], Prediction]
) -> float | None:
    """The factor on compute times that makes ``predict`` match one measured step.

    The per-layer profile is taken in one process; the measured baseline runs
    with its peers (sharing cores, memory bandwidth, the communication
    threads). One factor, fitted to the baseline, carries that over to every
    other setting. Returns None when no factor in [1e-3, 1e3] can match (the
    communication model alone predicts more than was measured, or far less).
    """
    lo, hi = 1e-3, 1e3
    if not (
        predict(costs.scaled(lo)).step_s <= measured_step_s <= predict(costs.scaled(hi)).step_s
    ):
        return None
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if predict(costs.scaled(mid)).step_s < measured_step_s:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5
