"""The calibrated step model: a placement as this executor runs it, on this machine, against the
measured baseline.

DLPlacer's own figure (:attr:`Placement.speedup`, SU^M = Σ Δ(k) / makespan) assumes
transfers overlap compute, ops run back to back and nothing else costs time. The
executor of :mod:`~tunekit.plugins.hybrid_mp.runtime` runs the placement as
*segments* (maximal runs of fx nodes on one device in the planned order); each
device walks its own segments, forward in order, then backward in reverse;
a segment starts once the values it reads have arrived (blocking ``recv``),
sends its outputs when it ends (``isend``), and in backward returns their
gradients the same way. This module predicts a candidate's step in four moves:

1. **Reproduce the measured baseline** (``obs.truth``) with
   :class:`tunekit.costmodel.Calibration`: the model's compute is Σ Δ(k) over the
   layers (measured layer profile, or FLOPs at the rate the baseline reached),
   scaled so that it equals the measured compute; DDP's exposed communication,
   the optimizer, data loading and idle time are taken as measured (the hybrid
   replaces DDP's exchange with its own and steps only its share of the optimizer).
   On CPU ranks holding every core the layers are scaled to the model's own compute
   (timed alone): the rest of the measured compute ran beside it on the same cores
   (:func:`compute_beside_s`), and a hybrid device computing alone does not pay it.
2. **The model-parallel step**: the executor's segments simulated on the
   calibrated Δ(k) (:func:`simulate_executor`): per-device run order, blocking
   receives, each value's transfer over the measured point-to-point link
   (latency + bytes / bandwidth, one message at a time per pair of ranks), and the
   executor's own costs measured in this process (:class:`ExecutorOverheads`:
   its interpreter per fx node, an autograd call per backward segment).
3. **The data-parallel part**: the gradients each rank owns are all-reduced
   among the N replicas after backward (nothing hides it), parameters used on
   several devices among the M devices of a worker, and the mean loss over the
   world once per step; each at the hardware's measured all-reduce fit. Each
   rank steps the optimizer for the parameters it owns only.
4. **The prediction** = measured step + each part's calibrated change, with
   ``N × B`` samples per step (per sample: divide by it).

Where a piece cannot be measured (the baseline was not profiled, the link
between ranks was not probed) :func:`HybridStepModel.build` says so instead of
guessing.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx

from tunekit.api import Calibration, ComputeRate, StepTruth
from tunekit.plugins.hybrid_mp.model import OpGraph

__all__ = [
    "ExecutorOverheads",
    "ExecutorStep",
    "HybridPrediction",
    "HybridStepModel",
    "Link",
    "simulate_executor",
]


# -- measured pieces ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One message between two ranks: ``latency + bytes / bandwidth`` (a measured fit)."""

    latency: float
    bandwidth: float
    source: str
    residual: float = 0.0
    """Relative RMS error of the fit over its sweep: how far one message may stray."""

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def scaled(self, factor: float) -> Link:
        """The same link with its times multiplied by ``factor``."""
        return Link(self.latency * factor, self.bandwidth / factor, self.source, self.residual)

    @classmethod
    def measured(cls, hardware) -> Link | None:
        """The probe's point-to-point fit between two ranks, or None when none was measured."""
        fit = hardware.fit("p2p", 2)
        if fit is None or not fit.bandwidth > 0:
            return None
        return cls(
            fit.latency,
            fit.bandwidth,
            f"measured {fit.backend} send/recv: {fit.latency * 1e6:.0f} us + "
            f"{fit.bandwidth / 1e9:.2f} GB/s",
            fit.residual,
        )


@dataclass(frozen=True)
class ExecutorOverheads:
    """What the executor costs beyond the layers' own time, measured in this process.

    The executor runs every fx node through :class:`torch.fx.Interpreter` instead of
    the traced model's generated code, calls ``torch.autograd.backward`` once per
    backward segment where a plain step calls it once, and assembles the gradient of
    every value it received (a zero tensor plus each local consumer's gradient) before
    sending it back. Each is timed on the CPU of this process, the minimum over a few
    rounds: a busy machine only ever adds to it, and calibration adds the baseline's
    load to these costs as it does to the layers'.
    """

    node_s: float
    """Extra seconds per fx node the interpreter adds over generated code."""
    backward_call_s: float
    """Seconds of one ``torch.autograd.backward`` call on a tiny graph (the engine's start)."""
    assemble_s_per_byte: float
    """Seconds per byte of a received value to assemble its gradient (zeros, then a sum)."""
    copy_s_per_byte: float | None = None
    """CPU seconds per byte of one gloo message, sender's and receiver's copies together
    (a fresh receive buffer, as the executor's); None where gloo could not be timed."""
    source: str = "measured in this process"

    @classmethod
    def measure(cls, nodes: int = 64, repeats: int = 7) -> ExecutorOverheads:
        return cls(
            _interpreter_overhead(nodes, repeats),
            _backward_call(repeats),
            _assemble_per_byte(repeats),
            _gloo_copy_per_byte(max(2, repeats // 2)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Chain(torch.nn.Module):
    """``nodes`` cheap additions: the interpreter's cost per node shows, not the op's."""

    def __init__(self, nodes: int):
        super().__init__()
        self.nodes = nodes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.nodes):
            x = x + 1.0
        return x


def _best_of(fn: Callable[[], Any], repeats: int, inner: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - start) / inner)
    return best


def _interpreter_overhead(nodes: int, repeats: int) -> float:
    gm = torch.fx.symbolic_trace(_Chain(nodes))
    x = torch.zeros(1)
    graph_nodes = list(gm.graph.nodes)
    runner = torch.fx.Interpreter(gm, garbage_collect_values=False)

    def interpreted() -> None:
        env: dict[torch.fx.Node, Any] = {}
        runner.env = env
        for n in graph_nodes:
            if n.op == "placeholder":
                env[n] = x
            elif n.op != "output":
                env[n] = runner.run_node(n)

    with torch.no_grad():
        compiled = _best_of(lambda: gm(x), repeats, 20)
        walked = _best_of(interpreted, repeats, 20)
    return max(0.0, (walked - compiled) / nodes)


def _backward_call(repeats: int) -> float:
    leaf = torch.ones(1, requires_grad=True)
    grad = torch.ones(1)

    def forward_only() -> None:
        leaf * 2.0

    def forward_backward() -> None:
        torch.autograd.backward([leaf * 2.0], [grad])

    cost = _best_of(forward_backward, repeats, 50) - _best_of(forward_only, repeats, 50)
    leaf.grad = None
    return max(0.0, cost)


_ASSEMBLE_BYTES = 1 << 22  # 4 MiB: past the caches, as activations are


def _assemble_per_byte(repeats: int) -> float:
    value = torch.ones(_ASSEMBLE_BYTES // 4)
    grad = torch.ones_like(value)
    cost = _best_of(lambda: torch.zeros_like(value) + grad, repeats, 5)
    return cost / _ASSEMBLE_BYTES


_COPY_BYTES = 1 << 22


def _gloo_copy_per_byte(repeats: int, messages: int = 8) -> float | None:
    """CPU time per byte of a gloo send/recv between two process groups of this process.

    Two threads form a 2-rank gloo group over an in-memory store, so the message takes
    gloo's real path (its threads, the loopback socket) without starting processes;
    the process's CPU time counts both ends' copies.
    """
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        return None
    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def join(rank: int) -> None:
        with contextlib.suppress(Exception):  # a rank that cannot join leaves None
            groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=20))

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if any(g is None for g in groups):
        return None
    sender, receiver = groups
    src = torch.ones(_COPY_BYTES // 4)

    def message() -> None:
        dst = torch.empty_like(src)
        sent = sender.send([src], 1, 0)
        receiver.recv([dst], 0, 0).wait()
        sent.wait()

    message()  # connections, first buffers
    best = math.inf
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(messages):
            message()
        best = min(best, (time.process_time() - start) / messages)
    return best / _COPY_BYTES


# -- the executor, simulated -----------------------------------------------------------------------


@dataclass
class ExecutorStep:
    """One forward and backward of the split model, as the executor runs it (simulated)."""

    makespan_s: float
    """From the first segment's start to the last backward segment's end, slowest device."""
    busy_s: dict[int, float]
    """Per device: its segments' compute plus the executor's own work (overheads, copies)."""
    transfers: int
    """Messages sent (values forward, their gradients backward)."""
    transfer_bytes: float
    transfer_s: float
    """Time of all messages: each ``latency + bytes / bandwidth``, or on the ranks' cores
    its latency and both ends' copies."""
    segments: int
    overhead_s: float
    """The executor's own work summed over devices (interpreter, autograd calls,
    gradient assembly, copies on the ranks' cores)."""

    @property
    def wait_s(self) -> dict[int, float]:
        """Per device: time spent waiting on other devices."""
        return {d: max(0.0, self.makespan_s - b) for d, b in self.busy_s.items()}

    def scaled(self, factor: float) -> ExecutorStep:
        """The same step with every time multiplied by ``factor`` (model units -> seconds)."""
        return ExecutorStep(
            self.makespan_s * factor,
            {d: b * factor for d, b in self.busy_s.items()},
            self.transfers,
            self.transfer_bytes,
            self.transfer_s * factor,
            self.segments,
            self.overhead_s * factor,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["busy_s"] = {str(k): v for k, v in self.busy_s.items()}
        d["wait_s"] = {str(k): v for k, v in self.wait_s.items()}
        return d


@dataclass
class _Task:
    """One piece of a device's work in the executor's order: a segment, or a message's copy."""

    work: float
    own: float
    """The executor's share of ``work`` (not the layers')."""
    waits: list[tuple[str, str, int]]
    """Messages that must have arrived first: (phase, value, device)."""
    sends: list[tuple[str, str, int]] = field(default_factory=list)
    """Messages it sends when it ends."""


def simulate_executor(
    program,
    forward_s: Mapping[str, float],
    backward_s: Mapping[str, float],
    value_bytes: Mapping[str, float],
    link: Link,
    overheads: ExecutorOverheads,
    copies_on_ranks: bool = False,
) -> ExecutorStep:
    """The step of :class:`~tunekit.plugins.hybrid_mp.runtime.HybridSync` for ``program``.

    ``forward_s`` / ``backward_s`` give each fx node's time, ``value_bytes`` the bytes
    of each value crossing devices. Each device runs, in the executor's own order:

    * its forward segments, each once the values it reads from other devices have
      arrived (blocking receives), sending its outputs when it ends;
    * then its backward segments in reverse, each once the gradient of every output
      read on another device has come back from the first segment there that reads
      it (the one that returns it), returning its inputs' gradients when it ends.

    ``copies_on_ranks``: the ranks' own cores copy every message in and out (CPU
    ranks without spare cores: gloo's threads take the time from the compute), so
    each end spends half of ``overheads.copy_s_per_byte`` (else ``1 / bandwidth``)
    per byte of its device time on it and the message arrives ``latency`` after the
    sender's copy. Otherwise the link carries the message beside the compute
    (``latency + bytes / bandwidth`` after it was sent, one message at a time per
    pair of ranks).
    """
    per_byte = overheads.copy_s_per_byte / 2 if overheads.copy_s_per_byte else 1.0 / link.bandwidth

    def copy_s(value: str) -> float:
        return float(value_bytes.get(value, 0.0)) * per_byte if copies_on_ranks else 0.0

    tasks = _executor_tasks(program, forward_s, backward_s, value_bytes, overheads, copy_s)
    nbytes = {
        (ph, v, d): float(value_bytes.get(v, 0.0))
        for ts in tasks.values()
        for t in ts
        for ph, v, d in t.sends
    }
    run = _run_tasks(tasks, nbytes, link, copies_on_ranks)
    messages = list(nbytes.items())
    return ExecutorStep(
        makespan_s=run["end"],
        busy_s={d: run["busy"].get(d, 0.0) for d in range(program.mp)},
        transfers=len(messages),
        transfer_bytes=sum(b for _, b in messages),
        transfer_s=sum(
            2 * b * per_byte + link.latency if copies_on_ranks else link.time(b)
            for _, b in messages
        ),
        segments=len(program.segments),
        overhead_s=sum(t.own for ts in tasks.values() for t in ts),
    )


def _executor_tasks(program, forward_s, backward_s, value_bytes, overheads, copy_s):
    """Each device's work in the executor's order (see :func:`simulate_executor`)."""
    segs = program.segments
    dev_of = [s.device for s in segs]
    tasks: dict[int, list[_Task]] = {d: [] for d in range(program.mp)}

    def foreign(seg, values):
        return [v for v in values if dev_of[program.producer[v]] != seg.device]

    def add(device: int, work: float, own: float, waits, sends) -> None:
        copies = [(m, copy_s(m[1])) for m in sends]
        if any(c > 0 for _, c in copies):  # the sender copies each message, then it flies
            tasks[device].append(_Task(work, own, waits))
            for m, c in copies:
                tasks[device].append(_Task(c, c, [], [m]))
        else:
            tasks[device].append(_Task(work, own, waits, list(sends)))

    for seg in segs:
        received = foreign(seg, seg.inputs)
        own = overheads.node_s * len(seg.nodes) + sum(copy_s(v) for v in received)
        sends = [
            ("fwd", v, dst)
            for v in seg.outputs
            for dst in sorted({dev_of[c] for c in program.consumers[v]} - {seg.device})
        ]
        work = sum(forward_s.get(n.name, 0.0) for n in seg.nodes) + own
        add(seg.device, work, own, [("fwd", v, seg.device) for v in received], sends)
    floating = {v for s in segs for v in s.outputs if value_bytes.get(v, 0.0) > 0}
    for seg in reversed(segs):
        returned = [
            v
            for v in seg.outputs
            if v in floating and any(dev_of[c] != seg.device for c in program.consumers[v])
        ]
        # gradients this segment returns: the first local consumer of each sums them
        gives = [
            v
            for v in foreign(seg, seg.inputs)
            if v in floating
            and seg.index == next(c for c in program.consumers[v] if dev_of[c] == seg.device)
        ]
        own = (
            overheads.backward_call_s
            + sum(copy_s(v) for v in returned)
            + sum(overheads.assemble_s_per_byte * value_bytes.get(v, 0.0) for v in gives)
        )
        work = sum(backward_s.get(n.name, 0.0) for n in seg.nodes) + own
        waits = [("bwd", v, seg.device) for v in returned]
        add(seg.device, work, own, waits, [("bwd", v, dev_of[program.producer[v]]) for v in gives])
    return tasks


def _run_tasks(tasks, nbytes, link: Link, copies_on_ranks: bool) -> dict[str, Any]:
    """Event by event: devices start their next task once its messages are in; returns the
    end and each device's time working."""
    now = 0.0
    nxt = {d: 0 for d in tasks}
    left: dict[int, float] = {}  # device -> work left of the task it runs
    arrival: dict[tuple[str, str, int], float] = {}
    channel_free: dict[tuple[int, int], float] = {}
    busy: dict[int, float] = {}
    eps = 1e-15

    def emit(device: int, task: _Task) -> None:
        for key in task.sends:
            _, _, dst = key
            if copies_on_ranks:
                arrival[key] = now + link.latency
            else:
                start = max(now, channel_free.get((device, dst), 0.0))
                channel_free[(device, dst)] = start + nbytes[key] / link.bandwidth
                arrival[key] = start + link.time(nbytes[key])

    while True:
        for d, ts in tasks.items():  # start whatever can start now
            if d not in left and nxt[d] < len(ts):
                task = ts[nxt[d]]
                if all(arrival.get(k, math.inf) <= now + eps for k in task.waits):
                    left[d] = task.work
        done = [d for d, w in left.items() if w <= eps]
        if done:  # zero work left: it ends now
            for d in done:
                emit(d, tasks[d][nxt[d]])
                del left[d]
                nxt[d] += 1
            continue
        if not left:
            if all(nxt[d] >= len(ts) for d, ts in tasks.items()):
                return {"end": now, "busy": busy}
            pending = [
                arrival[k]
                for d, ts in tasks.items()
                if nxt[d] < len(ts)
                for k in ts[nxt[d]].waits
                if k in arrival and arrival[k] > now
            ]
            if not pending:
                raise RuntimeError(
                    "executor simulation: every device waits on a message never sent"
                )
            now = min(pending)
            continue
        step = min(left.values())
        later = [
            arrival[k]
            for d, ts in tasks.items()
            if d not in left and nxt[d] < len(ts)
            for k in ts[nxt[d]].waits
            if k in arrival and arrival[k] > now + eps
        ]
        if later:
            step = min(step, min(later) - now)
        for d in left:
            left[d] -= step
            busy[d] = busy.get(d, 0.0) + step
        now += step


TIMES_SOURCES = {
    "measured": "measured layer profile",
    "measured (CPU time)": "layer profile measured in CPU time",
}


BESIDE_SHARE_LIMIT = 0.5
"""At most this share of the measured compute is taken as added by what ran beside it."""


def compute_beside_s(truth: StepTruth, own_compute_s: float | None) -> float:
    """Seconds per step the baseline's measured compute spent above the model's own forward
    and backward (``own_compute_s``: timed alone, at the job's batch, with a rank's
    threads): the other ranks beside it and DDP's overlapped exchange, which gloo runs on
    the same cores. 0 when the own time was not measured."""
    if own_compute_s is None:
        return 0.0
    compute = truth.parts_s.get("compute", 0.0)
    return min(max(0.0, compute - own_compute_s), BESIDE_SHARE_LIMIT * compute)


def copies_on_cores(hardware, world: int, threads_per_rank: int) -> bool:
    """Whether messages between ranks are copied by cores the ranks' compute needs: CPU
    ranks whose threads take every core of the host."""
    ranks = hardware.devices[:world]
    return all(d.kind == "cpu" for d in ranks) and world * threads_per_rank >= hardware.host.cores


# -- the prediction --------------------------------------------------------------------------------


@dataclass
class HybridPrediction:
    """One N × M candidate's predicted step, part by part (seconds, measured units)."""

    step_s: float
    range_s: tuple[float, float]
    global_batch: int
    mp_step: ExecutorStep
    grad_sync_s: float
    """Gradient all-reduces after backward (replicas, shared parameters) and the loss's."""
    optimizer_s: float
    parts: dict[str, float]
    """The candidate's parts as :class:`Calibration` takes them (the model's units)."""
    baseline_per_sample_s: float

    @property
    def per_sample_s(self) -> float:
        return self.step_s / self.global_batch

    @property
    def per_sample_ratio(self) -> float:
        """Candidate time per sample over the baseline's (above 1: slower)."""
        return self.per_sample_s / self.baseline_per_sample_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "range_s": list(self.range_s),
            "global_batch": self.global_batch,
            "per_sample_s": self.per_sample_s,
            "per_sample_ratio": self.per_sample_ratio,
            "mp_step": self.mp_step.to_dict(),
            "grad_sync_s": self.grad_sync_s,
            "optimizer_s": self.optimizer_s,
            "parts": dict(self.parts),
        }


@dataclass
class HybridStepModel:
    """The calibrated model of one observed job (see the module docstring)."""

    truth: StepTruth
    calibration: Calibration
    layer_s: dict[str, tuple[float, float]]
    """Per layer (forward, backward) seconds in the model's units (before calibration)."""
    node_layer: dict[str, str]
    """fx node -> its layer."""
    layer_nodes: dict[str, int]
    """Layer -> how many fx nodes it has (its time is shared among them)."""
    node_bytes: dict[str, float]
    """fx node -> bytes of its output at the job's batch."""
    link: Link
    overheads: ExecutorOverheads
    allreduce: Callable[[float, int], float]
    copies_on_ranks: bool
    """CPU ranks with no spare cores: gloo's copies of every message take the ranks' time."""
    world: int
    batch_size: int
    spread_s: float
    times_source: str
    notes: list[str] = field(default_factory=list)
    accumulation: int = 1
    """Micro-batches per optimizer step: each runs the split model's forward and
    backward (its messages included); the exchanges and the update run once."""

    @property
    def compute_scale(self) -> float:
        return self.calibration.scales["compute"]

    # -- building ---------------------------------------------------------------------------

    @staticmethod
    def missing(truth: StepTruth | None, hardware) -> str | None:
        """Which measured piece the model lacks, as a sentence; None when it has them all."""
        if truth is None:
            return "no measured baseline to calibrate on"
        if not truth.profiled:
            return "the baseline was not profiled, so its compute and communication are unknown"
        if Link.measured(hardware) is None:
            return (
                "the link between ranks was not measured (no point-to-point fit; "
                "`tunekit hardware probe` measures it)"
            )
        return None

    @classmethod
    def build(
        cls,
        *,
        truth: StepTruth | None,
        graph,
        og: OpGraph,
        times_source: str,
        hardware,
        world: int,
        batch_size: int,
        spread_s: float,
        allreduce: Callable[[float, int], float],
        overheads: ExecutorOverheads | None = None,
        threads_per_rank: int = 1,
        accumulation: int = 1,
        own_compute_s: float | None = None,
    ) -> HybridStepModel | str:
        """The model, or why there is none (a sentence for "no prediction: ...")."""
        why = cls.missing(truth, hardware)
        if why is not None:
            return why
        link = Link.measured(hardware)
        notes: list[str] = []
        layer_s = {op.name: (op.forward_s, op.backward_s) for op in og.ops}
        if times_source == "analytic":
            # FLOPs at the rate the baseline reached (not the device's peak): Σ Δ is
            # the measured compute up to what FLOPs do not count
            fwd_flops = (
                sum(lay.flops for lay in graph.layers.values())
                * batch_size
                * accumulation
                / graph.batch_size
            )
            rate = ComputeRate.measured(fwd_flops, truth.parts_s["compute"])
            if rate is not None:
                layer_s = {
                    name: rate.forward_backward_s(
                        graph.layers[name].flops * batch_size / graph.batch_size
                    )
                    for name in layer_s
                }
                times_source = f"FLOPs at the baseline's rate ({rate.source})"
        copies_on_ranks = copies_on_cores(hardware, world, threads_per_rank)
        layers_total = accumulation * sum(f + b for f, b in layer_s.values())
        beside_s = compute_beside_s(truth, own_compute_s) if copies_on_ranks else 0.0
        if beside_s:
            notes.append(
                f"the baseline's compute is {beside_s * 1e3:.1f} ms above the model's own "
                f"({own_compute_s * 1e3:.1f} ms timed alone): the other rank and DDP's "
                "overlapped exchange on the same cores; the layers run at their own speed"
            )
        baseline = {
            # in the model's units: the layers, plus what ran beside them in the baseline
            # on the same cores (a hybrid device computing alone, its exchange after
            # backward in its sync part, does not pay it)
            "compute": layers_total
            * truth.parts_s["compute"]
            / (truth.parts_s["compute"] - beside_s),
            # DDP's exchange and its optimizer step are taken as measured: the hybrid
            # replaces the one with its own exchange and steps a share of the other
            "comm_exposed": truth.parts_s["comm_exposed"],
            "optimizer": truth.parts_s["optimizer"],
        }
        cal = Calibration.fit(truth, baseline)
        notes += list(cal.notes)
        scale = batch_size / graph.batch_size
        node_layer = {n: node.layer for n, node in graph.nodes.items() if node.layer in layer_s}
        counts: dict[str, int] = {}
        for layer in node_layer.values():
            counts[layer] = counts.get(layer, 0) + 1
        return cls(
            truth=truth,
            calibration=cal,
            layer_s=layer_s,
            node_layer=node_layer,
            layer_nodes=counts,
            node_bytes={n: node.activation_bytes * scale for n, node in graph.nodes.items()},
            link=link,
            overheads=overheads or ExecutorOverheads.measure(),
            allreduce=allreduce,
            copies_on_ranks=copies_on_ranks,
            world=world,
            batch_size=batch_size,
            spread_s=spread_s,
            times_source=TIMES_SOURCES.get(times_source, times_source),
            notes=notes,
            accumulation=accumulation,
        )

    # -- predicting -------------------------------------------------------------------------

    def node_times(self) -> tuple[dict[str, float], dict[str, float]]:
        """Each fx node's (forward, backward) time in the model's units: its layer's,
        shared among the layer's nodes."""
        fwd, bwd = {}, {}
        for node, layer in self.node_layer.items():
            f, b = self.layer_s[layer]
            k = self.layer_nodes[layer]
            fwd[node], bwd[node] = f / k, b / k
        return fwd, bwd

    def simulate(self, program) -> ExecutorStep:
        """The executor's forward and backward in the model's units.

        The layers' times and the executor's own costs are CPU work of the ranks:
        calibration scales them all, as the baseline's compute was scaled, by the
        machine's load among other things. The link's figures are seconds as
        measured, so they enter divided by the same scale.
        """
        fwd, bwd = self.node_times()
        link = self.link.scaled(1.0 / self.compute_scale)
        return simulate_executor(
            program, fwd, bwd, self.node_bytes, link, self.overheads, self.copies_on_ranks
        )

    def predict(self, program, param_bytes: Mapping[int, float]) -> HybridPrediction:
        """The step of an N × M hybrid running ``program`` (one worker's split model).

        ``param_bytes`` maps id(parameter) -> its bytes, for the parameters
        ``program.param_devices`` knows. ``mp_step`` is one micro-batch's pass;
        the step runs ``accumulation`` of them.
        """
        m = program.mp
        n = self.world // m
        acc = self.accumulation
        modelled = self.simulate(program)
        mp_step = modelled.scaled(self.compute_scale)
        total = sum(param_bytes.values()) or 1.0
        owned = {
            d: sum(b for pid, b in param_bytes.items() if d in program.param_devices.get(pid, ()))
            for d in range(m)
        }
        shared = sum(
            b for pid, b in param_bytes.items() if len(program.param_devices.get(pid, ())) > 1
        )
        sync = (
            self.allreduce(max(owned.values(), default=0.0), n)
            + self.allreduce(shared, m)
            + self.allreduce(4.0, self.world)  # the mean loss over the global batch
        )
        optimizer = self.truth.parts_s["optimizer"] * max(owned.values(), default=total) / total
        cal = self.calibration
        # Calibration takes each part in the model's units: the executor's step as
        # simulated; the exchanges after backward in seconds (measured fits; nothing hides
        # them as backprop hid part of DDP's), in place of DDP's measured exposed part.
        parts = {"compute": acc * modelled.makespan_s, "comm_exposed": sync, "optimizer": optimizer}
        step = cal.predict(parts)
        return HybridPrediction(
            step_s=step,
            range_s=self.range(step, mp_step, acc),
            global_batch=n * self.batch_size * acc,
            mp_step=mp_step,
            grad_sync_s=sync,
            optimizer_s=optimizer,
            parts=parts,
            baseline_per_sample_s=self.truth.step_s / (self.world * self.batch_size * acc),
        )

    def range(
        self, step_s: float, mp_step: ExecutorStep, micro_batches: int = 1
    ) -> tuple[float, float]:
        """The baseline's spread, widened by how far the link's fit strays on the transfers."""
        low, high = self.calibration.predicted_range(step_s, self.spread_s)
        stray = self.link.residual * mp_step.transfer_s * micro_batches
        return max(low - stray, 1e-9), high + stray

    def describe(self) -> str:
        return (
            f"{self.calibration.describe()}; Δ(k) from the {self.times_source}; "
            f"link {self.link.source}; executor +{self.overheads.node_s * 1e6:.1f} us per fx node, "
            f"+{self.overheads.backward_call_s * 1e6:.0f} us per backward segment (measured here)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "calibration": {
                "scales": dict(self.calibration.scales),
                "notes": list(self.calibration.notes),
                "reproduces_baseline_s": self.calibration.reproduces_baseline(),
            },
            "times": self.times_source,
            "link": asdict(self.link),
            "overheads": self.overheads.to_dict(),
            "notes": list(self.notes),
        }
