"""The worked numbers of Zou et al. (NOTES.md section 5), reproduced exactly."""

from __future__ import annotations

import math

import pytest

from tunekit.errors import ConfigError
from tunekit.observe.graph import trace_model
from tunekit.plugins.batch_ps_sizing import model as zou
from tunekit.plugins.batch_ps_sizing.tests.paper_batch_ps_sizing import PAPER_ALEXNET
from tunekit.workload import load_workload

# -- Lemma 3.1 ----------------------------------------------------------------------------


def test_lemma31_four_gpus_at_80_percent_allow_9_percent_overhead():
    assert zou.max_overhead_ratio(0.8, 4) == pytest.approx(0.0909, abs=5e-5)
    assert f"{zou.max_overhead_ratio(0.8, 4):.0%}" == "9%"


def test_lemma31_threefold_speedup_at_10_percent_needs_four_gpus():
    assert zou.speedup(3, 0.10) == pytest.approx(2.538, abs=5e-4)
    assert zou.speedup(4, 0.10) == pytest.approx(3.143, abs=5e-4)
    assert zou.gpus_for_speedup(3, 0.10) == 4


def test_lemma31_efficiency_values_and_asymptote():
    assert zou.efficiency(8, 0.1) == pytest.approx(0.6111, abs=5e-5)
    assert zou.efficiency(16, 0.1) == pytest.approx(0.4231, abs=5e-5)
    assert zou.speedup_asymptote(0.1) == pytest.approx(11.0)
    assert zou.speedup(10**6, 0.1) == pytest.approx(11.0, rel=1e-4)
    assert zou.gpus_for_speedup(11, 0.1) is None  # the asymptote is never reached


def test_lemma31_one_gpu_is_fully_efficient():
    for r in (0.0, 0.1, 3.0):
        assert zou.efficiency(1, r) == 1.0


def test_lemma31_gpus_for_efficiency_is_consistent_with_eq12():
    g = zou.gpus_for_efficiency(0.8, 0.0909)
    assert g == 4
    assert zou.efficiency(g, 0.0909) >= 0.8 > zou.efficiency(g + 1, 0.0909)
    assert zou.gpus_for_efficiency(0.8, 0.0) is None


def test_lemma31_rejects_nonsense():
    with pytest.raises(ConfigError):
        zou.efficiency(0, 0.1)
    with pytest.raises(ConfigError):
        zou.efficiency(2, -0.1)


# -- Lemma 3.2 ----------------------------------------------------------------------------


def test_lemma32_paper_examples_give_three_servers():
    alexnet = zou.DataSize.megabytes(180)
    assert zou.parameter_servers(alexnet, 1, zou.Bandwidth.gbps(1), 1.0) == 3  # 2.88
    assert zou.parameter_servers(alexnet, 4, zou.Bandwidth.gbps(10), 0.5) == 3  # 2.304


def test_lemma32_units_matter():
    # The same 180 read as MiB is 4.7% more data: 3.02 -> 4 servers.
    assert zou.parameter_servers(zou.DataSize.mebibytes(180), 1, zou.Bandwidth.gbps(1), 1.0) == 4
    # Reading 1 Gbps as 1 GB/s (a factor of 8) would wrongly need a single server.
    assert (
        zou.parameter_servers(
            zou.DataSize.megabytes(180), 1, zou.Bandwidth.of_bytes_per_s(1e9), 1.0
        )
        == 1
    )
    assert zou.DataSize.megabytes(180).bytes == 180e6
    assert zou.Bandwidth.gbps(10).bytes_per_s == 1.25e9


def test_lemma32_exact_fit_is_not_rounded_up():
    # 2 * 125 MB * 8 bit * 1 worker / (1 Gbps * 2 s) = 1.0 exactly
    assert zou.parameter_servers(zou.DataSize.megabytes(125), 1, zou.Bandwidth.gbps(1), 2.0) == 1


# -- Eqs. 1-4 on AlexNet ----------------------------------------------------------------------

# Table 2: (B_i, H_i, B_{i+1}, H_{i+1}, D_i, D_{i+1}, F) of conv1..conv5.
TABLE2 = [
    (224, 224, 55, 55, 3, 96, 11),
    (27, 27, 27, 27, 96, 256, 5),
    (13, 13, 13, 13, 256, 384, 3),
    (13, 13, 13, 13, 384, 384, 3),
    (13, 13, 13, 13, 384, 256, 3),
]


def test_eq1_reproduces_table2_shapes():
    shapes = zou.feature_shapes(PAPER_ALEXNET)
    rows = []
    for i, layer in enumerate(PAPER_ALEXNET.features, start=1):
        if layer.kind == "conv":
            (b, h, d), (b1, h1, d1) = shapes[i - 1], shapes[i]
            rows.append((b, h, b1, h1, d, d1, layer.F))
    assert rows == TABLE2
    assert shapes[-1] == (6, 6, 256)  # 6 x 6 x 256 = 9216 = L_1


def test_eq2_input_term_for_alexnet_at_128():
    assert zou.input_bits(PAPER_ALEXNET, 128) == 616_562_688
    assert 224 * 224 * 3 * 128 * 32 == 616_562_688


@pytest.fixture(scope="module")
def alexnet():
    """torchvision's AlexNet and its traced graph (traced once for the module)."""
    w = load_workload("example:alexnet")
    net = w.model()
    return net, trace_model(net, w.example_batch(2)[0])


def test_eq1_matches_torch_on_torchvision_alexnet(alexnet):
    _, graph = alexnet
    spec = zou.cnn_spec_from_graph(graph)
    assert spec is not None
    assert [layer.K for layer in spec.features if layer.kind == "conv"] == [64, 192, 384, 256, 256]
    predicted = zou.feature_shapes(spec)[1:]
    traced = [
        graph.nodes[layer.nodes[0]].output_shape
        for layer in graph.layers.values()
        if layer.kind in ("conv", "pool")
    ]
    traced = [s for s in traced if len(s) == 4][
        : len(predicted)
    ]  # adaptive pool (identity) skipped
    assert [(w_, h, d) for w_, h, d in predicted] == [(s[3], s[2], s[1]) for s in traced]
    assert [b for b, _, _ in predicted] == [55, 27, 27, 13, 13, 13, 13, 6]


def test_eq3_with_the_erratum_counts_real_conv_parameters(alexnet):
    net, graph = alexnet
    spec = zou.cnn_spec_from_graph(graph)
    conv_params = sum(p.numel() for p in net.features.parameters())
    assert zou.conv_parameter_bits(spec) == conv_params * 3 * 32
    # The printed D_i (output depth) would over-count:
    printed = sum(
        (layer.F**2 * layer.K * layer.K + layer.K)
        for layer in spec.features
        if layer.kind == "conv"
    )
    assert printed * 3 * 32 > zou.conv_parameter_bits(spec)


def test_eq4_counts_real_classifier_parameters_and_alexnet_total(alexnet):
    net, graph = alexnet
    spec = zou.cnn_spec_from_graph(graph)
    fc_params = sum(p.numel() for p in net.classifier.parameters())
    assert zou.classifier_bits(spec, 0) == fc_params * 3 * 32
    assert zou.parameter_count(spec) == 61_100_840 == sum(p.numel() for p in net.parameters())
    # Outputs are per sample: one more sample adds sum(L_j) floats.
    assert zou.classifier_bits(spec, 1) - zou.classifier_bits(spec, 0) == sum(spec.fc_widths) * 32


def test_eq5_largest_batch_leaves_the_margin():
    dev = 12e9  # a K80 half, bytes
    x = zou.largest_batch_eq5(PAPER_ALEXNET, dev, margin=0.1)
    assert x > 0
    assert zou.memory_bound_bits(dev * 8, PAPER_ALEXNET, x) >= 0.1 * dev * 8
    assert zou.memory_bound_bits(dev * 8, PAPER_ALEXNET, x + 1) < 0.1 * dev * 8 + 1e-6 * dev


def test_graph_that_is_not_a_chain_cnn_has_no_eq_spec():
    w = load_workload("example:lstm")
    graph = trace_model(w.model(), w.example_batch(2)[0])
    assert zou.cnn_spec_from_graph(graph) is None


def test_eq1_rejects_a_window_larger_than_the_map():
    with pytest.raises(ConfigError):
        zou.next_extent(3, F=5, S=1, P=0)


def test_noise_scale_estimator_recovers_known_values():
    # E|G_B|^2 = |G|^2 + tr(S)/B exactly: the estimator inverts it.
    g2, tr = 4.0, 300.0
    est = zou.noise_scale_from_norms(8, g2 + tr / 8, 64, g2 + tr / 64)
    assert est.grad_sq == pytest.approx(g2)
    assert est.trace_cov == pytest.approx(tr)
    assert est.b_simple == pytest.approx(75.0)
    assert zou.noise_scale_batch_limit(est, 2, (8, 256)) == 37
    assert zou.noise_scale_batch_limit(zou.NoiseScale(0.0, 1.0, 1), 2, (8, 256)) == 256
    assert math.isinf(zou.NoiseScale(0.0, 1.0, 1).b_simple)
