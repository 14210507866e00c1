"""What a plan costs on this machine when this plugin's executor runs it, relative to the measured baseline.

The paper's Eq. 1 (``model.py``) prices a plan as DeePa runs it: per-layer
compute, a transfer per re-split, and a per-layer weight update that is zero
for channel-split layers. The baseline the plan is compared with is not
DeePa's image parallelism but the job as measured (DDP, ``obs.truth``), and
the plan does not run on DeePa but on :mod:`~tunekit.plugins.layer_split.runtime`,
whose costs differ from both:

* **compute** -- the layers' slices, each timed standalone on the rank's
  threads (``compute`` table, on the thread's CPU clock: the layers add up to
  the model's forward and backward), summed along the step: the largest
  worker of every layer, one layer after the other;
* **executor work** -- per layer, the executor assembles each input region,
  detaches it into a leaf, back-propagates the layer on its own and adds the
  input gradients into zero-initialised buffers; per step it concatenates all
  gradients, all-reduces them and copies them back. MEASURED here
  (:func:`measure_executor_overhead`): a step of the executor on one rank
  (every layer whole, no messages) against DDP's step on a one-rank group,
  whose gradient hooks and bucket copies the baseline's rank does too (the
  plain forward and backward where no such group can be made);
* **communication** -- point-to-point messages of every re-split and halo,
  forward activations and backward gradients (the ``exact`` transfer tables:
  bytes not already on the device plus a latency per message, at the probed
  p2p fit), and ONE all-reduce of every gradient after backward, exposed in
  full: DDP overlaps its buckets with backward, the executor cannot (its
  backward is layer by layer);
* **data** -- every rank builds the whole global batch (each rank needs the
  samples of any layer it computes), ``world`` times the baseline's.

:class:`CalibratedModel` first reproduces the baseline: the image-parallel
plan's compute (what DDP computes) is fitted to the measured compute, the
probed all-reduce of the gradients to the measured communication (DDP exposes
the measured share of it), the data to the measured data time
(:class:`tunekit.costmodel.Calibration`). Then a plan is the measured step plus
the scaled change of each part. The scales carry this machine's load: on a
CPU shared with other processes a CPU-clock second of compute takes several
seconds of wall time, and the same factor applies to the executor's own CPU
work.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tunekit.api import Calibration
from tunekit.plugins.layer_split.model import (
    CostOptions,
    SplitConfig,
    Tables,
    build_tables,
    specs_from_graph,
)
from tunekit.plugins.layer_split.search import Plan, evaluate, named_configs, search

PARTS = ("compute", "comm_exposed", "data")
"""The step parts a plan changes (``tunekit.observe.breakdown.PARTS`` names); the
optimizer and idle time carry over as measured."""


# -- the executor's own work, measured ---------------------------------------------------------


@dataclass(frozen=True)
class ExecutorOverhead:
    """One rank's step through the executor against DDP's and the plain step, on one clock."""

    plain_s: float
    """Forward, loss and backward of the whole model on one rank's batch."""
    executor_s: float
    """The same step through the executor (every layer whole on one rank: no messages)."""
    clock: str
    """``thread_cpu`` or ``wall`` (:func:`tunekit.observe.layer_profile.timing_clock`)."""
    repeats: int = 0
    ddp_s: float | None = None
    """The same step through DDP on a one-rank group (its gradient hooks and bucket copies;
    the all-reduce itself runs on gloo's threads); None where this process belongs to a
    larger group (a rank of a running job: DDP would wait for its peers)."""

    @property
    def reference_s(self) -> float:
        """What the baseline's rank does for the same step: DDP's, else the plain step."""
        return self.ddp_s if self.ddp_s is not None else self.plain_s

    @property
    def overhead_s(self) -> float:
        """What the executor adds per step over the baseline's rank (never negative: a noisy
        sample is not a saving)."""
        return max(0.0, self.executor_s - self.reference_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plain_s": self.plain_s,
            "executor_s": self.executor_s,
            "clock": self.clock,
            "repeats": self.repeats,
            "ddp_s": self.ddp_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecutorOverhead:
        return cls(
            **{k: data.get(k) for k in ("plain_s", "executor_s", "clock", "repeats", "ddp_s")}
        )


def measure_executor_overhead(
    workload,
    graph,
    batch: int,
    *,
    threads: int | None = None,
    device: str = "cpu",
    rounds: int | None = None,
    block: int = 6,
    warmup: int = 2,
    budget_s: float = 30.0,
    least_rounds: int = 2,
) -> ExecutorOverhead:
    """Time one rank's step of ``batch`` samples through the executor, through DDP and plainly.

    The executor runs as a world of one with every layer whole: the same
    per-layer work a rank of the real job does (region assembly, detached
    leaves, per-layer backward, gradient buffers, the flat gradient copy),
    without the messages, which the transfer tables price. DDP (the baseline's
    strategy, with the session's settings) runs on a one-rank group: its
    gradient hooks and bucket copies are work the baseline's rank does too, so
    the executor's overhead is counted over DDP's, not over a bare step (for
    AlexNet's 57 M parameters both copy every gradient: 0.3-0.4 s of CPU).

    The three run in blocks of ``block`` steps (the first ``warmup`` of each
    untimed), the blocks alternating for ``rounds`` rounds: step after step of
    one kind is the steady state a rank is in (alternating single steps costs
    the executor ~2x its real overhead, in page faults as the allocator
    switches between memory patterns), and alternating blocks puts a burst of
    load on all alike. Each figure is the median over rounds of its blocks'
    medians, on the clock layer timings use (the compute table's units).
    ``rounds`` (None: as many, from ``least_rounds`` to 5, as fit ``budget_s`` of the
    clock, judged from one plain step): on a shared CPU one block's median varies by
    ~10%, and five rounds bring the example CNN's overhead to within ~2 ms.
    """
    from tunekit.api import DDPSync, intra_op_threads, single_rank_group, timing_clock
    from tunekit.plugins.layer_split.runtime import PlanExecutor

    if (rounds is not None and rounds < 1) or least_rounds < 1 or block <= warmup:
        raise ValueError("need at least one round and a block longer than its warm-up")
    with intra_op_threads(threads), single_rank_group():
        # DDP runs alone only in a group of one: a rank of a running job has peers to wait for.
        ddp_alone = dist.get_world_size() == 1
        torch.manual_seed(0)
        model = workload.model().to(device).train()
        inputs, targets = workload.example_batch(batch)
        inputs, targets = inputs.to(device), targets.to(device)
        specs = specs_from_graph(graph, batch)
        executor = PlanExecutor(
            model, graph, {v: SplitConfig() for v in specs}, batch, rank=0, world=1
        )
        clock, name = timing_clock(device)
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        models = [model]

        def plain() -> None:
            workload.loss(model(inputs), targets).backward()

        def through_executor() -> None:
            executor.step(inputs, targets, workload.loss)

        actions = {"plain": plain, "executor": through_executor}
        if ddp_alone:
            # A copy: DDP's gradient hooks would otherwise fire in the executor's backward too.
            ddp = DistributedDataParallel(
                copy.deepcopy(model),
                device_ids=[torch.device(device).index] if device != "cpu" else None,
                **DDPSync().ddp_kwargs(),
            )
            models.append(ddp)

            def through_ddp() -> None:
                workload.loss(ddp(inputs), targets).backward()

            actions["ddp"] = through_ddp

        def reset() -> None:
            for m in models:
                m.zero_grad(set_to_none=True)

        if rounds is None:
            start = clock()
            plain()
            reset()
            per_step = max(clock() - start, 1e-6)
            fit = int(budget_s / (len(actions) * block * per_step))
            rounds = max(least_rounds, min(5, fit))
        medians = _block_medians(actions, reset, clock, sync, rounds, block, warmup)
    return ExecutorOverhead(
        medians["plain"],
        medians["executor"],
        name,
        rounds * (block - warmup),
        medians.get("ddp"),
    )


def _block_medians(
    actions: Mapping[str, Callable[[], None]],
    reset: Callable[[], None],
    clock: Callable[[], float],
    sync: Callable[[], None],
    rounds: int,
    block: int,
    warmup: int,
) -> dict[str, float]:
    """Each action's median over ``rounds`` of its block's median step (see
    :func:`measure_executor_overhead` for why blocks, alternating)."""
    medians: dict[str, list[float]] = {key: [] for key in actions}
    for _ in range(rounds):
        for key, action in actions.items():
            times = []
            for _ in range(block):
                sync()
                start = clock()
                action()
                sync()
                times.append(clock() - start)
                reset()
            medians[key].append(statistics.median(times[warmup:]))
    return {key: statistics.median(values) for key, values in medians.items()}


# -- the model -----------------------------------------------------------------------------------


@dataclass
class ExecutorModel:
    """Per-step figures, by part, of plans run by the executor and of the DDP baseline.

    Compute is in the compute table's units (the timing clock); communication
    is already in seconds of the job (see :meth:`CalibratedModel.fit`).
    """

    tables: Tables
    """Eq. 1's tables with the measured compute (paper conventions: kept for the plan table)."""
    exact: Tables
    """The same compute with ``exact`` transfers (what the executor's messages move)."""
    overhead: ExecutorOverhead
    allreduce_s: float
    """The executor's all-reduce of every gradient, exposed in full, in the job's seconds
    (the probed fit at the compute scale)."""
    baseline_comm_s: float
    """DDP's exposed communication: measured, or the probed all-reduce without a profile."""
    p2p_scale: float
    """Factor from the probed p2p fit to the job's messages (the compute scale: on a
    shared CPU a message waits for the other rank to be scheduled, as compute does)."""
    data_s: float
    """Getting one rank's batch, as measured in the baseline."""
    world: int

    def image(self) -> dict[str, SplitConfig]:
        return named_configs(self.tables.specs, self.tables.spaces, "image")

    def compute_s(self, configs: Mapping[str, SplitConfig]) -> float:
        return evaluate(self.tables, configs).totals()["compute_s"]

    def p2p_s(self, configs: Mapping[str, SplitConfig]) -> float:
        """The plan's messages, forward and backward, at the job's scale."""
        return self.p2p_scale * evaluate(self.exact, configs).totals()["xfer_s"]

    def baseline_parts(self) -> dict[str, float]:
        """The DDP baseline: the image-parallel compute, DDP's exposed communication, the
        data of one rank's batch."""
        return {
            "compute": self.compute_s(self.image()),
            "comm_exposed": self.baseline_comm_s,
            "data": self.data_s,
        }

    def plan_parts(self, configs: Mapping[str, SplitConfig]) -> dict[str, float]:
        """A plan on the executor: its slices plus the executor's work; its messages plus the
        unoverlapped all-reduce; the whole batch on every rank."""
        return {
            "compute": self.compute_s(configs) + self.overhead.overhead_s,
            "comm_exposed": self.p2p_s(configs) + self.allreduce_s,
            "data": self.world * self.data_s,
        }


@dataclass
class CalibratedModel:
    """:class:`ExecutorModel` fitted to the measured baseline (see the module docstring)."""

    model: ExecutorModel
    calibration: Calibration
    notes: list[str] = field(default_factory=list)

    @classmethod
    def fit(
        cls,
        truth,
        tables: Tables,
        exact: Tables,
        overhead: ExecutorOverhead,
        probed_allreduce_s: float,
        world: int,
    ) -> CalibratedModel:
        """Reproduce the measured baseline, then price plans as changes to it.

        * compute: the image-parallel plan's slices (DDP's compute) fitted to the
          measured compute; the factor (this machine's CPU-clock-to-step ratio,
          the load of a shared machine included) applies to every plan's slices
          and to the executor's own work, measured on the same clock;
        * communication: DDP's exposed communication as measured; the executor's
          all-reduce of the same gradients, exposed in full, and its messages
          from the probed fits at the compute factor: on a shared CPU, gloo's
          loopback transfers are CPU work and waits for the other rank to be
          scheduled, slowed as compute is (DDP's measured total communication
          is no measure of it: stretched by running beside backward on the same
          cores, it came to 3-10x the exposed all-reduce on example:cnn);
          The all-reduce is capped at DDP's measured communication
          (:func:`executor_allreduce_s`).
        * data: the measured time of one rank's batch, ``world`` times over.
        """
        compute_image = evaluate(tables, named_configs(tables.specs, tables.spaces, "image"))
        fitted = Calibration.fit(
            truth,
            {"compute": compute_image.totals()["compute_s"], "data": truth.part("data") or 0.0},
        )
        notes = list(fitted.notes)
        scale = fitted.scales["compute"]
        exposed = truth.part("comm_exposed") if truth.profiled else None
        if exposed is None:
            exposed = probed_allreduce_s
            notes.append(
                "comm_exposed: the baseline was not profiled; DDP taken to expose its whole "
                f"probed all-reduce ({probed_allreduce_s * 1e3:.1f} ms)"
            )
        model = ExecutorModel(
            tables=tables,
            exact=exact,
            overhead=overhead,
            allreduce_s=executor_allreduce_s(truth, scale * probed_allreduce_s, notes),
            baseline_comm_s=exposed,
            p2p_scale=scale,
            data_s=truth.part("data") or 0.0,
            world=world,
        )
        calibration = Calibration(
            truth,
            model.baseline_parts(),
            {**fitted.scales, "comm_exposed": 1.0},  # already in the job's seconds
            tuple(notes),
        )
        return cls(model, calibration, notes)

    @property
    def scales(self) -> Mapping[str, float]:
        return self.calibration.scales

    def predict(self, configs: Mapping[str, SplitConfig]) -> float:
        return self.calibration.predict(self.model.plan_parts(configs))

    def baseline_step_s(self) -> float:
        """The model's baseline after calibration: the measured step (by construction)."""
        return self.calibration.reproduces_baseline()

    def changes(self, configs: Mapping[str, SplitConfig]) -> dict[str, float]:
        """Seconds each part adds to (or takes from) the measured step under ``configs``."""
        base, plan = self.model.baseline_parts(), self.model.plan_parts(configs)
        return {p: self.scales[p] * (plan[p] - base[p]) for p in PARTS}

    def executor_work_s(self) -> float:
        """The executor's own per-layer work, in seconds of the job."""
        return self.scales["compute"] * self.model.overhead.overhead_s

    def search_tables(self) -> Tables:
        """Tables whose Eq. 1 optimum is this model's: scaled compute and exact transfers,
        no per-layer update (the executor's one all-reduce is the same for every plan)."""
        t, s = self.model.exact, self.scales["compute"]
        p2p = self.model.p2p_scale
        return replace(
            t,
            compute={v: a * s for v, a in t.compute.items()},
            update={v: np.zeros_like(a) for v, a in t.update.items()},
            update_bytes={v: np.zeros_like(a) for v, a in t.update_bytes.items()},
            xfer=[(u, v, a * p2p) for u, v, a in t.xfer],
            compute_source=f"{t.compute_source}, calibrated",
        )

    def best(self) -> Plan:
        """The plan this model ranks first (elimination over :meth:`search_tables`)."""
        plan = search(self.search_tables(), "best")
        plan.space = "calibrated"
        return plan

    def describe(self, configs: Mapping[str, SplitConfig]) -> dict[str, Any]:
        """JSON-able: prediction, the change of each part, the model's figures and scales."""
        return {
            "predicted_s": self.predict(configs),
            "measured_baseline_s": self.calibration.truth.step_s,
            "changes_s": self.changes(configs),
            "plan_parts": self.model.plan_parts(configs),
            "baseline_parts": self.model.baseline_parts(),
            "scales": dict(self.scales),
            "executor": self.model.overhead.to_dict(),
            "executor_work_s": self.executor_work_s(),
            "allreduce_s": self.model.allreduce_s,
            "notes": list(self.notes),
        }


def executor_allreduce_s(truth, modelled_s: float, notes: list[str]) -> float:
    """The executor's all-reduce of every gradient, in the job's seconds: the probed fit at
    the compute scale (``modelled_s``), but never more than DDP's measured communication
    of the same gradients in the baseline (``truth.comm_total_s``, hidden or not).

    Why the cap: the probe is cached per machine and, on a loaded CPU, one taken at a busy
    moment came out 5x another (an all-reduce of example:cnn's gradients priced 160 ms in
    one study, 23-32 ms in two others); DDP's measured all-reduce moved the same bytes in
    this very job, at its load, stretched by running beside backward, which the executor's
    all-reduce after backward is not. A cap applied is noted in ``notes``."""
    measured = truth.comm_total_s if truth.profiled else None
    if measured is None or modelled_s <= measured:
        return modelled_s
    notes.append(
        f"comm_exposed: the probed all-reduce at the compute scale ({modelled_s * 1e3:.1f} ms) "
        f"is more than DDP's measured communication of the same gradients "
        f"({measured * 1e3:.1f} ms); taken as that"
    )
    return measured


def exact_tables(tables: Tables, hw) -> Tables:
    """``tables``' compute with the ``exact`` transfer and update conventions."""

    def measured(spec, cfg):
        return float(tables.compute[spec.name][tables.spaces[spec.name].index(cfg)])

    return build_tables(
        tables.specs,
        hw,
        tables.ndev,
        CostOptions(xfer="exact", update="exact"),
        measured,
        tables.compute_source,
        tables.spaces,
    )


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes the executor all-reduces per step: every gradient and every batch norm's running stats."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    stats = sum(
        2 * m.running_mean.numel() * m.running_mean.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    )
    return int(grads + stats)


__all__ = [
    "PARTS",
    "CalibratedModel",
    "ExecutorModel",
    "ExecutorOverhead",
    "exact_tables",
    "executor_allreduce_s",
    "gradient_bytes",
    "measure_executor_overhead",
]
