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
   calibrated Δ(k) (:mod:`~tunekit.plugins.hybrid_mp.executor_sim`): per-device
   run order, blocking receives, each value's transfer over the measured
   point-to-point link (latency + bytes / bandwidth, one message at a time per
   pair of ranks), and the executor's own costs measured in this process
   (:mod:`~tunekit.plugins.hybrid_mp.executor_costs`: its interpreter per fx node,
   an autograd call per backward segment).
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

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tunekit.api import Calibration, ComputeRate, StepTruth
from tunekit.plugins.hybrid_mp.executor_costs import ExecutorOverheads, Link
from tunekit.plugins.hybrid_mp.executor_sim import ExecutorStep, simulate_executor
from tunekit.plugins.hybrid_mp.model import OpGraph

__all__ = ["HybridPrediction", "HybridStepModel"]


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
