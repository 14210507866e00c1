"""Cost model: predicted step time, exposed communication and overlap ratio R.

One rank's step is simulated as Lee et al.'s Figure 4 draws it: forward
layer by layer, backward from the output end, and every communication on one
channel in the order it is posted (a collective starts when it is posted and
the previous one is done; it takes the fitted time of its collective). A rank
blocks where it waits for a communication that has not finished; that wait is
the communication's ``T_b``, and ``T_c`` runs from posting to completion, as
the runtime measures them, so predicted and measured R compare directly.

Where communication runs on the same saturated cores as compute (gloo on a
CPU), a hidden communication still costs compute time: ``comm_cpu_share`` of
its hidden time is added to the step (an extension; the paper's nodes had a
core to spare for the communication thread).

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

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tunekit.runtime.sync import CommRecord, overlap_ratio

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
    """Fraction of its hidden time a communication takes from compute: 0 when
    communication has its own engine (NCCL on a GPU; the paper's dedicated
    communication thread on a 32-core node), up to 1 when the rank's compute
    threads and the collective's threads share saturated cores (gloo on CPU)."""

    def charge_cpu(self, pred: Prediction) -> Prediction:
        """Add the compute time hidden communications take on shared cores.

        Hidden is the time the channel was busy while the rank was not waiting
        (one channel: busy time is the sum of the transfers themselves; queueing
        behind another communication is not busy time of its own).
        """
        busy = sum(c.end_s - c.start_s for c in pred.comms)
        hidden = max(0.0, busy - sum(c.blocked_s for c in pred.comms))
        pred.step_s += self.comm_cpu_share * hidden
        return pred

    def scaled(self, factor: float) -> StepCosts:
        """The same job with every compute time multiplied by ``factor``."""

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
    start_s: float
    end_s: float
    blocked_s: float = 0.0

    def record(self) -> CommRecord:
        return CommRecord(self.name, self.nbytes, self.end_s - self.posted_s, self.blocked_s)


@dataclass
class Prediction:
    """The model's answer for one setting."""

    step_s: float
    comms: list[PredictedComm] = field(default_factory=list)

    @property
    def blocked_s(self) -> float:
        """Exposed communication: time the rank waited on communications."""
        return sum(c.blocked_s for c in self.comms)

    @property
    def overlap_R(self) -> float | None:
        return overlap_ratio([c.record() for c in self.comms])

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "exposed_s": self.blocked_s,
            "overlap_R": self.overlap_R,
            "comms": [c.record().__dict__ for c in self.comms],
        }


class _Channel:
    """Communications run one at a time, in the order they are posted."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.posted: list[tuple[int, PredictedComm]] = []

    def post(self, step: int, name: str, nbytes: int, at: float, duration: float) -> PredictedComm:
        start = max(at, self.free_at)
        comm = PredictedComm(name, nbytes, at, start, start + duration)
        self.free_at = comm.end_s
        self.posted.append((step, comm))
        return comm


PIECE_BYTES = 25 * 1024 * 1024
"""A chunk is one posting point (the paper's unit) but goes out as all-reduces
of pieces of at most this size, posted together (``TwoChunkSync`` does so):
gloo on CPU all-reduced one 234 MB buffer in 0.55 s and nine 25 MB ones in
0.30 s on the development machine, so huge single messages cost more than the
startup they save. 25 MiB is DDP's default bucket size."""


def chunk_allreduce_s(costs: StepCosts, nbytes: int) -> float:
    """All-reduce time of a chunk posted as pieces of at most :data:`PIECE_BYTES`, back to back."""
    full, rest = divmod(nbytes, PIECE_BYTES)
    return full * costs.allreduce_s(PIECE_BYTES) + (costs.allreduce_s(rest) if rest else 0.0)


def _wait(comm: PredictedComm, now: float) -> float:
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
    channel = _Channel()
    launched = 0.0
    comms = []
    for index, bucket in enumerate(ddp_buckets(sizes, first_cap_bytes, cap_bytes)):
        launched = max(launched, max(ready[i] for i in bucket))  # DDP launches buckets in order
        nbytes = sum(sizes[i] for i in bucket)
        comms.append(channel.post(0, f"bucket{index}", nbytes, launched, costs.allreduce_s(nbytes)))
    # The rank blocks after its last gradient until every bucket is done; each
    # bucket is charged the part of that wait that ends with it.
    cursor = backward_end
    for comm in sorted(comms, key=lambda c: c.end_s):
        comm.blocked_s = max(0.0, comm.end_s - cursor)
        cursor = max(cursor, comm.end_s)
    update_s = costs.update_s_per_byte * sum(sizes)
    step = backward_end + sum(c.blocked_s for c in comms) + update_s
    return costs.charge_cpu(Prediction(step, comms))


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
    channel = _Channel()
    pending: dict[int, tuple[PredictedComm, PredictedComm]] = {}
    begins = []
    t = 0.0
    for step in range(steps):
        begin = t
        begins.append(begin)
        t += costs.other_s
        acts: dict[int, PredictedComm] = {}
        for i, layer in enumerate(layers):
            if i in replicated:
                fc = layer.fc
                if i in pending:  # deferred full-batch gradient and update (lines 7-9)
                    gather_a, gather_e = pending.pop(i)
                    t = _wait(gather_e, _wait(gather_a, t))
                    t += fc.full_wgrad_s + upd * layer.nbytes
                nbytes = world * fc.rows * fc.in_features * ELEMENT_BYTES
                acts[i] = channel.post(
                    step, f"gather_{layer.name}_acts", nbytes, t, costs.allgather_s(nbytes)
                )
            t += layer.forward_s
        chunk1 = chunk2 = None
        for i in reversed(range(n)):
            layer = layers[i]
            saved = layer.fc.local_wgrad_s if i in replicated else 0.0
            t += max(0.0, layer.backward_s - saved)
            if i == n - k and bytes1:  # backprop has passed the last k layers (erratum: l = L-k)
                chunk1 = channel.post(step, "chunk1", bytes1, t, chunk_allreduce_s(costs, bytes1))
        if bytes2:
            chunk2 = channel.post(step, "chunk2", bytes2, t, chunk_allreduce_s(costs, bytes2))
        if chunk1 is not None:
            t = _wait(chunk1, t) + upd * bytes1
        if chunk2 is not None:
            t = _wait(chunk2, t)
        for i in sorted(replicated):
            nbytes = world * layers[i].fc.rows * layers[i].fc.out_features * ELEMENT_BYTES
            errors = channel.post(
                step, f"gather_{layers[i].name}_errors", nbytes, t, costs.allgather_s(nbytes)
            )
            pending[i] = (acts[i], errors)
        t += upd * bytes2
    begins.append(t)
    # Step `steps - 2` is steady; its FC gathers were waited for in the last step.
    steady = steps - 2
    origin = begins[steady]
    comms = [
        replace(c, posted_s=c.posted_s - origin, start_s=c.start_s - origin, end_s=c.end_s - origin)
        for s, c in channel.posted
        if s == steady
    ]
    return costs.charge_cpu(Prediction(begins[steady + 1] - origin, comms))


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
