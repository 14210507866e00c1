"""Per-layer times against the whole model's forward and backward, on the real clock.

    .venv/bin/python benchmarks/layer_times_add_up.py [--rounds 3]

``tunekit.observe.layer_profile`` times each layer standalone, at the threads a rank
gets, on the thread's CPU clock; the layers' times should then add up to the whole
model's. tests/unit/test_observe_layer_profile.py checks the sum on a clock driven by
the work done (no machine's speed in it); this reports it on the clock the profiler
really uses, beside the wall clock at every core's threads (how layers were timed
before), alternating the two so that a busy machine slows both alike. Prints, per
model, the median ratio of the layers' sum to the whole model (1.00: they add up).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from tunekit.examples import cnn
from tunekit.observe.graph import trace_model
from tunekit.observe.layer_profile import profile_layers, timing_clock
from tunekit.observe.step_timing import intra_op_threads


def whole_model_s(model: nn.Module, x: torch.Tensor, repeats: int = 5) -> float:
    """Median forward + backward of the whole model, on the clock layer timings use."""
    clock, _ = timing_clock("cpu")
    times = []
    for _ in range(repeats + 1):
        t0 = clock()
        out = model(x)
        out.backward(torch.ones_like(out))
        times.append(clock() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def ratio(model: nn.Module, x: torch.Tensor, graph, threads: int | None) -> float:
    prof = profile_layers(model, x, graph, warmup=1, repeats=5, threads=threads)
    with intra_op_threads(threads):
        whole = whole_model_s(model, x)
    return (prof.forward_s + prof.backward_s) / whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torchvision

    models = {
        "example_cnn": (cnn.build_model, (32, 3, 32, 32)),
        "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (8, 3, 64, 64)),
    }
    every_core = torch.get_num_threads()
    print(f"{'model':<12} {'1 thread, thread CPU clock':>28} {f'{every_core} threads, wall':>20}")
    for name, (build, shape) in models.items():
        torch.manual_seed(0)
        model = build().train()
        x = torch.randn(shape)
        graph = trace_model(model, x)
        one, every = [], []
        for _ in range(args.rounds):  # alternated: load slows both alike
            one.append(ratio(model, x, graph, threads=1))
            every.append(ratio(model, x, graph, threads=every_core))
        print(
            f"{name:<12} {statistics.median(one):>25.2f}x "
            f"({min(one):.2f}-{max(one):.2f}) {statistics.median(every):>12.2f}x "
            f"({min(every):.2f}-{max(every):.2f})"
        )


if __name__ == "__main__":
    main()
