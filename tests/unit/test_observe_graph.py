"""The model graph: torch.fx trace, shapes, FLOPs, layers, hooks fallback, stable hash."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from tunekit.errors import WorkloadError
from tunekit.examples import cnn
from tunekit.observe.graph import ModelGraph, trace_model

torchvision = pytest.importorskip("torchvision")


@pytest.fixture(scope="module")
def alexnet_graph() -> ModelGraph:
    return trace_model(torchvision.models.alexnet(), torch.randn(1, 3, 224, 224))


@pytest.fixture(scope="module")
def inception_graph() -> ModelGraph:
    model = torchvision.models.inception_v3(aux_logits=False, init_weights=False)
    return trace_model(model, torch.randn(1, 3, 299, 299))


def test_alexnet_parameters_and_layers(alexnet_graph):
    g = alexnet_graph
    assert g.method == "fx" and g.notice == ""
    assert g.total_params() == 61_100_840
    kinds = [lay.kind for lay in g.layers.values()]
    assert kinds.count("conv") == 5
    assert kinds.count("linear") == 3
    assert kinds.count("pool") == 4  # three max pools and the adaptive average pool
    # A chain: every layer but the input has exactly one producer.
    assert all(len(lay.inputs) == 1 for lay in g.layers.values() if lay.kind != "input")
    fc1 = next(lay for lay in g.layers.values() if lay.kind == "linear")
    assert fc1.param_numel == 9216 * 4096 + 4096
    assert fc1.attrs == {"in_features": 9216, "out_features": 4096}
    assert fc1.flops == 2 * 9216 * 4096  # batch 1, FlopCounterMode counts 2 per MAC
    conv1 = g.layers["features_0"]
    assert conv1.nodes == ["features_0", "features_1"]  # the ReLU is folded in
    assert conv1.output_shape == [1, 64, 55, 55]
    assert conv1.activation_bytes == 64 * 55 * 55 * 4
    assert conv1.attrs["kernel_size"] == [11, 11] and conv1.attrs["stride"] == [4, 4]
    assert conv1.attrs["padding"] == [2, 2]
    # 2 * k*k*Cin * Cout * H*W for the first conv
    assert conv1.flops == 2 * 11 * 11 * 3 * 64 * 55 * 55


def test_inception_v3_is_a_dag_with_parallel_towers(inception_graph):
    g = inception_graph
    model_params = sum(
        p.numel()
        for p in torchvision.models.inception_v3(aux_logits=False, init_weights=False).parameters()
    )
    assert g.total_params() == model_params
    concats = [lay for lay in g.layers.values() if lay.kind == "concat"]
    # 11 mixed blocks join their towers; the two InceptionE blocks also join 2 inner pairs each.
    assert len(concats) == 15
    assert sum(len(c.inputs) == 4 for c in concats) >= 9
    # A Mixed_5b tower: 1x1 conv -> 5x5 conv, parallel to the other towers.
    first = concats[0]
    assert "mixed_5b_branch5x5_2_conv" in first.inputs
    assert g.predecessors("mixed_5b_branch5x5_2_conv") == ["mixed_5b_branch5x5_1_conv"]
    fork = g.predecessors("mixed_5b_branch1x1_conv")[0]
    assert len(g.successors(fork)) == 4  # the fork feeds all four towers
    assert first.output_shape == [1, 256, 35, 35]
    # Topological order: every producer precedes its consumer.
    order = {name: i for i, name in enumerate(g.layers)}
    assert all(order[a] < order[b] for a, b in g.layer_edges())


def test_cnn_example_graph_and_batch_override():
    w = cnn.workload()
    g = trace_model(w.model(), w.example_batch(4)[0])
    assert g.batch_size == 4
    assert g.total_params() == sum(p.numel() for p in w.model().parameters())
    assert [lay.kind for lay in g.layers.values()] == (
        ["input"] + ["conv", "pool"] * 3 + ["linear"] * 3 + ["output"]
    )
    g32 = trace_model(w.model(), w.example_batch(4)[0], batch_size=32)
    assert g32.batch_size == 32
    assert g32.layers["_0"].output_shape == [32, 32, 32, 32]  # fx names child 0 "_0"
    assert g32.total_flops() == 8 * g.total_flops()  # FLOPs scale with the batch
    assert g32.graph_hash() != g.graph_hash()


def test_layers_are_labelled_by_their_modules():
    """Issue 35: the TUI named layers "_3", "_6" (fx's node names for ``model[3]``)."""
    w = cnn.workload()
    g = trace_model(w.model(), w.example_batch(2)[0])
    labels = g.layer_labels()
    assert (
        labels["_0"] == "0 Conv2d" and labels["_3"] == "3 Conv2d" and labels["_10"] == "10 Linear"
    )
    assert labels["input_1"] == "input_1"  # not a module call: its own name

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.features(x).mean((2, 3))) + 1

    g = trace_model(Named(), torch.randn(2, 3, 8, 8))
    assert {"features.0 Conv2d", "head Linear", "add"} <= set(g.layer_labels().values())


def test_to_dict_round_trip_is_json_and_keeps_the_hash():
    w = cnn.workload()
    g = trace_model(w.model(), w.example_batch(2)[0])
    again = ModelGraph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again.graph_hash() == g.graph_hash()
    assert again.layer_edges() == g.layer_edges()
    assert again.nodes == g.nodes


def test_graph_hash_is_stable_across_processes():
    w = cnn.workload()
    here = trace_model(w.model(), w.example_batch(2)[0]).graph_hash()
    code = (
        "from tunekit.examples import cnn; from tunekit.observe.graph import trace_model; "
        "w = cnn.workload(); print(trace_model(w.model(), w.example_batch(2)[0]).graph_hash())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


class _DataDependent(nn.Module):
    """fx cannot trace a branch on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.act(self.fc1(x))
        if h.sum() > 0:
            h = h * 2
        return self.fc2(h)


def test_untraceable_model_falls_back_to_hooks_with_a_notice():
    g = trace_model(_DataDependent(), torch.randn(3, 8))
    assert g.method == "hooks"
    assert "torch.fx could not trace _DataDependent" in g.notice
    assert list(g.layers) == ["input", "fc1", "fc2", "output"]
    assert g.layers["fc1"].nodes == ["fc1", "act"]
    assert g.layer_edges() == [("input", "fc1"), ("fc1", "fc2"), ("fc2", "output")]
    assert g.total_params() == 8 * 16 + 16 + 16 * 4 + 4
    assert g.layers["fc2"].flops == 2 * 3 * 16 * 4


def test_weight_sharing_counts_parameters_once():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(self.fc(x))

    g = trace_model(Shared(), torch.randn(2, 4))
    assert g.total_params() == 20
    assert g.total_flops() == 2 * (2 * 2 * 4 * 4)


def test_model_that_cannot_run_is_one_clear_error():
    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("shape mismatch")

    with pytest.raises(WorkloadError, match="cannot trace Broken.*shape mismatch"):
        trace_model(Broken(), torch.randn(1))


def test_tracing_restores_training_mode_and_leaves_buffers_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    before = model[1].running_mean.clone()
    g = trace_model(model, torch.randn(2, 3, 8, 8))
    assert model.training
    assert torch.equal(model[1].running_mean, before)
    assert g.layers["_0"].nodes == ["_0", "_1", "_2"]  # conv + bn + relu
