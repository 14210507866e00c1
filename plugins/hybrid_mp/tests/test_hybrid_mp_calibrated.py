"""The calibrated prediction: the measured baseline reproduced, the executor simulated, the
diagnosis quoting the truth, candidates per sample."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tunekit.hardware import GB, CollectiveFit
from tunekit.observe.graph import trace_model
from tunekit.plugins.hybrid_mp.calibrated import compute_beside_s, copies_on_cores
from tunekit.plugins.hybrid_mp.executor_costs import ExecutorOverheads, Link
from tunekit.plugins.hybrid_mp.executor_sim import simulate_executor
from tunekit.plugins.hybrid_mp.inputs import op_graph
from tunekit.plugins.hybrid_mp.options import HybridOptions
from tunekit.plugins.hybrid_mp.plugin import HybridMp
from tunekit.plugins.hybrid_mp.predict import OWN_COMPUTE_KEY, param_bytes_of, step_model
from tunekit.plugins.hybrid_mp.split_program import build_program
from tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp import Branchy, branchy
from tunekit.testing import synthetic_observation, tiny_hardware
from tunekit.workload import Workload

P2P = CollectiveFit("gloo", "p2p", 2, 100e-6, 2 * GB)
FREE = ExecutorOverheads(0.0, 0.0, 0.0)


def probed_hardware(nproc: int = 2, p2p: CollectiveFit | None = P2P):
    """A 2-core host whose two CPU ranks were probed: all-reduce and point-to-point fits."""
    hw = tiny_hardware(nproc, "cpu", cores=nproc)
    fits = hw.collectives + ((p2p,) if p2p is not None else ())
    return dataclasses.replace(hw, collectives=fits)


BREAKDOWN = {"compute": 0.80, "comm_exposed": 0.12, "data": 0.03, "optimizer": 0.04, "idle": 0.01}


def observed(workload: Workload | None = None, **kw):
    workload = workload or branchy()
    workload.extra = {**workload.extra, "hybrid_mp": {"time_limit_s": 10}}
    kw.setdefault("hardware", probed_hardware())
    kw.setdefault("step_s", 0.2)
    kw.setdefault("breakdown", BREAKDOWN)
    return synthetic_observation(workload, **kw)


# -- the executor, simulated ------------------------------------------------------------------


class TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def test_two_stages_wait_for_each_other_both_ways():
    # a on device 0, b on device 1: forward a (1), send (lat 0.5 + 8 B at 4 B/s = 2.5),
    # b forward (2) and backward (3), the gradient back (2.5), a backward (4)
    prog = build_program(TwoStages(), {"a": 0, "b": 1}, {"a": 0.0, "b": 1.0}, mp=2)
    link = Link(latency=0.5, bandwidth=4.0, source="test")
    step = simulate_executor(
        prog, {"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 3.0}, {"a": 8.0}, link, FREE
    )
    assert step.makespan_s == pytest.approx(1 + 2.5 + 2 + 3 + 2.5 + 4)
    assert step.busy_s == {0: pytest.approx(5.0), 1: pytest.approx(5.0)}
    assert step.transfers == 2 and step.transfer_bytes == 16 and step.segments == 2
    # on the ranks' own cores each end copies (2 s for 8 B) and the message flies for its latency
    cores = simulate_executor(
        prog,
        {"a": 1.0, "b": 2.0},
        {"a": 4.0, "b": 3.0},
        {"a": 8.0},
        link,
        FREE,
        copies_on_ranks=True,
    )
    assert cores.makespan_s == pytest.approx(1 + (2 + 0.5 + 2) + 2 + 3 + (2 + 0.5 + 2) + 4)
    assert cores.busy_s == {0: pytest.approx(5.0 + 4.0), 1: pytest.approx(5.0 + 4.0)}
    assert cores.overhead_s == pytest.approx(8.0)
    assert cores.transfer_s == pytest.approx(2 * (2 + 0.5 + 2))
    # with gloo's copy timed (0.25 s per byte for both ends), each end takes half of it
    timed = dataclasses.replace(FREE, copy_s_per_byte=0.25)
    copied = simulate_executor(
        prog,
        {"a": 1.0, "b": 2.0},
        {"a": 4.0, "b": 3.0},
        {"a": 8.0},
        link,
        timed,
        copies_on_ranks=True,
    )
    assert copied.makespan_s == pytest.approx(1 + (1 + 0.5 + 1) + 2 + 3 + (1 + 0.5 + 1) + 4)


def test_executor_overheads_add_per_node_per_segment_and_per_byte_returned():
    prog = build_program(TwoStages(), {"a": 0, "b": 1}, {"a": 0.0, "b": 1.0}, mp=2)
    link = Link(latency=0.0, bandwidth=1e30, source="test")
    costs = ExecutorOverheads(node_s=0.25, backward_call_s=0.5, assemble_s_per_byte=0.125)
    base = simulate_executor(
        prog, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}, {"a": 8.0}, link, FREE
    )
    step = simulate_executor(
        prog, {"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}, {"a": 8.0}, link, costs
    )
    nodes = sum(len(s.nodes) for s in prog.segments)
    # every node once, one autograd call per segment, device 1 assembles a's 8-byte gradient
    # (no copies: the link carries the messages beside the compute)
    assert step.overhead_s == pytest.approx(0.25 * nodes + 0.5 * 2 + 0.125 * 8)
    assert step.makespan_s == pytest.approx(base.makespan_s + step.overhead_s)


def test_one_device_is_its_layers_back_to_back():
    model = Branchy(width=16, blocks=1)
    x = torch.randn(2, 3, 32, 32)
    graph = trace_model(model, x)
    prog = build_program(model, {n: 0 for n in graph.nodes}, mp=1)
    ran = [n.name for s in prog.segments for n in s.nodes]
    fwd = {n: 0.001 * (i + 1) for i, n in enumerate(ran)}
    bwd = {n: 2 * t for n, t in fwd.items()}
    step = simulate_executor(prog, fwd, bwd, {}, Link(1.0, 1.0, "unused"), FREE)
    assert step.segments == 1 and step.transfers == 0
    assert step.makespan_s == pytest.approx(sum(fwd.values()) + sum(bwd.values()))


def test_measured_overheads_are_small_positive_figures():
    costs = ExecutorOverheads.measure(nodes=16, repeats=2)
    assert 0 <= costs.node_s < 1e-3 and 0 <= costs.backward_call_s < 1e-2
    assert 0 < costs.assemble_s_per_byte < 1e-7  # at least 10 MB/s for zeros + a sum


def test_copies_take_the_ranks_cores_only_when_the_ranks_hold_every_core():
    assert copies_on_cores(probed_hardware(), 2, 1)
    assert not copies_on_cores(tiny_hardware(2, "cpu", cores=8), 2, 1)
    assert not copies_on_cores(tiny_hardware(2, "cuda", cores=2), 2, 1)


# -- calibrated on the measured baseline --------------------------------------------------------


def with_own_compute(obs, share: float = 0.75):
    """The observation with the model's own compute (timed alone) set to ``share`` of the
    baseline's measured compute, as :func:`own_compute_s` caches it."""
    obs.cache.put(OWN_COMPUTE_KEY, share * obs.truth.parts_s["compute"])
    return obs


def test_calibrated_model_reproduces_the_measured_baseline():
    obs = with_own_compute(observed())
    og, source = op_graph(obs, HybridOptions.of(obs))
    model = step_model(obs, og, source)
    truth = obs.truth
    assert model.calibration.reproduces_baseline() == pytest.approx(truth.step_s)
    # the layers' sum is the model's own compute once scaled: the measured compute less
    # what ran beside it on the same cores (two CPU ranks holding both cores)
    own = 0.75 * truth.parts_s["compute"]
    assert model.copies_on_ranks
    assert compute_beside_s(truth, own) == pytest.approx(truth.parts_s["compute"] - own)
    layers = sum(f + b for f, b in model.layer_s.values())
    assert model.compute_scale * layers == pytest.approx(own)
    # the executor on one device runs the layers back to back: its calibrated step is the
    # layers' own time, plus only what the interpreter adds per node
    net = obs.workload.model()
    graph = trace_model(net, obs.workload.example_batch(2)[0])
    one_device = build_program(net, {n: 0 for n in graph.nodes}, mp=1)
    one = model.simulate(one_device)
    nodes = sum(len(s.nodes) for s in one_device.segments)
    interpreter = model.overheads.node_s * nodes + model.overheads.backward_call_s
    assert model.compute_scale * one.makespan_s == pytest.approx(
        own + model.compute_scale * interpreter, rel=1e-6
    )


def test_what_ran_beside_the_compute_is_left_out_only_where_ranks_hold_every_core():
    """Two CPU ranks on a 2-core host: the other rank and gloo's summing of DDP's buckets
    ran on the cores that computed, so the baseline's compute exceeds the model's own (timed
    alone); a hybrid device computing alone does not pay it. GPUs compute beside their
    copies: the layers are the whole measured compute, and nothing is timed alone."""
    gpus = tiny_hardware(2, "cuda")
    nccl_p2p = dataclasses.replace(P2P, backend="nccl")
    gpus = dataclasses.replace(gpus, collectives=gpus.collectives + (nccl_p2p,))
    # timed for real, in this process, where it is needed
    obs = observed()
    step_model(obs, *op_graph(obs, HybridOptions.of(obs)))
    assert obs.cache.get(OWN_COMPUTE_KEY) > 0
    for kw, subtracted in (({}, True), ({"hardware": gpus, "device_type": "cuda"}, False)):
        obs = with_own_compute(observed(**kw), 0.8)
        og, source = op_graph(obs, HybridOptions.of(obs))
        model = step_model(obs, og, source)
        truth = obs.truth
        layers = sum(f + b for f, b in model.layer_s.values())
        beside = 0.2 * truth.parts_s["compute"] if subtracted else 0.0
        assert model.copies_on_ranks is subtracted
        assert model.compute_scale * layers == pytest.approx(truth.parts_s["compute"] - beside)
        assert model.calibration.reproduces_baseline() == pytest.approx(truth.step_s)
        assert any("timed alone" in n for n in model.notes) is subtracted
    # a model that computes for longer alone than in the baseline: nothing is taken out;
    # what was taken out is at most half the compute
    assert compute_beside_s(truth, 2 * truth.parts_s["compute"]) == 0.0
    assert compute_beside_s(truth, 0.0) == pytest.approx(0.5 * truth.parts_s["compute"])
    assert compute_beside_s(truth, None) == 0.0


def test_a_two_device_prediction_is_the_baseline_plus_its_changes():
    obs = observed()
    og, source = op_graph(obs, HybridOptions.of(obs))
    model = step_model(obs, og, source)
    net = obs.workload.model()
    graph = trace_model(net, obs.workload.example_batch(2)[0])
    towers = {  # towers b2 and b4 of every block on device 1, the rest on device 0
        name: int(any(f".{t}" in node.target for t in ("b2", "b4")))
        for name, node in graph.nodes.items()
    }
    pred = model.predict(build_program(net, towers, mp=2), param_bytes_of(net))
    truth = obs.truth
    parts = truth.parts_s
    # measured step - its compute + the executor's step; - the exposed all-reduce (one
    # replica: nothing to reduce but the loss) ...; optimizer for the owned parameters
    expected = (
        truth.step_s
        - parts["compute"]
        + pred.mp_step.makespan_s
        - parts["comm_exposed"]
        + pred.grad_sync_s
        - parts["optimizer"]
        + pred.optimizer_s
    )
    assert pred.step_s == pytest.approx(expected)
    assert pred.global_batch == obs.workload.batch_size  # 1 x 2: one replica
    assert pred.range_s[0] < pred.step_s < pred.range_s[1]
    assert 0 < pred.optimizer_s < parts["optimizer"]  # each rank steps what it owns
    assert pred.per_sample_ratio == pytest.approx(
        (pred.step_s / obs.workload.batch_size) / (truth.step_s / obs.global_batch)
    )


def test_accumulated_micro_batches_each_run_the_split_model_and_count_in_the_batch():
    # The same job stepping 4 micro-batches per update: the measured step (and its
    # compute) covers 4 passes, so the calibrated layers are one pass's share, the
    # hybrid's step runs its executor 4 times, and its step trains 4 B samples.
    acc = 4
    workload = dataclasses.replace(branchy(), accumulation=acc)
    obs = with_own_compute(observed(workload))
    og, source = op_graph(obs, HybridOptions.of(obs))
    model = step_model(obs, og, source)
    assert model.accumulation == acc
    assert model.calibration.reproduces_baseline() == pytest.approx(obs.truth.step_s)
    layers = sum(f + b for f, b in model.layer_s.values())
    own = 0.75 * obs.truth.parts_s["compute"]
    assert model.compute_scale * acc * layers == pytest.approx(own)

    net = obs.workload.model()
    graph = trace_model(net, obs.workload.example_batch(2)[0])
    towers = {
        name: int(any(f".{t}" in node.target for t in ("b2", "b4")))
        for name, node in graph.nodes.items()
    }
    program = build_program(net, towers, mp=2)
    pred = model.predict(program, param_bytes_of(net))
    one_pass = model.simulate(program)
    assert pred.parts["compute"] == pytest.approx(acc * one_pass.makespan_s)
    assert pred.global_batch == acc * obs.workload.batch_size  # 1 x 2: one replica, 4 micro-batches
    assert pred.baseline_per_sample_s == pytest.approx(obs.truth.step_s / obs.global_batch)
    cands = HybridMp().plan(obs, 2)
    assert cands and all(c.global_batch == acc * obs.workload.batch_size for c in cands)


def test_diagnosis_quotes_the_measured_truth_and_labels_the_model():
    obs = observed()
    d = HybridMp().diagnose(obs)
    truth = obs.truth
    assert d.applies
    assert d.summary.startswith("measured: 200 ms per step of 32 samples")
    assert truth.phrase("compute") in d.summary and truth.phrase("comm_exposed") in d.summary
    assert "model: branches allow SU^M" in d.summary
    # per sample: the hybrid's samples per step, the baseline's measured time per sample
    assert "a hybrid trains 16 samples per step, not 32" in d.summary
    assert f"{truth.step_s / obs.global_batch * 1e3:.1f} ms measured" in d.summary
    pred = d.details["calibrated"]["prediction"]
    assert d.expected_gain == pytest.approx(max(0.0, 1 - pred["per_sample_ratio"]))
    assert d.details["calibrated"]["calibration"]["reproduces_baseline_s"] == pytest.approx(0.2)


def test_candidates_carry_global_batch_range_and_per_sample_order():
    obs = observed()
    cands = HybridMp().plan(obs, 3)
    assert cands
    b = obs.workload.batch_size
    for c in cands:
        assert c.knobs["mp_degree"] == 2
        assert c.global_batch == b  # one replica of a 2-device worker: B samples, not 2B
        low, high = c.predicted_range_s
        assert low < c.predicted_step_s < high
        assert "calibrated: " in c.rationale and "model: SU^2" in c.rationale
        assert c.details["calibrated"]["step_s"] == c.predicted_step_s
    per_sample = [c.predicted_step_s / c.global_batch for c in cands]
    assert per_sample == sorted(per_sample)
    assert len({c.knobs["placement"] for c in cands}) == len(cands)
    text = HybridMp().explain(cands[0])
    assert "Calibrated on the measured baseline" in text and "Model: SU^2" in text


def test_no_prediction_without_a_measured_link_or_breakdown():
    for obs, why in [
        (observed(hardware=probed_hardware(p2p=None)), "the link between ranks was not measured"),
        (observed(breakdown=False), "the baseline was not profiled"),
    ]:
        cands = HybridMp().plan(obs, 2)
        assert cands and all(c.predicted_step_s is None for c in cands)
        assert all(f"no prediction: {why}" in c.rationale for c in cands)
        assert all(c.global_batch == obs.workload.batch_size for c in cands)
        assert f"no calibrated prediction: {why}" in HybridMp().diagnose(obs).summary


def test_a_model_fx_cannot_trace_is_not_applicable_rather_than_an_error():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return self.a(x)
            return self.b(x)

    w = Workload(
        name="untraceable",
        model=Untraceable,
        make_batch=lambda n, g: (
            torch.randn(n, 4, generator=g),
            torch.randint(4, (n,), generator=g),
        ),
        batch_size=4,
        lr=0.1,
    )
    obs = observed(w)
    d = HybridMp().diagnose(obs)
    assert not d.applies and "torch.fx" in d.summary and d.summary.startswith("measured: ")
    assert HybridMp().plan(obs, 2) == []


def test_measured_layer_times_are_labelled_by_the_clock_they_were_taken_on():
    obs = observed(layer_profile=True)
    # a profile timed on the wall clock (the core's choice with several intra-op threads;
    # this process may have one, under the suite's workers: see the root conftest.py)
    obs.layer_profile.clock = "wall"
    og, source = op_graph(obs, HybridOptions.of(obs))
    assert source == "measured"
    # measured layers: their sum is what the calibration scales, not FLOPs at a peak
    model = step_model(obs, og, source)
    assert model.times_source == "measured layer profile"
    layers = sum(f + b for f, b in model.layer_s.values())
    assert layers == pytest.approx(og.serial_time())
    assert model.calibration.reproduces_baseline() == pytest.approx(obs.truth.step_s)
    # a profile timed on the thread's CPU clock (the core's choice for a one-thread CPU rank)
    obs.layer_profile.clock = "thread_cpu"  # as the core records it on the profile
    _, source = op_graph(obs, HybridOptions.of(obs))
    assert source == "measured (CPU time)"
    assert step_model(obs, og, source).times_source == "layer profile measured in CPU time"


# -- a chain of transformer blocks: contiguous stages, calibrated --------------------------------

COMM_BOUND = {"compute": 0.30, "comm_exposed": 0.62, "data": 0.03, "optimizer": 0.04, "idle": 0.01}


def _gpt():
    from tunekit.testing import tiny_gpt_workload

    return tiny_gpt_workload()


def test_a_transformer_chain_is_placed_by_whole_blocks_and_calibrated():
    """No branches: DLPlacer's SU^M bound is 1. The diagnosis still places the blocks in
    contiguous stages (never cutting a block) and prices them on the measured baseline: with
    the usual breakdown one waiting device costs more than the all-reduce saved."""
    obs = with_own_compute(observed(_gpt()), 0.9)
    d = HybridMp().diagnose(obs)
    assert not d.applies and "chain" in d.summary
    assert "2 contiguous stages of whole transformer blocks" in d.summary
    assert "device 0: tokens_1 .. blocks.0; device 1: blocks.1 .. head" in d.summary
    pred = d.details["calibrated"]["prediction"]
    assert pred["per_sample_ratio"] > 1 and "the device that waits costs more" in d.summary
    assert HybridMp().plan(obs, 3) == []


def test_stages_win_where_the_all_reduce_dominates_the_step():
    """62% of the step exposed in the all-reduce: one replica of a 2-device worker has none to
    do, and the calibrated model says so; the plan carries that placement."""
    obs = with_own_compute(observed(_gpt(), breakdown=COMM_BOUND), 0.9)
    d = HybridMp().diagnose(obs)
    ratio = d.details["calibrated"]["prediction"]["per_sample_ratio"]
    assert d.applies and ratio < 1 and d.expected_gain == pytest.approx(1 - ratio)
    assert "the all-reduce it saves outweighs the device that waits" in d.summary
    (cand,) = HybridMp().plan(obs, 3)
    assert cand.details["placer"] == "pipeline" and cand.global_batch == obs.workload.batch_size
    devices = cand.details["placement"]["assignment"]
    blocks = {n: n.split("_")[1] for n in devices if n.startswith("blocks_")}
    for block in set(blocks.values()):
        assert len({devices[n] for n, b in blocks.items() if b == block}) == 1, block
    assert cand.predicted_step_s == pytest.approx(cand.details["calibrated"]["step_s"])
    assert cand.predicted_step_s / cand.global_batch < obs.truth.step_s / obs.global_batch
