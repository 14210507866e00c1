"""The cost model against hand-worked timelines, and DDP's own bucketing."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tunekit.observe.graph import trace_model
from tunekit.observe.layer_profile import LayerProfile, LayerTiming, profile_layers
from tunekit.observe.observation import summarize_model
from tunekit.plugins.overlap_chunking.layers import PaperLayer, paper_layers
from tunekit.plugins.overlap_chunking.measure import layer_times_from_profile, measure_layer_times
from tunekit.plugins.overlap_chunking.model import (
    FcCost,
    LayerCost,
    StepCosts,
    calibrate,
    ddp_buckets,
    predict_ddp,
    predict_two_chunk,
)
from tunekit.plugins.overlap_chunking.search import TIE_TOLERANCE, rank_settings, shortlist
from tunekit.runtime.sync import DDPSync
from tunekit.workload import load_workload


def per_100_bytes(n: float) -> float:
    return n / 100  # one second per 100 bytes


def three_layers(fc: FcCost | None = None) -> StepCosts:
    """Three layers of 1 s forward, 1 s backward, 100 B of gradient; updates 1 s per 100 B."""
    layers = tuple(LayerCost(f"l{i}", 1.0, 1.0, (100,), fc if i == 1 else None) for i in range(3))
    return StepCosts(layers, 0.01, 0.0, 2, per_100_bytes, per_100_bytes)


@pytest.mark.parametrize("seed", range(5))
def test_bucket_assignment_matches_torch(seed):
    rng = random.Random(seed)
    numels = [rng.choice([10, 100, 1000, 5000, 20_000]) for _ in range(40)]
    first, cap = rng.choice([400, 4000, 40_000]), rng.choice([4000, 40_000, 400_000])
    tensors = [torch.empty(n) for n in numels]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])
    assert ddp_buckets([n * 4 for n in numels], first, cap) == expected


def test_ddp_one_bucket_leaves_all_communication_exposed():
    pred = predict_ddp(three_layers(), first_cap_bytes=1000, cap_bytes=1000)
    # forward 3 + backward 3; one 300 B all-reduce posted at the end: 3 s exposed; update 3.
    assert pred.step_s == pytest.approx(12.0)
    assert [c.name for c in pred.comms] == ["bucket0"]
    assert pred.blocked_s == pytest.approx(3.0)
    assert pred.overlap_R == pytest.approx(0.0)


def test_ddp_per_layer_buckets_overlap_all_but_the_last():
    pred = predict_ddp(three_layers(), first_cap_bytes=100, cap_bytes=100)
    assert [(c.start_s, c.end_s, c.blocked_s) for c in pred.comms] == [
        (4.0, 5.0, 0.0),
        (5.0, 6.0, 0.0),
        (6.0, 7.0, 1.0),
    ]
    assert pred.step_s == pytest.approx(10.0)
    assert pred.overlap_R == pytest.approx(100 * 2 / 3)


def test_hidden_communication_costs_compute_on_shared_cores():
    costs = replace(three_layers(), comm_cpu_share=1.0)
    pred = predict_ddp(costs, first_cap_bytes=100, cap_bytes=100)
    # Buckets 0 and 1 were hidden for 1 s each; on saturated cores that time is
    # taken from compute: 10 s + 2 s.
    assert pred.step_s == pytest.approx(12.0)
    assert pred.overlap_R == pytest.approx(100 * 2 / 3)  # R is what it was


def test_two_chunks_update_chunk1_while_chunk2_is_in_flight():
    pred = predict_two_chunk(three_layers(), k=1, f=0)
    # chunk 1 (last layer) posted at 4, done at 5; chunk 2 posted at 6, done at 8.
    # Chunk 1's update (6..7) runs while chunk 2 is in flight; the rank blocks 7..8.
    chunk1, chunk2 = pred.comms
    assert (chunk1.posted_s, chunk1.end_s, chunk1.blocked_s) == pytest.approx((4.0, 5.0, 0.0))
    assert (chunk2.posted_s, chunk2.end_s, chunk2.blocked_s) == pytest.approx((6.0, 8.0, 1.0))
    assert pred.step_s == pytest.approx(10.0)
    assert pred.overlap_R == pytest.approx(100 * 2 / 3)


def test_replicated_fc_layer_defers_its_update_to_the_next_forward():
    fc = FcCost(in_features=10, out_features=5, rows=2, local_wgrad_s=0.5, full_wgrad_s=1.0)
    pred = predict_two_chunk(three_layers(fc), k=1, f=1)
    # Steady step: forward 3 + deferred gradient 1 + its update 1; backward 2.5
    # (no local weight gradient in the FC layer); chunk updates 1 + 1, no waits.
    assert pred.step_s == pytest.approx(9.5)
    names = [c.name for c in pred.comms]
    assert names == ["gather_l1_acts", "chunk1", "chunk2", "gather_l1_errors"]
    acts = pred.comms[0]
    assert acts.nbytes == 2 * 2 * 10 * 4  # world x rows x K_b, fp32
    assert pred.comms[3].nbytes == 2 * 2 * 5 * 4
    assert pred.blocked_s == pytest.approx(0.0)
    assert pred.overlap_R == pytest.approx(100.0)


def test_calibration_recovers_the_compute_factor():
    costs = three_layers()

    def default(c):
        return predict_ddp(c, 100, 100)

    measured = default(costs.scaled(2.5)).step_s
    assert calibrate(costs, measured, default) == pytest.approx(2.5, rel=1e-6)
    # Less than the communication alone needs: no factor can explain it.
    assert calibrate(costs, 0.5, default) is None


def test_ranking_covers_both_modes_and_drops_duplicates():
    ranked = rank_settings(three_layers())
    steps = [s.prediction.step_s for s in ranked]
    # Sorted by predicted step, where within 0.5% the setting hiding more wins.
    for a, b in zip(ranked, ranked[1:], strict=False):
        assert a.prediction.step_s <= b.prediction.step_s * (1 + TIE_TOLERANCE)
    assert ranked[0].prediction.step_s <= min(steps) * (1 + TIE_TOLERANCE)
    keys = [tuple(sorted(s.knobs.items())) for s in ranked]
    assert len(keys) == len(set(keys))
    top = shortlist(ranked, 2)
    assert {s.mode for s in top} == {"ddp_buckets", "two_chunk"}


def test_ddp_settle_splits_the_final_wait_among_buckets():
    # Posted at 0, 1, 2 (2: backward's last gradient); finished at 1.5, 2.5, 3.0.
    pending = [("bucket0", 8, 0.0, [1.5]), ("bucket1", 8, 1.0, [2.5]), ("bucket2", 8, 2.0, [3.0])]
    records = DDPSync._settle(pending, now=3.1)
    assert [(r.own_s, r.blocked_s) for r in records] == [(1.5, 0.0), (1.5, 0.5), (1.0, 0.5)]


def test_layer_times_from_an_observed_profile():
    layers = [
        PaperLayer("conv", "Conv2d", ("conv.weight",), 10, None),
        PaperLayer("pool", "MaxPool2d", (), 0, None),
        PaperLayer("fc", "Linear", ("fc.weight",), 10, None),
    ]

    def profile(*records: tuple[str, float, float]) -> LayerProfile:
        timings = {n: LayerTiming(n, "x", f, b) for n, f, b in records}
        return LayerProfile("g", "cpu", 2, 0, 1, timings)

    full = [("conv", 1.0, 2.0), ("relu", 0.5, 0.25), ("pool", 1.0, 1.0), ("fc", 3.0, 4.0)]
    times = layer_times_from_profile(profile(*full), layers)
    assert [(t.name, t.forward_s, t.backward_s) for t in times] == [
        ("conv", 1.5, 2.25),
        ("pool", 1.0, 1.0),
        ("fc", 3.0, 4.0),
    ]
    assert layer_times_from_profile(profile(*full[:2]), layers) is None  # fc, pool not timed
    assert layer_times_from_profile(profile(), layers) is None


def test_layer_times_from_the_observation_layers_profile():
    workload = load_workload("example:cnn")
    model = workload.model()
    inputs = workload.example_batch(2)[0]
    graph = trace_model(model, inputs)
    profile = profile_layers(model, inputs, graph, warmup=1, repeats=1)
    layers = paper_layers(summarize_model(model, inputs))
    times = layer_times_from_profile(profile, layers, graph, batch=4)
    assert [t.name for t in times] == [layer.name for layer in layers]
    # Every profiled layer's time lands on some paper layer, scaled from batch 2 to 4.
    total = sum(t.forward_s + t.backward_s for t in times)
    profiled = sum(t.forward_s + t.backward_s for t in profile.layers.values())
    assert total == pytest.approx(2 * profiled, rel=1e-9)


def test_collectives_run_slower_while_the_rank_computes():
    costs = replace(three_layers(), comm_scale=2.0)
    pred = predict_ddp(costs, first_cap_bytes=100, cap_bytes=100)
    # Backward runs 3..6. bucket0 (posted at 4) does its 1 s of work at half speed
    # while the rank computes: done at 6. bucket1 and bucket2 then run at full
    # speed while the rank waits: 6..7, 7..8.
    assert [(c.start_s, c.end_s) for c in pred.comms] == [(4.0, 6.0), (6.0, 7.0), (7.0, 8.0)]
    assert [c.busy_work_s for c in pred.comms] == [1.0, 0.0, 0.0]
    assert pred.blocked_s == pytest.approx(2.0)
    assert pred.step_s == pytest.approx(11.0)
    # On shared cores the work done beside compute comes out of compute.
    charged = predict_ddp(replace(costs, comm_cpu_share=1.0), 100, 100)
    assert charged.cpu_charge_s == pytest.approx(1.0) and charged.step_s == pytest.approx(12.0)
    assert charged.parts["compute"] == pytest.approx(6.0 + 1.0)


def test_the_peer_holds_back_the_last_collective():
    costs = replace(three_layers(), peer_delay_s=0.5)
    pred = predict_ddp(costs, first_cap_bytes=100, cap_bytes=100)
    # bucket2 is posted at 6 but the peer posts it at 6.5: done at 7.5.
    assert [(c.start_s, c.end_s) for c in pred.comms][-1] == (6.5, 7.5)
    assert pred.blocked_s == pytest.approx(1.5)
    assert pred.step_s == pytest.approx(10.5)
    # Two chunks: chunk 2 is the step's last collective.
    two = predict_two_chunk(costs, k=1, f=0)
    chunk1, chunk2 = two.comms
    assert (chunk2.posted_s, chunk2.start_s) == pytest.approx((6.0, 6.5))
    assert two.step_s == pytest.approx(10.5)


def test_predicted_parts_add_up_to_the_step():
    fc = FcCost(in_features=10, out_features=5, rows=2, local_wgrad_s=0.5, full_wgrad_s=1.0)
    costs = replace(
        three_layers(fc), comm_scale=3.0, comm_idle_scale=1.5, peer_delay_s=0.25, comm_cpu_share=0.5
    )
    for pred in (
        predict_ddp(costs, 100, 100),
        predict_ddp(costs, 1000, 1000),
        predict_two_chunk(costs, 1, 0),
        predict_two_chunk(costs, 2, 1),
    ):
        assert sum(pred.parts.values()) == pytest.approx(pred.step_s)
        assert pred.parts["comm_exposed"] >= 0


class _RootParameter(torch.nn.Module):
    """A position embedding on the model itself, as a transformer LM has."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.zeros(8))
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x + self.pos)))


def test_parameters_of_a_container_are_a_layer_at_the_input_end():
    summary = summarize_model(_RootParameter(), torch.zeros(2, 8))
    # The summary lists the model itself last (its forward ends last) ...
    assert [layer.name for layer in summary.layers][-1] == ""
    # ... but its gradient is ready last: it is the first layer, where its forward starts.
    layers = paper_layers(summary)
    assert [layer.name for layer in layers] == ["", "a", "b"]
    assert layers[0].param_names == ("pos",)
    workload = SimpleNamespace(
        seed=0,
        model=_RootParameter,
        lr=0.1,
        optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        example_batch=lambda n, seed=0: (torch.randn(n, 8), torch.randint(2, (n,))),
        loss=torch.nn.functional.cross_entropy,
    )
    times, _update, _data = measure_layer_times(
        workload, layers, batch=4, device=torch.device("cpu"), threads=1
    )
    assert all(t.forward_s >= 0 and t.backward_s >= 0 for t in times)
