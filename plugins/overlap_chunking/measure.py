"""The per-rank times the cost model needs, measured in this process.

* per paper layer: forward time, and backward time as "when has backprop
  passed this layer" (the core's gradient-ready timing,
  :func:`tunekit.observe.grad_timing.time_groups`);
* the optimizer step per parameter byte, and the time to get a batch;
* per fully-connected layer: its shape (what replicating its gradient
  gathers; the plugin derives the weight-gradient times from the layer's
  backward time).

Layer times come from the observation's layer profile when it has one
(:func:`layer_times_from_profile`), else from :func:`measure_layer_times`,
which runs the workload's model on one rank's batch with the thread count a
trial rank gets.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tunekit.api import (
    Clock,
    LayerProfile,
    ModelGraph,
    Workload,
    intra_op_threads,
    time_groups,
    to_device,
)
from tunekit.plugins.overlap_chunking.layers import PaperLayer


@dataclass
class LayerTime:
    name: str
    forward_s: float
    backward_s: float


@dataclass
class StepProfile:
    """Measured times of one rank's step (see the module docstring)."""

    batch: int
    world: int
    layers: list[LayerTime]
    update_s_per_byte: float
    data_s: float
    source: str
    """Where the layer times came from: ``measured`` or ``observation``."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        return cls(
            **{
                **data,
                "layers": [LayerTime(**x) for x in data["layers"]],
            }
        )


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median time of ``fn()`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        clock = Clock(device)
        clock.mark(("a",))
        fn()
        clock.mark(("b",))
        samples.append(clock.times()[("b",)])
    return _median(samples)


def measure_layer_times(
    workload: Workload,
    layers: list[PaperLayer],
    *,
    batch: int,
    device: torch.device,
    threads: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
) -> tuple[list[LayerTime], float, float]:
    """Per paper layer (forward_s, backward_s), update time per byte, batch time.

    Forward time of a layer runs from its start to the next paper layer's start
    (so activations that follow it are its own). Backward: for each layer the
    time at which backprop has passed it (its parameter gradients accumulated
    and its input's gradient computed); made monotone from the output end and
    differenced, so the cumulative sums give when each chunk is ready.
    """
    rng = torch.get_rng_state()
    with intra_op_threads(threads if device.type == "cpu" else None):
        try:
            torch.manual_seed(workload.seed)
            model = workload.model().to(device)
            model.train()
            optimizer = workload.optimizer(model.parameters(), workload.lr)
            data_s = _median(
                [
                    _timed(lambda: workload.example_batch(batch, seed=1), torch.device("cpu"), 1)
                    for _ in range(2)
                ]
            )
            inputs, targets = workload.example_batch(batch, seed=1)
            inputs = to_device(inputs, device)
            targets = to_device(targets, device)
            return (
                *_profile_model(
                    model, optimizer, workload, layers, inputs, targets, device, warmup, repeats
                ),
                data_s,
            )
        finally:
            torch.set_rng_state(rng)


def _profile_model(model, optimizer, workload, layers, inputs, targets, device, warmup, repeats):
    timing = time_groups(
        model,
        optimizer,
        workload.loss,
        inputs,
        targets,
        [(layer.name, [layer.name]) for layer in layers],
        device=device,
        warmup=warmup,
        repeats=repeats,
    )
    times = [LayerTime(g.name, g.forward_s, g.backward_s) for g in timing.groups]
    return times, timing.update_s / max(timing.param_bytes, 1)


def layer_times_from_profile(
    profile: LayerProfile,
    layers: list[PaperLayer],
    graph: ModelGraph | None = None,
    batch: int | None = None,
) -> list[LayerTime] | None:
    """Paper-layer times from the observation's layer profile, or None if it has no usable ones.

    ``profile.layers`` holds records with ``name``, ``forward_s`` and
    ``backward_s`` in forward order (a dict or a list). A record names a layer
    of ``graph`` (:class:`~tunekit.observe.graph.ModelGraph`: its member nodes
    give module paths) or a module path itself. Its time goes to the first
    paper layer among its modules; records with none (activations, dropout, a
    concat) go to the paper layer before them. Times are scaled linearly from
    the profile's batch to ``batch``.
    """
    records = list(profile.layers.values())
    if not records:
        return None
    paper = {layer.name: i for i, layer in enumerate(layers)}
    scale = 1.0
    if batch and profile.batch_size:
        scale = batch / profile.batch_size
    fwd = [0.0] * len(layers)
    bwd = [0.0] * len(layers)
    seen: set[int] = set()
    owner = None
    for rec in records:
        f, b = rec.forward_s, rec.backward_s
        owned = [paper[m] for m in _module_paths(rec.name, graph) if m in paper]
        if owned:
            owner = owned[0]
            seen.update(owned)
        if owner is not None and math.isfinite(f) and math.isfinite(b):
            fwd[owner] += f * scale
            bwd[owner] += b * scale
    if len(seen) != len(layers):
        return None
    return [LayerTime(layer.name, fwd[i], bwd[i]) for i, layer in enumerate(layers)]


def _module_paths(record_name: str, graph: ModelGraph | None) -> list[str]:
    """Module paths a profile record covers: its graph layer's module calls, or its own name."""
    if graph is None or record_name not in graph.layers:
        return [record_name]
    nodes = graph.nodes
    return [
        nodes[n].target
        for n in graph.layers[record_name].nodes
        if n in nodes and nodes[n].module_type is not None
    ]


def measure_update_and_batch(
    workload: Workload,
    *,
    batch: int,
    device: torch.device,
    threads: int | None = None,
    repeats: int = 3,
) -> tuple[float, float]:
    """(optimizer step time per parameter byte, time to make one batch)."""
    rng = torch.get_rng_state()
    with intra_op_threads(threads if device.type == "cpu" else None):
        try:
            torch.manual_seed(workload.seed)
            model = workload.model().to(device)
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = workload.optimizer(params, workload.lr)
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            update = _timed(optimizer.step, device, repeats)
            data = _timed(
                lambda: workload.example_batch(batch, seed=1), torch.device("cpu"), repeats
            )
        finally:
            torch.set_rng_state(rng)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return update / max(nbytes, 1), data


def fc_shape(layer: PaperLayer) -> tuple[int, int, int]:
    """(K_b, K_c, rows per sample) of a fully-connected layer from its summary."""
    shape = layer.output_shape or ()
    out_features = int(shape[-1]) if shape else 0
    if not out_features:
        raise ValueError(f"{layer.name}: no output shape recorded")
    has_bias = any(n.endswith("bias") for n in layer.param_names)
    in_features = (layer.param_numel - (out_features if has_bias else 0)) // out_features
    rows = math.prod(shape[1:-1]) if len(shape) > 2 else 1
    return in_features, out_features, int(rows)
