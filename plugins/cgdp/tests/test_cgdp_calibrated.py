"""The model calibrated on the measured baseline: it reproduces DDP's step, quotes the truth,
and predicts CGDP as a change to it (issue 16)."""

from __future__ import annotations

import dataclasses
import functools
import random
import re

import pytest
import torch
import torch.distributed as dist

from tunekit.observe.breakdown import Breakdown, CollectiveTiming, RankBreakdown, StepParts
from tunekit.observe.truth import StepTruth
from tunekit.plugins.cgdp.calibrated import (
    HostWork,
    bucket_times,
    calibrate,
    fit_cost,
    waiting_share,
)
from tunekit.plugins.cgdp.inputs import MIN_GAIN, measured_keys
from tunekit.plugins.cgdp.measure import LayerTimes, own_profile
from tunekit.plugins.cgdp.model import (
    AllReduceCost,
    Message,
    MiB,
    ReduceCosts,
    ddp_buckets,
    ddp_timeline,
    drain,
    fit_after_latency,
)
from tunekit.plugins.cgdp.plugin import Cgdp
from tunekit.plugins.cgdp.runtime import parameterised_layers
from tunekit.testing import MemoryCache, local_hardware, synthetic_observation
from tunekit.workload import load_workload

DEEP = "tunekit.plugins.cgdp.tests.workloads_cgdp:deep_narrow"


# -- DDP as the model sees it ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["example:cnn", "tunekit.plugins.cgdp.tests.workloads_cgdp:wide", DEEP]
)
def test_ddp_buckets_are_the_ones_ddp_assigns(spec):
    model = load_workload(spec).model()
    params = list(reversed([p for p in model.parameters() if p.requires_grad]))
    assignment = dist._compute_bucket_assignment_by_size(
        params, [1 * MiB, 25 * MiB], [False] * len(params)
    )[0]
    theirs = [sum(params[i].numel() * 4 for i in bucket) for bucket in assignment]
    layers = list(reversed(parameterised_layers(model)))
    ours = [
        size
        for _, size in ddp_buckets([sum(p.numel() * 4 for p in layer.params) for layer in layers])
    ]
    assert ours == theirs


def test_a_gloo_group_runs_two_collectives_at_once():
    costs = ReduceCosts.uniform(AllReduceCost(1.0, 1e30))
    three = [Message(0.0, 8), Message(0.0, 8), Message(0.0, 8)]
    assert drain(three, 0.0, costs) == 2.0  # two at once, then the third
    assert drain(three, 0.0, costs, lanes=1) == 3.0


def test_a_reduction_speeds_up_when_backward_ends():
    costs = ReduceCosts(AllReduceCost(4.0, 1e30), AllReduceCost(1.0, 1e30))
    # posted at 0, backward ends at 2: half done at the slow speed, the rest at the fast one
    assert drain([Message(0.0, 8)], 2.0, costs) == pytest.approx(2.5)


def test_the_after_backward_latency_reproduces_the_measured_exposed_communication():
    # buckets of 2 MiB (after layer 1) and 18 MiB (at backward's end: 94 ms of bytes)
    t_bp, nbytes = [0.01] * 10, [2 * MiB] * 10
    during = AllReduceCost(0.004, 0.2e9)
    latency = fit_after_latency(t_bp, nbytes, during, during.bandwidth, 0.15)
    assert latency == pytest.approx(0.15 - 18 * MiB / 0.2e9, abs=1e-5)
    costs = ReduceCosts(during, AllReduceCost(latency, during.bandwidth))
    assert ddp_timeline(t_bp, nbytes, costs).exposed_s == pytest.approx(0.15, abs=1e-5)
    # less exposed than the last bucket's bytes alone take: no latency does it
    assert fit_after_latency(t_bp, nbytes, during, during.bandwidth, 0.05) is None


# -- measured inputs, robust to load ----------------------------------------------------------


def test_layer_times_are_each_layers_own_cost_so_slowed_passes_change_nothing():
    passes = [[1.0, 2.0, 3.0]] * 4 + [[1.0, 50.0, 3.0]]  # one pass descheduled in layer 2
    assert own_profile(passes) == pytest.approx([1.0, 2.0, 3.0])
    # passes slowed throughout: the layers keep their own (unslowed) costs
    slowed_throughout = [[2.0, 4.0, 6.0]] * 3 + [[1.0, 2.0, 3.0]] * 2
    assert own_profile(slowed_throughout) == pytest.approx([1.0, 2.0, 3.0])
    # most passes waited somewhere, each in another layer: no layer moves
    waited = [[1.0, 2.0, 3.0]] * 3 + [[9.0, 2.0, 3.0], [1.0, 9.0, 3.0], [1.0, 2.0, 9.0]] * 2
    assert own_profile(waited) == pytest.approx([1.0, 2.0, 3.0])
    # backward's share of the step comes from the layers' own costs, forward's and backward's
    times = LayerTimes.from_passes(["a", "b", "c"], [4, 4, 4], [[1.0, 1.0, 1.0]] * 9, waited)
    assert times.t_bp == pytest.approx([1.0, 2.0, 3.0])
    assert times.backward_share == pytest.approx(6.0 / 9.0)


def _step(rank: int, i: int, exposed: float, total: float, colls=()) -> StepParts:
    return StepParts(
        step=i, total_s=total, compute_s=total - exposed, comm_exposed_s=exposed, data_s=0.0,
        optimizer_s=0.0, idle_s=0.0, comm_total_s=sum(c.own_s for c in colls),
        collectives=list(colls),
    )  # fmt: skip


def _breakdown(rank_steps: list[list[StepParts]]) -> Breakdown:
    return Breakdown(
        [RankBreakdown(r, "cpu", "markers", steps) for r, steps in enumerate(rank_steps)]
    )


def test_waiting_for_the_slower_rank_is_told_apart_from_exposed_communication():
    # rank 0 computes 90 ms and is exposed 10 ms; rank 1 computes 70 ms and waits 30 ms
    bd = _breakdown(
        [[_step(0, i, 0.010, 0.1) for i in range(3)], [_step(1, i, 0.030, 0.1) for i in range(3)]]
    )
    assert waiting_share(bd) == pytest.approx((0.020 - 0.010) / 0.1)
    assert waiting_share(None) == 0.0


def test_the_allreduce_during_backward_is_fitted_to_ddps_own_buckets_in_the_trace():
    buckets = [9 * MiB, 25 * MiB, 8 * MiB]
    true = AllReduceCost(0.010, 0.15e9)

    def colls(jitter: float):
        return [CollectiveTiming("gloo:broadcast", 0.0, 0.001, 0.0)] + [
            CollectiveTiming("gloo:all_reduce", 0.1, true(b) + jitter, 0.0) for b in buckets
        ]

    # the rank that posted first also waited for its peer: the other one's times count
    bd = _breakdown([
        [_step(0, i, 0.0, 1.0, colls(0.0)) for i in range(3)],
        [_step(1, i, 0.0, 1.0, colls(0.05)) for i in range(3)],
    ])  # fmt: skip
    times = bucket_times(bd, len(buckets))
    assert [times.median(i) for i in range(3)] == pytest.approx([true(b) for b in buckets])
    fitted = fit_cost(
        [(b, times.median(i)) for i, b in enumerate(buckets[:2])], AllReduceCost(0, 1e9)
    )
    assert fitted.latency == pytest.approx(true.latency) and fitted.bandwidth == pytest.approx(
        true.bandwidth
    )
    assert bucket_times(bd, 2) is None  # the trace's all-reduces are not the model's buckets


# -- reproducing the measured baseline ----------------------------------------------------------


def _truth(step: float, **fractions: float) -> StepTruth:
    parts = {
        p: fractions.get(p, 0.0) * step
        for p in ("compute", "comm_exposed", "data", "optimizer", "idle")
    }
    return StepTruth(step_s=step, parts_s=parts)


def test_the_calibrated_model_reproduces_the_measured_baseline():
    truth = _truth(0.200, compute=0.7, comm_exposed=0.2, data=0.05, optimizer=0.05)
    t_bp = [0.001 * (i + 1) for i in range(12)]  # timed alone: 78 ms of backward
    nbytes = [0.5 * MiB] * 12
    host = HostWork(
        post_s=50e-6, copy_s_per_byte=1 / 5e9, optimizer_s=0.004, offload_optimizer_s=0.005
    )
    model = calibrate(truth, t_bp, nbytes, 0.6, AllReduceCost(1e-3, 0.4e9), host)
    assert model.reproduces_baseline() == pytest.approx(truth.step_s, rel=1e-9)
    ddp = model.ddp_parts()
    assert ddp["compute"] == pytest.approx(truth.parts_s["compute"])
    assert ddp["comm_exposed"] == pytest.approx(truth.parts_s["comm_exposed"], rel=1e-4)
    # backward is the measured compute's backward share, spread as the layers' times are
    assert sum(model.t_bp) == pytest.approx(0.7 * 0.2 * 0.6)
    assert model.t_bp[5] / model.t_bp[0] == pytest.approx(6.0)
    assert model.calibration.scales["compute"] == pytest.approx(1.0)
    assert model.calibration.scales["comm_exposed"] == pytest.approx(1.0, rel=1e-3)
    # a candidate is the measured step plus its modelled change
    k = 3
    change = sum(model.calibration.scales[p] * (model.cgdp_parts(k)[p] - ddp[p]) for p in ddp)
    assert model.predict(k) == pytest.approx(truth.step_s + change)
    # offload adds its measured host step, scaled as the measured optimizer part is
    extra = model.predict(k, offload=True) - model.predict(k)
    assert extra == pytest.approx((0.005 - 0.004) * (0.05 * 0.2 / 0.004))


def _observation(exposed: float = 0.2, rates: dict | None = None):
    """deep_narrow's baseline, 50 ms with ``exposed`` of it exposed communication; ``rates``:
    this machine's host rates measured by an earlier diagnosis (they take ~20 s under load,
    and their own stability is benchmarks/host_link_stability.py's subject)."""
    fractions = {"compute": 0.9 - exposed, "comm_exposed": exposed, "data": 0.05, "optimizer": 0.05}
    obs = synthetic_observation(DEEP, hardware=local_hardware(2), step_s=0.05, breakdown=fractions)
    obs.cache.data.update(rates or {})
    return obs


@pytest.fixture(scope="module")
def rates() -> dict:
    obs = _observation()
    Cgdp().diagnose(obs)
    return {k: v for k, v in obs.cache.data.items() if k.startswith("cgdp:rates")}


def test_diagnosis_quotes_the_measured_truth_and_labels_the_model(rates):
    obs = _observation(0.2, rates)
    d = Cgdp().diagnose(obs)
    truth = obs.truth
    assert d.summary.startswith(
        truth.phrase("comm_exposed")
    )  # "exposed communication 20% ... measured"
    assert "model, calibrated on the measured 50.0 ms step" in d.summary
    # the only exposed-communication share it states is the measured one
    assert re.findall(r"exposed communication (\d+)%", d.summary) == ["20"]
    assert d.details["reproduces_baseline_s"] == pytest.approx(truth.step_s)
    assert d.details["calibrated"] and d.details["truth"] == truth.describe()
    low, high = d.details["gain_vs_ddp_interval"]
    assert low <= d.details["gain_vs_ddp"] <= high
    assert d.details["verdict"] == (
        "too_close"
        if low <= 0.01 < high
        else "gain"
        if d.details["gain_vs_ddp"] > 0.01
        else "no_gain"
    )
    assert "host link" not in d.summary  # CPU ranks: one gloo all-reduce either way


def test_plan_predicts_relative_to_the_measured_step_with_ranges(rates):
    obs = _observation(0.2, rates)
    plan = Cgdp().plan(obs, 50)
    assert [c.predicted_step_s for c in plan] == sorted(c.predicted_step_s for c in plan)
    for c in plan:
        low, high = c.predicted_range_s
        assert low <= c.predicted_step_s <= high
        assert "calibrated on the measured 50.0 ms baseline" in c.rationale
    # CGDP can hide at most the exposed communication (and, on CPU ranks, saves DDP's copy of
    # its buckets back into the gradients): no candidate beats the step without them
    d = Cgdp().diagnose(obs)
    copy_back = (
        d.details["gradient_bytes"] / (d.details["copy_gbs"] * 1e9) * d.details["contention"]
    )
    floor = obs.truth.step_s - obs.truth.parts_s["comm_exposed"] - copy_back
    assert all(c.predicted_step_s >= floor for c in plan)
    assert sum(1 for c in plan if c.knobs.get("offload_optimizer")) == 1


# -- one observation, one verdict, however busy the machine that timed it ------------------------

# deep_narrow's layers timed alone on the development machine: each one's own backward cost
# (µs, output end first) and forward cost; host rates and optimizer steps as measured there.
LAYER_BACKWARD_US = [232, 80, 69, 66, 67, 68, 66, 67, 66, 65, 67, 65]
LAYER_BACKWARD_US += [67, 65, 64, 64, 65, 66, 64, 67, 69, 66, 66, 63]
LAYER_FORWARD_US = 58
RECORDED_HOST = {
    "add_per_core": {"value": 16.2e9, "low": 9.26e9, "high": 16.7e9},
    "sync": 12.6e-6,
    "d2h": {"value": 13.6e9, "low": 13.4e9, "high": 16.9e9},
    "h2d": {"value": 13.6e9, "low": 13.4e9, "high": 16.9e9},
}
RECORDED_OFFLOAD = {"device_s": 0.00037, "offload_s": 0.00045, "samples": {}}


def _timed_passes(rng, waiting: float, passes: int = 9) -> tuple[list, list]:
    """What the layer timing records on a machine where a share ``waiting`` of the passes
    wait to be scheduled back once in forward and once in backward: each layer's own cost
    (±3 % jitter), and the wait (2-15 ms, as measured with 8 busy processes on 2 cores: as
    long as the whole pass or five times longer) in a random layer."""
    forward, backward = [], []
    for _ in range(passes):
        fwd = [LAYER_FORWARD_US * 1e-6 * rng.uniform(0.97, 1.03) for _ in LAYER_BACKWARD_US]
        bwd = [us * 1e-6 * rng.uniform(0.97, 1.03) for us in LAYER_BACKWARD_US]
        for row in (fwd, bwd):
            if rng.random() < waiting:
                row[rng.randrange(len(row))] += rng.uniform(0.002, 0.015)
        forward.append(fwd)
        backward.append(bwd)
    return forward, backward


@functools.cache
def _near_threshold():
    """One observation: exposed communication 35 % of a steady 50 ms step."""
    fractions = {"compute": 0.55, "comm_exposed": 0.35, "data": 0.05, "optimizer": 0.05}
    return synthetic_observation(
        DEEP, hardware=local_hardware(2), step_s=0.05, breakdown=fractions, spread=0.004
    )


def _diagnosed_with(timed: tuple[list, list]):
    """cgdp's diagnosis of that observation, in a study of its own (a fresh cache) that timed
    the layers as ``timed`` says and measured the recorded host figures."""
    obs = dataclasses.replace(_near_threshold(), cache=MemoryCache())
    layers = list(reversed(parameterised_layers(obs.workload.model())))
    nbytes = [sum(p.numel() * p.element_size() for p in layer.params) for layer in layers]
    times = LayerTimes.from_passes([layer.name for layer in layers], nbytes, *timed)
    keys = measured_keys(obs, torch.device("cpu"))
    # SGD with momentum: one buffer per parameter
    obs.cache.put(
        keys["layers"], {**times.to_dict(), "state_bytes": sum(nbytes), "source": "recorded"}
    )
    obs.cache.put(keys["host"], RECORDED_HOST)
    obs.cache.put(keys["offload"], RECORDED_OFFLOAD)
    return Cgdp().diagnose(obs)


@pytest.mark.parametrize("waiting", [0.3, 0.7])
def test_one_observation_keeps_its_verdict_however_busy_the_machine_that_timed_it(waiting):
    # A verdict near its threshold: timed on a quiet machine, CGDP gains, the low end of its
    # range within half a point of the 1 % it must gain.
    rng = random.Random(29)
    quiet = _diagnosed_with(_timed_passes(rng, 0.0))
    low = quiet.details["gain_vs_ddp_interval"][0]
    assert quiet.details["verdict"] == "gain" and MIN_GAIN < low < MIN_GAIN + 0.005
    # Timed again and again while other work keeps the cores busy, the layers' passes wait
    # (the per-pass medians this replaced swung the gain from 0.8 % to 1.9 %: too_close, gain)
    busy = [_diagnosed_with(_timed_passes(rng, waiting)) for _ in range(6)]
    assert [d.details["verdict"] for d in busy] == ["gain"] * 6
    for d in busy:
        assert d.details["gain_vs_ddp"] == pytest.approx(quiet.details["gain_vs_ddp"], abs=0.001)
        assert d.details["gain_vs_ddp_interval"] == pytest.approx(
            quiet.details["gain_vs_ddp_interval"], abs=0.001
        )


def test_without_a_measured_baseline_the_model_says_it_is_uncalibrated(rates):
    obs = _observation(0.2, rates)
    obs.baseline, obs.breakdown = None, None
    d = Cgdp().diagnose(obs)
    assert d.summary.startswith("no measured baseline: model figures only")
    assert "model, uncalibrated" in d.summary and "measured" not in d.summary.split(";", 1)[1]
    assert not d.details["calibrated"]
    plan = Cgdp().plan(obs, 3)
    assert all("uncalibrated: no measured baseline" in c.rationale for c in plan)
