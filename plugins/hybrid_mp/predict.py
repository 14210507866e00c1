"""The calibrated prediction of a placement for an observed job: the step model built on
the measured baseline (:mod:`~tunekit.plugins.hybrid_mp.calibrated`), the executor's
segments for the placement, and SU^M in measured units."""

from __future__ import annotations

import statistics

import torch

from tunekit.api import Observation, effort_repeats, intra_op_threads, time_steps
from tunekit.plugins.hybrid_mp.calibrated import (
    HybridPrediction,
    HybridStepModel,
    copies_on_cores,
)
from tunekit.plugins.hybrid_mp.convergence import allreduce_model
from tunekit.plugins.hybrid_mp.executor_costs import ExecutorOverheads
from tunekit.plugins.hybrid_mp.inputs import model_graph, threads_per_rank
from tunekit.plugins.hybrid_mp.model import OpGraph
from tunekit.plugins.hybrid_mp.placement_codec import nodes_of
from tunekit.plugins.hybrid_mp.schedule import Placement
from tunekit.plugins.hybrid_mp.split_program import SplitProgram, build_program

OVERHEADS_KEY = "hybrid_mp:executor_overheads"


OWN_COMPUTE_KEY = "hybrid_mp:own_compute_s"


def step_model(obs: Observation, og: OpGraph, source: str) -> HybridStepModel | str:
    """The calibrated step model of this job, or why there is none."""
    why = HybridStepModel.missing(obs.truth, obs.hardware)
    if why is not None:
        return why
    overheads = obs.cached(  # diagnose and plan quote the same measurement
        OVERHEADS_KEY,
        lambda: ExecutorOverheads.measure(repeats=effort_repeats(7, 3)),
        encode=ExecutorOverheads.to_dict,
        decode=lambda hit: ExecutorOverheads(**hit),
    )
    threads = threads_per_rank(obs)
    own = None
    if copies_on_cores(obs.hardware, obs.nproc, threads):
        own = own_compute_s(obs, threads)
    return HybridStepModel.build(
        truth=obs.truth,
        graph=model_graph(obs),
        og=og,
        times_source=source,
        hardware=obs.hardware,
        world=obs.nproc,
        batch_size=obs.workload.batch_size,
        accumulation=obs.workload.accumulation,
        spread_s=obs.baseline.spread_s if obs.baseline is not None else 0.0,
        allreduce=allreduce_model(obs.hardware),
        overheads=overheads,
        threads_per_rank=threads,
        own_compute_s=own,
    )


def own_compute_s(obs: Observation, threads: int) -> float:
    """The job's forward and backward at its batch (its micro-batches), timed in this process
    alone with a rank's threads (median of three after a warm-up; cached per observation):
    the model's own compute, which the baseline's measured compute exceeds by what ran
    beside it on the same cores."""

    def measure() -> float:
        b = obs.workload.batch_size
        with intra_op_threads(threads):
            timing = time_steps(obs.workload, (b,), repeats=3)
        return statistics.median(timing.part_samples("compute")[b]) * obs.workload.accumulation

    return obs.cached(OWN_COMPUTE_KEY, measure, decode=float)


def executor_program(
    obs: Observation, model: torch.nn.Module, placement: Placement
) -> SplitProgram:
    """The segments the executor will run for ``placement`` (as a trial builds them)."""
    plan = nodes_of(model_graph(obs), placement)
    return build_program(model, plan["node_device"], plan["order"], len(placement.devices))


def param_bytes_of(model: torch.nn.Module) -> dict[int, float]:
    return {id(p): float(p.numel() * p.element_size()) for p in model.parameters()}


def predict_placement(
    obs: Observation, model: HybridStepModel, placement: Placement
) -> HybridPrediction:
    net = obs.workload.model()
    return model.predict(executor_program(obs, net, placement), param_bytes_of(net))


def calibrated_su(model: HybridStepModel, pred: HybridPrediction) -> float:
    """SU^M as measured units give it: one device's step of B samples (the baseline without
    its exposed exchange) over the M-device worker's step (without the replicas' exchange)."""
    truth = model.truth
    one_device = truth.step_s - truth.parts_s["comm_exposed"]
    worker = pred.step_s - pred.grad_sync_s
    return one_device / worker if worker > 0 else 1.0
