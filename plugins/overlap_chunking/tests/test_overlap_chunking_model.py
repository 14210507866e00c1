"""The cost model against hand-worked timelines, and DDP's own bucketing."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tunekit.observe.graph import trace_model
from tunekit.observe.layer_profile import profile_layers
from tunekit.observe.observation import summarize_model
from tunekit.plugins.overlap_chunking.layers import PaperLayer, paper_layers
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
from tunekit.plugins.overlap_chunking.timing import layer_times_from_profile
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
    rec = SimpleNamespace
    profile = SimpleNamespace(
        layers=[
            rec(name="conv", forward_s=1.0, backward_s=2.0),
            rec(name="relu", forward_s=0.5, backward_s=0.25),
            rec(name="pool", forward_s=1.0, backward_s=1.0),
            rec(name="fc", forward_s=3.0, backward_s=4.0),
        ]
    )
    times = layer_times_from_profile(profile, layers)
    assert [(t.name, t.forward_s, t.backward_s) for t in times] == [
        ("conv", 1.5, 2.25),
        ("pool", 1.0, 1.0),
        ("fc", 3.0, 4.0),
    ]
    assert layer_times_from_profile(SimpleNamespace(layers=profile.layers[:2]), layers) is None
    assert layer_times_from_profile(SimpleNamespace(other=1), layers) is None


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


def test_two_chunk_is_not_planned_for_jobs_it_would_refuse():
    """Two chunks update per chunk: clipping, AMP, accumulation or a schedule refuse it at apply."""
    from tunekit.plugins.overlap_chunking.plugin import two_chunk_refuses
    from tunekit.workload import Workload

    def job(**fields):
        def batch(n, g):
            return torch.randn(n, 2, generator=g), torch.zeros(n, dtype=torch.long)

        return SimpleNamespace(workload=Workload("w", model=lambda: torch.nn.Linear(2, 2),
                                                 make_batch=batch, **fields))

    assert not two_chunk_refuses(job())
    assert two_chunk_refuses(job(clip_grad_norm=1.0))
    assert two_chunk_refuses(job(accumulation=2))
