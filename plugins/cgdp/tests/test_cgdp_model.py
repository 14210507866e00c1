"""The cost model: the paper's worked numbers (NOTES.md §4) and the comparison with DDP."""

from __future__ import annotations

import pytest

from tunekit.hardware import load_profile
from tunekit.plugins.cgdp.model import (
    HostRates,
    IterationPhases,
    LayerCost,
    MiB,
    backprop_time,
    candidate_chunk_sizes,
    cgdp_backward_time,
    cgdp_backward_time_queued,
    cgdp_overhead,
    chunk_costs,
    ddp_backward_time,
    host_sum_bandwidth,
    memory_estimates,
    predict,
    total_processing_times,
    typical_backward_time,
    typical_overhead,
)


def three_layers(t_aa3: float = 15.0) -> list[LayerCost]:
    """NOTES.md's example, listed 3, 2, 1 (backward order)."""
    return [
        LayerCost(t_bp=10, t_as=1, t_aa=t_aa3, t_bc=5),
        LayerCost(t_bp=10, t_as=1, t_aa=2, t_bc=1),
        LayerCost(t_bp=10, t_as=1, t_aa=1, t_bc=0.5),
    ]


def test_three_layer_example():
    costs = three_layers()
    assert total_processing_times(costs) == [31, 25, 34.5]
    assert cgdp_backward_time(costs) == 34.5
    assert typical_backward_time(costs) == 54.5
    assert cgdp_overhead(costs) == 4.5
    assert typical_overhead(costs) == 24.5
    # T_O = T - T_BP when layers 3 and 2 hide behind backward
    assert cgdp_backward_time(costs) - backprop_time(costs) == cgdp_overhead(costs)


def test_three_layer_variant_with_a_slow_top_layer():
    costs = three_layers(t_aa3=40)
    assert cgdp_backward_time(costs) == 56  # layer 3 (11 + 40 + 5) is now the slowest
    assert typical_backward_time(costs) == 79.5


def test_chunking_three_layers_by_two():
    # l=3, k=2: chunk {3,2} synchronises once, then {1}.
    chunked = chunk_costs(three_layers(), 2)
    assert chunked == [LayerCost(20, 1, 17, 6), LayerCost(10, 1, 1, 0.5)]
    assert total_processing_times(chunked) == [44, 33.5]
    assert chunk_costs(three_layers(), 1) == three_layers()


def test_queued_bound_is_never_below_the_paper_model():
    for costs in (three_layers(), three_layers(40), chunk_costs(three_layers(), 2)):
        assert cgdp_backward_time_queued(costs) >= cgdp_backward_time(costs)
    # three_layers queued: layer 3 host work 11..31, layer 2 31..34, layer 1 34..35.5
    assert cgdp_backward_time_queued(three_layers()) == 35.5


def test_table3_arithmetic():
    """AlexNet on 4 P100s (ms): the phases add up to the totals, and to Table 2's speedup."""
    caffe = IterationPhases(broadcast=20, forward=50.6, backward=104, grad_acc=23, update=5.1)
    cgdp = IterationPhases(forward=51.0, backward=111, exposed=0.0218, update=5.1)
    assert caffe.total == pytest.approx(202.7)
    assert cgdp.total == pytest.approx(167.1, abs=0.05)
    assert round(caffe.total / cgdp.total, 2) == 1.21
    assert caffe.overhead == pytest.approx(43.0)
    # CGDP hides 43 ms of exchange but pays 7 ms more backward (the hook and copy launches).
    assert cgdp.backward - caffe.backward == pytest.approx(7.0)


@pytest.mark.parametrize(
    ("caffe", "trl", "speedup"),
    [(202.7, 167.1, 1.21), (163.4, 156.7, 1.04), (445.6, 369.1, 1.21)],
    ids=["alexnet", "googlenet", "vgg16"],
)
def test_table2_speedups_at_four_gpus(caffe, trl, speedup):
    assert round(caffe / trl, 2) == speedup


def test_ddp_model_overlaps_buckets_with_backward():
    t_bp, nbytes = [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]

    def allreduce(n: float) -> float:
        return 0.5 * n

    # one bucket: reduce 3 bytes after backward
    assert ddp_backward_time(t_bp, nbytes, allreduce, bucket_bytes=10, first_bucket_bytes=10) == 4.5
    # one layer per bucket: 1..1.5, 2..2.5, 3..3.5
    assert ddp_backward_time(t_bp, nbytes, allreduce, bucket_bytes=1, first_bucket_bytes=1) == 3.5


def test_host_rates_and_sum_bandwidth():
    rates = HostRates(d2h_bw=10.0, h2d_bw=20.0, reduce_bw=5.0, reduce_latency=1.0, sync_s=0.5)
    assert rates.t_aa(10) == 1 + 1 + 2
    assert rates.t_bc(10) == 0.5
    assert rates.t_aa(0) == 0
    assert host_sum_bandwidth(30.0, 4) == 10.0  # three additions per reduction


def test_candidate_chunk_sizes_cover_distinct_layouts():
    assert candidate_chunk_sizes(1) == [1]
    ks = candidate_chunk_sizes(152)
    assert ks[:9] == list(range(1, 10)) and 151 in ks and max(ks) < 152


def test_predict_groups_layers_when_synchronisation_dominates():
    t_bp, nbytes = [1e-4] * 40, [4096] * 40
    fast = HostRates(1e10, 1e10, 1e10, 0.0, sync_s=0.0)
    slow_sync = HostRates(1e10, 1e10, 1e10, 0.0, sync_s=5e-4)
    assert predict(t_bp, nbytes, fast, lambda n: 1e-4).best_chunk == 1
    pred = predict(t_bp, nbytes, slow_sync, lambda n: 1e-4)
    assert pred.best_chunk > 1
    assert pred.cgdp_s[pred.best_chunk] < pred.cgdp_s[1]


# AlexNet's parameters per layer (Table 4), layer 8 first, and a 30 ms backward split
# roughly as its FLOPs are (convolutions dominate).
ALEXNET_PARAMS_M = [4, 16.8, 37.8, 0.4, 0.7, 0.9, 0.3, 0.03]
BACKWARD_SHARE = [0.01, 0.03, 0.07, 0.10, 0.15, 0.20, 0.30, 0.14]


def alexnet_on(profile: str, backward_s: float = 0.03):
    hw = load_profile(profile)
    host = hw.host_bandwidth("gpu0")
    # Host adds at 46 GB/s per contribution: Table 4's 13.07 ms for four 37.8 M-parameter gradients.
    rates = HostRates(host, host, host_sum_bandwidth(4 * 37.8e6 * 4 / 13.07e-3, 4), 0.0, 20e-6)
    t_bp = [backward_s * s for s in BACKWARD_SHARE]
    nbytes = [p * 1e6 * 4 for p in ALEXNET_PARAMS_M]
    return hw, predict(t_bp, nbytes, rates, lambda n: hw.allreduce_time(n, 4, "nccl"))


def test_host_links_against_peer_links_on_the_papers_machines():
    power8, on_power8 = alexnet_on("power8-p100x4")
    dgx1, on_dgx1 = alexnet_on("dgx1-v100x4")
    assert power8.host_bandwidth("gpu0") == 40e9  # NVLink to the POWER8 CPUs
    assert dgx1.host_bandwidth("gpu0") == 12e9  # PCIe to the Xeons
    for pred in (on_power8, on_dgx1):
        assert (
            pred.best_cgdp_s < pred.typical_s
        )  # the paper's claim: CGDP beats reduce-after-backward
    # Against DDP's overlapped NVLink all-reduce, the host path only keeps up where it is as wide:
    assert on_power8.best_cgdp_s <= on_power8.ddp_s
    assert on_dgx1.best_cgdp_s > 1.5 * on_dgx1.ddp_s


def test_a_long_backward_hides_either_path():
    _, pred = alexnet_on("dgx1-v100x4", backward_s=0.104)  # Table 3's backward
    assert pred.best_cgdp_s == pytest.approx(pred.backprop_s, rel=0.01)
    assert pred.ddp_s == pytest.approx(pred.backprop_s, rel=0.01)


def test_memory_estimates_move_buckets_and_state_to_the_host():
    est = memory_estimates(param_bytes=100 * MiB, state_bytes=100 * MiB)
    assert est["ddp"].device_bytes - est["cgdp"].device_bytes == 100 * MiB  # DDP's buckets
    assert est["cgdp"].device_bytes - est["cgdp+offload"].device_bytes == 100 * MiB  # the state
    assert est["cgdp"].host_bytes == 100 * MiB
    assert est["cgdp+offload"].host_bytes == 300 * MiB
    view = memory_estimates(100 * MiB, 0, ddp_bucket_view=True)
    assert view["ddp"].device_bytes == view["cgdp"].device_bytes


def test_a_chunk_pays_the_reduction_latency_once():
    from tunekit.plugins.cgdp.model import chunked_layer_costs

    rates = HostRates(d2h_bw=1.0, h2d_bw=2.0, reduce_bw=4.0, reduce_latency=10.0, sync_s=1.0)
    # l=3, k=2: {3,2} then {1}; bytes 4, 4, 8
    chunked = chunked_layer_costs([1.0, 2.0, 3.0], [4.0, 4.0, 8.0], rates, 2)
    assert chunked == [LayerCost(3.0, 1.0, 8 + 10 + 2, 4.0), LayerCost(3.0, 1.0, 8 + 10 + 2, 4.0)]
    # the paper's aggregation sums per-layer costs, latency included twice
    per_layer = [
        LayerCost(1.0, 1.0, rates.t_aa(4), rates.t_bc(4)),
        LayerCost(2.0, 1.0, rates.t_aa(4), rates.t_bc(4)),
    ]
    assert chunk_costs(per_layer + [LayerCost(3.0, 1.0, 0, 0)], 2)[0].t_aa == 2 * (4 + 10 + 1)
