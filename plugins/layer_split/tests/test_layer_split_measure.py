"""One worker's slice of a layer under a DeePa split, timed standalone (``measure.py``)."""

from __future__ import annotations

import pytest
import torch

from tunekit.examples import cnn
from tunekit.observe.graph import trace_model
from tunekit.plugins.layer_split.measure import SplitTimer, parse_split, time_layer_split

B = 8


@pytest.fixture(scope="module")
def cnn_model_and_graph():
    torch.manual_seed(0)
    w = cnn.workload()
    model = w.model()
    x = w.example_batch(B)[0]
    return model, x, trace_model(model, x)


@pytest.mark.parametrize(
    ("layer", "split", "inputs", "output"),
    [
        # conv 3x3 stride 1 pad 1, output 8x32x32x32: the h/w halo is one row/col each side.
        ("_0", (1, 1, 1, 1), [[B, 3, 32, 32]], [B, 32, 32, 32]),
        ("_0", (2, 1, 1, 1), [[B // 2, 3, 32, 32]], [B // 2, 32, 32, 32]),
        ("_0", (1, 4, 1, 1), [[B, 3, 32, 32]], [B, 8, 32, 32]),
        ("_0", (1, 1, 2, 2), [[B, 3, 18, 18]], [B, 32, 16, 16]),
        ("_0", (1, 1, 4, 1), [[B, 3, 10, 32]], [B, 32, 8, 32]),
        # max pool 2x2 stride 2: a slice of 8 output rows reads 16 input rows, channels split.
        ("_2", (1, 2, 2, 1), [[B, 16, 16, 32]], [B, 16, 8, 16]),
        # linear: all input features, out_features / c
        ("_10", (2, 4, 1, 1), [[B // 2, 2048]], [B // 2, 128]),
    ],
)
def test_split_slice_shapes(cnn_model_and_graph, layer, split, inputs, output):
    model, _, graph = cnn_model_and_graph
    timer = SplitTimer(model, graph, warmup=0, repeats=1)
    t = timer.time(layer, split)
    assert t.input_shapes == inputs
    assert t.output_shape == output
    assert t.forward_s > 0 and t.backward_s > 0
    assert t.split == parse_split(split)


def test_split_rescales_the_batch(cnn_model_and_graph):
    model, _, graph = cnn_model_and_graph
    t = time_layer_split(model, graph, "_3", {"n": 4}, batch_size=64, warmup=0, repeats=1)
    assert t.batch_size == 64
    assert t.input_shapes == [[16, 32, 16, 16]]
    assert t.output_shape == [16, 64, 16, 16]


def test_strided_conv_halo_and_inception_towers():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.inception_v3(aux_logits=False, init_weights=False)
    graph = trace_model(model, torch.randn(1, 3, 149, 149))  # small input: a fast test
    timer = SplitTimer(model, graph, warmup=0, repeats=1)
    # First conv: 3x3 stride 2, no padding, 74x74 output; 2 row slices of 37 rows
    # read (37 - 1) * 2 + 3 = 75 input rows.
    t = timer.time("conv2d_1a_3x3_conv", {"h": 2})
    assert t.input_shapes == [[1, 3, 75, 149]]
    assert t.output_shape == [1, 32, 37, 74]
    # A concat of four towers, channel-split 2 ways: every input halves its channels.
    t = timer.time("cat", {"c": 2})
    assert t.output_shape == [1, 128, 16, 16]
    assert [s[1] for s in t.input_shapes] == [32, 32, 48, 16]
    # A functional avg_pool2d (3x3, stride 1, pad 1) split 5 ways in h: ceil(16/5) = 4
    # output rows read 4 - 1 + 3 = 6 input rows, without padding.
    t = timer.time("avg_pool2d", {"h": 5})
    assert t.output_shape == [1, 192, 4, 16]
    assert t.input_shapes == [[1, 192, 6, 16]]


def test_impossible_splits_are_refused(cnn_model_and_graph):
    model, _, graph = cnn_model_and_graph
    timer = SplitTimer(model, graph, warmup=0, repeats=1)
    with pytest.raises(ValueError, match="no h/w dims"):
        timer.time("_10", (1, 1, 2, 1))
    with pytest.raises(ValueError, match="n, c, h, w"):
        parse_split({"x": 2})
    with pytest.raises(ValueError, match=">= 1"):
        parse_split((0, 1, 1, 1))
    with pytest.raises(ValueError, match="no layer"):
        timer.time("nope", (1, 1, 1, 1))


def test_threads_are_set_for_the_timing_and_restored(cnn_model_and_graph):
    model, _, graph = cnn_model_and_graph
    before = torch.get_num_threads()
    timer = SplitTimer(model, graph, warmup=0, repeats=1, threads=1)
    t = timer.time("_3", {"n": 2})
    assert t.clock == "thread_cpu" and t.forward_s > 0
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        SplitTimer(model, graph, threads=0)
