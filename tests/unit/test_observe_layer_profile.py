"""Per-layer timing and activation memory; layer times that add up to the model's."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from tunekit.examples import cnn
from tunekit.observe.graph import trace_model
from tunekit.observe.layer_profile import LayerProfile, profile_layers, timing_clock
from tunekit.observe.step_timing import intra_op_threads

B = 8


@pytest.fixture(scope="module")
def cnn_model_and_graph():
    torch.manual_seed(0)
    w = cnn.workload()
    model = w.model()
    x = w.example_batch(B)[0]
    return model, x, trace_model(model, x)


def test_profile_times_every_layer_and_counts_saved_activations(cnn_model_and_graph):
    model, x, graph = cnn_model_and_graph
    prof = profile_layers(model, x, graph, warmup=1, repeats=2, hardware_fingerprint="hw1")
    timed = [n for n, lay in graph.layers.items() if lay.kind not in ("input", "output")]
    assert list(prof.layers) == timed
    assert all(t.forward_s > 0 for t in prof.layers.values())
    # Every layer but the first has inputs needing gradients, and all have parameters or inputs.
    assert all(t.backward_s > 0 for t in prof.layers.values())
    conv1 = prof.layers["_0"]
    assert conv1.memory_method == "saved_tensors"
    # conv saves its input (B x 3 x 32 x 32), ReLU saves its output (B x 32 x 32 x 32); fp32.
    assert conv1.activation_bytes == 4 * (B * 3 * 32 * 32 + B * 32 * 32 * 32)
    # max pool saves its input and int64 indices of its output.
    assert prof.layers["_2"].activation_bytes == 4 * B * 32 * 32 * 32 + 8 * B * 32 * 16 * 16
    assert prof.graph_hash == graph.graph_hash()
    assert prof.cache_key() == f"layer_profile:{graph.graph_hash()}:hw1:cpu"
    assert prof.top(2) == sorted(prof.layers.values(), key=lambda t: -t.total_s)[:2]


def test_layer_profile_round_trips_through_json(cnn_model_and_graph):
    model, x, graph = cnn_model_and_graph
    prof = profile_layers(model, x, graph, warmup=0, repeats=1, layers=["_10"])
    assert list(prof.layers) == ["_10"]
    again = LayerProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof


def test_profile_works_on_a_hooks_fallback_graph():
    class Dyn(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)

        def forward(self, x):
            h = self.act(self.fc1(x))
            return self.fc2(h * 2 if h.sum() > 0 else h)

    model = Dyn()
    prof = profile_layers(model, torch.randn(4, 8), warmup=0, repeats=1)
    assert list(prof.layers) == ["fc1", "fc2"]
    assert prof.layers["fc1"].forward_s > 0
    # fc1 saves its input (4x8) and the ReLU its output (4x16).
    assert prof.layers["fc1"].activation_bytes == 4 * (4 * 8 + 4 * 16)


# -- per-layer times add up to the whole model ---------------------------------------------


class WorkClock(TorchDispatchMode):
    """A clock that advances by the floating-point work of every op this thread runs (forward
    and backward; ``torch.utils.flop_counter``'s formulas), a nanosecond a flop: what a layer
    costs, the same on every run and whatever else shares the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out

    def __call__(self) -> float:
        return self.flops * 1e-9


def _whole_model_s(model: nn.Module, x: torch.Tensor) -> float:
    """Forward + backward of the whole model, on the clock layer timings use."""
    clock, _ = timing_clock("cpu")
    t0 = clock()
    out = model(x)
    out.backward(torch.ones_like(out))
    took = clock() - t0
    model.zero_grad(set_to_none=True)
    return took


def _small_resnet() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10)


@pytest.mark.parametrize(
    ("build", "shape"),
    [(cnn.build_model, (32, 3, 32, 32)), (_small_resnet, (8, 3, 64, 64))],
    ids=["example_cnn", "resnet18"],
)
def test_layer_times_add_up_to_the_whole_models_forward_and_backward(build, shape, monkeypatch):
    """Each layer timed standalone (its member ops forward; backward to its inputs, unless they
    are the model's, and its parameters) adds up to the whole model's forward and backward: no
    layer left out, none counted twice, no backward run further than the layer. Timed at the
    threads a rank gets (one, on a 2-core machine with 2 ranks) on the thread's CPU clock, which
    this test drives by the work done (:class:`WorkClock`): before, layers were timed on the wall
    clock at every core's threads and their sum came to several times the step.
    benchmarks/layer_times_add_up.py reports the same comparison on the real clock."""
    torch.manual_seed(0)
    model = build().train()
    x = torch.randn(shape)
    graph = trace_model(model, x)
    clock = WorkClock()
    monkeypatch.setattr(time, "thread_time", clock)  # what timing_clock gives at one thread
    with clock:
        prof = profile_layers(model, x, graph, warmup=0, repeats=1, threads=1)
        with intra_op_threads(1):
            whole = _whole_model_s(model, x)
    assert prof.clock == "thread_cpu" and prof.torch_threads == 1
    summed = prof.forward_s + prof.backward_s
    assert whole > 0
    assert summed == pytest.approx(whole, rel=ADD_UP_TOLERANCE), (
        f"layers vs whole model: {summed * 1e3:.1f} vs {whole * 1e3:.1f} ms of work"
    )


ADD_UP_TOLERANCE = 0.01
"""On the work clock the sum is the model's to rounding; a layer counted twice or left out
moves it by far more (the smallest layer here is well over 1% of either model)."""
