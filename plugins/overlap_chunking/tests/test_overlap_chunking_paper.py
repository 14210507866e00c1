"""The worked numbers of Lee et al. (NOTES.md section 3), reproduced exactly."""

from __future__ import annotations

import pytest
import torch

from tunekit.errors import ConfigError
from tunekit.observe.observation import summarize_model
from tunekit.plugins.overlap_chunking.layers import chunk_plan, fc_layers, is_pool, paper_layers
from tunekit.plugins.overlap_chunking.measure import fc_shape
from tunekit.plugins.overlap_chunking.model import (
    FcCost,
    LayerCost,
    StepCosts,
    fc_replication_values,
    predict_two_chunk,
)
from tunekit.runtime.sync import CommRecord, overlap_ratio

torchvision = pytest.importorskip("torchvision")
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def vgg_a():
    """VGG-A (VGG-11, configuration "A") summarised on the meta device: no memory, no init."""
    with torch.device("meta"):
        model = torchvision.models.vgg11()
        return summarize_model(model, torch.empty(1, 3, 224, 224))


def test_vgg_a_parameter_count(vgg_a):
    assert vgg_a.num_params == 132_863_336
    # Erratum: the paper's "5 millions" of convolution weights; VGG-A has 9,217,728.
    conv_weights = sum(
        layer.param_numel - layer.output_shape[1]  # minus one bias per output channel
        for layer in vgg_a.layers
        if layer.type == "Conv2d"
    )
    assert conv_weights == 9_217_728


def test_vgg_a_counts_16_layers_pooling_included(vgg_a):
    layers = paper_layers(vgg_a)
    kinds = [layer.type for layer in layers]
    assert len(layers) == 16
    assert (
        kinds.count("Conv2d") == 8 and kinds.count("MaxPool2d") == 5 and kinds.count("Linear") == 3
    )
    # torchvision's AdaptiveAvgPool2d is the identity at 224x224 and not a layer of VGG-A.
    assert "avgpool" not in [layer.name for layer in layers]
    assert len(fc_layers(layers)) == 3


@pytest.mark.parametrize(
    ("k", "chunk1", "chunk2"),
    [
        (3, 4_097_000, 9_220_480),
        (6, 8_816_616, 4_500_864),
        (9, 12_356_584, 960_896),
        (12, 13_241_832, 75_648),
    ],
)
def test_chunk_sizes_with_f2(vgg_a, k, chunk1, chunk2):
    layers = paper_layers(vgg_a)
    plan = chunk_plan(layers, k, f=2)
    assert plan.numel(layers) == (chunk1, chunk2)
    assert plan.replicated == ("classifier.0", "classifier.3")
    # Erratum of Algorithm 2: chunk 1 ends at l = L-k (not l = k) ...
    assert plan.boundary == layers[len(layers) - k].name
    # ... which for the paper's k = 3, 6, 9, 12 puts the split at a pooling layer.
    assert is_pool(layers[len(layers) - k - 1].type)


def test_k9_chunk_ends_at_pool3(vgg_a):
    layers = paper_layers(vgg_a)
    pools = [layer.name for layer in layers if is_pool(layer.type)]
    assert layers[len(layers) - 9 - 1].name == pools[2]


def test_fc1_gather_arithmetic(vgg_a):
    fc1 = fc_layers(paper_layers(vgg_a))[0]
    k_b, k_c, rows_per_sample = fc_shape(fc1)
    assert (k_b, k_c, rows_per_sample) == (25_088, 4_096, 1)
    reduced, gathered = fc_replication_values(k_b, k_c, rows=256 * rows_per_sample)
    assert reduced == 102_760_448
    assert gathered == 7_471_104
    assert reduced * 4 / MiB == 392.0
    assert gathered * 4 / MiB == 28.5


def _vgg_a_costs(vgg_a) -> StepCosts:
    layers = paper_layers(vgg_a)
    out = []
    for layer in layers:
        fc = None
        if layer.is_fc:
            k_b, k_c, rows = fc_shape(layer)
            fc = FcCost(k_b, k_c, 32 * rows, 1e-3, 2e-3)
        out.append(
            LayerCost(
                layer.name, 0.01, 0.02, (layer.param_numel * 4,) if layer.param_numel else (), fc
            )
        )
    return StepCosts(tuple(out), 1e-11, 0.0, 8, lambda n: 1e-5 + n / 1e9, lambda n: 1e-5 + n / 2e9)


@pytest.mark.parametrize("f", [0, 1, 2, 3])
def test_2f_plus_2_communications_per_iteration(vgg_a, f):
    pred = predict_two_chunk(_vgg_a_costs(vgg_a), k=9, f=f)
    names = [c.name for c in pred.comms]
    assert len(names) == 2 * f + 2
    assert names.count("chunk1") == names.count("chunk2") == 1


def test_overlap_ratio_worked_example():
    records = [
        CommRecord("chunk1", 0, own_s=4.0, blocked_s=1.0),
        CommRecord("chunk2", 0, own_s=2.0, blocked_s=0.0),
    ]
    assert overlap_ratio(records) == pytest.approx(83.333, abs=1e-3)
    assert round(overlap_ratio(records), 1) == 83.3
    assert overlap_ratio([]) is None


def test_k_and_f_out_of_range_name_the_knob(vgg_a):
    layers = paper_layers(vgg_a)
    with pytest.raises(ConfigError, match=r"overlap_chunking\.k: 17 .* k is 1\.\.16"):
        chunk_plan(layers, 17, 0)
    with pytest.raises(ConfigError, match=r"overlap_chunking\.f: 4 .* f is 0\.\.3"):
        chunk_plan(layers, 9, 4)
