"""Measurements behind the cost model: per-layer backward times, host rates, sync overhead.

``t_bp`` per layer is timed from gradient readiness (the core's
:func:`tunekit.observe.grad_timing.time_groups`, which overlap_chunking uses
too): the moment backprop has passed each parameterised layer, and a layer's
``t_bp`` is the gap to the previous one. That is the quantity CGDP cares
about: the time between two possible synchronisation points.

For hardware one does not have, :func:`estimate_backward_times` turns the
backward FLOPs of each layer (``torch.utils.flop_counter``) into seconds at a
fraction of the device's peak.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tunekit.costmodel import ComputeRate
from tunekit.observe.grad_timing import time_groups
from tunekit.plugins.cgdp.model import HostRates, host_sum_bandwidth
from tunekit.plugins.cgdp.runtime import parameterised_layers

MiB = 1024 * 1024


@dataclass
class LayerTimes:
    """Parameterised layers in the order backward finished them, with their costs."""

    names: list[str]
    t_bp: list[float]
    """Seconds per layer (gap to the previous layer's gradients being ready)."""
    nbytes: list[int]
    """Gradient bytes per layer."""

    def to_dict(self) -> dict[str, Any]:
        return {"names": self.names, "t_bp": self.t_bp, "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerTimes:
        return cls(list(d["names"]), [float(x) for x in d["t_bp"]], [int(x) for x in d["nbytes"]])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer_backward(
    model: nn.Module,
    inputs: Any,
    targets: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    repeats: int = 5,
    warmup: int = 1,
) -> LayerTimes:
    """Median ``t_bp`` per parameterised layer over ``repeats`` steps (after ``warmup``), in
    backward order, from the core's gradient-ready timing (:func:`time_groups`)."""
    device = next(model.parameters()).device
    layers = parameterised_layers(model)
    # A zero learning rate: the steps time backward without changing the model.
    optimizer = torch.optim.SGD([p for layer in layers for p in layer.params], lr=0.0)
    try:
        timing = time_groups(
            model, optimizer, loss_fn, inputs, targets,
            [(layer.name, [layer.path]) for layer in layers],
            device=device, warmup=warmup, repeats=repeats,
        )
    finally:
        model.zero_grad(set_to_none=True)
    order = list(reversed(range(len(layers))))
    return LayerTimes(
        names=[layers[i].name for i in order],
        t_bp=[timing.groups[i].backward_s for i in order],
        nbytes=[sum(p.numel() * p.element_size() for p in layers[i].params) for i in order],
    )


def estimate_backward_times(
    model: nn.Module,
    inputs: Any,
    targets: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    peak_flops: float,
    efficiency: float = 0.4,
) -> LayerTimes:
    """Per-layer backward time on another device: backward FLOPs / (peak * efficiency).

    Layers in reverse registration order (backward order for sequential
    models). Layers without counted FLOPs (normalisation) get 0.
    """
    layers = parameterised_layers(model)
    root = type(model).__name__
    with FlopCounterMode(display=False) as fwd:
        loss = loss_fn(model(inputs), targets)
    forward = fwd.get_flop_counts()
    with FlopCounterMode(display=False) as both:
        loss_fn(model(inputs), targets).backward()
    total = both.get_flop_counts()
    model.zero_grad(set_to_none=True)
    del loss

    def flops(counts: dict, name: str) -> int:
        return sum(counts.get(f"{root}.{name}", {}).values())

    rate = ComputeRate.assumed(peak_flops, efficiency)
    ordered = list(reversed(layers))
    return LayerTimes(
        names=[layer.name for layer in ordered],
        t_bp=[
            rate.seconds(max(0, flops(total, layer.name) - flops(forward, layer.name)))
            for layer in ordered
        ],
        nbytes=[sum(p.numel() * p.element_size() for p in layer.params) for layer in ordered],
    )


def backward_times_from_profile(model: nn.Module, graph: Any, profile: Any) -> LayerTimes | None:
    """Per-layer ``t_bp`` from the observation's layer profile, when it covers every layer.

    ``graph`` is a :class:`tunekit.observe.graph.ModelGraph` and ``profile`` a
    :class:`tunekit.observe.layer_profile.LayerProfile` of ``model``. A graph
    layer folds elementwise modules (batch norm) into the op before them; its
    backward time goes to the module it is anchored on, the last of them in
    backward, and the folded ones get 0. Layers in reverse registration order.
    Returns None when a parameterised module has no timed graph layer.
    """
    layer_of_module = {n.target: n.layer for n in graph.nodes.values() if n.module_type}
    anchor_of = {name: lay.nodes[0] for name, lay in graph.layers.items() if lay.nodes}
    ordered = list(reversed(parameterised_layers(model)))
    t_bp = []
    for layer in ordered:
        glayer = layer_of_module.get(layer.name)
        timing = profile.layers.get(glayer) if glayer else None
        if timing is None:
            return None
        is_anchor = graph.nodes[anchor_of[glayer]].target == layer.name
        t_bp.append(timing.backward_s if is_anchor else 0.0)
    return LayerTimes(
        names=[layer.name for layer in ordered],
        t_bp=t_bp,
        nbytes=[sum(p.numel() * p.element_size() for p in layer.params) for layer in ordered],
    )


# -- host rates ----------------------------------------------------------------------------------


def _best_time(fn: Callable[[], None], device: torch.device, repeats: int = 7) -> float:
    """Fastest of ``repeats`` runs: a bandwidth probe wants what the hardware can do, not the noise."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_bandwidths(device: torch.device, nbytes: int = 16 * MiB) -> tuple[float, float]:
    """Measured (device->host, host->device) bytes/s; a plain memory copy for a CPU rank."""
    n = nbytes // 4
    if device.type == "cuda":
        host = torch.empty(n, pin_memory=True)
        dev = torch.empty(n, device=device)
        d2h = _best_time(lambda: host.copy_(dev, non_blocking=True), device)
        h2d = _best_time(lambda: dev.copy_(host, non_blocking=True), device)
        return nbytes / d2h, nbytes / h2d
    src, dst = torch.ones(n), torch.empty(n)
    t = _best_time(lambda: dst.copy_(src), device)
    return nbytes / t, nbytes / t


def host_add_bandwidth(nbytes: int = 16 * MiB, threads: int | None = 1) -> float:
    """Bytes/s of adding one host buffer into another (one contribution of a host sum).

    Measured on ``threads`` threads (one by default: a per-core rate that
    does not depend on how busy the other cores are).
    """
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return nbytes / _best_time(lambda: a.add_(b), torch.device("cpu"))
    finally:
        torch.set_num_threads(before)


def fit_gloo_allreduce(
    group: dist.ProcessGroup, sizes: tuple[int, ...] = (64 * 1024, 8 * MiB)
) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of gloo all-reduce of host tensors; call on every rank."""
    points = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)
        dist.all_reduce(t, group=group)
        times = []
        for _ in range(10):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            times.append(time.perf_counter() - t0)
        points.append((nbytes, min(times)))  # the link's speed, not a neighbour's burst
    (n0, t0), (n1, t1) = points[0], points[-1]
    bw = (n1 - n0) / max(t1 - t0, 1e-9)
    return max(0.0, t0 - n0 / bw), bw


def measure_sync_overhead(device: torch.device, layers: int = 32, steps: int = 6) -> float:
    """``t_as`` in practice: seconds the backward thread spends launching one chunk.

    Runs CGDP on one rank over a deep model of tiny layers and divides the
    time spent in chunk launches by the number of chunks. Excludes the
    collective's own launch, which the reduction latency accounts for.
    """
    from tunekit.plugins.cgdp.runtime import CgdpSync
    from tunekit.runtime.session import Session
    from tunekit.workload import Workload

    def model() -> nn.Module:
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])

    def batch(n: int, gen: torch.Generator):
        return torch.randn(n, 8, generator=gen), torch.randn(n, 8, generator=gen)

    work = Workload(
        name="cgdp-sync-probe",
        model=model,
        make_batch=batch,
        batch_size=4,
        loss=nn.functional.mse_loss,
    )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        session = Session(work, device=device)
        sync = CgdpSync(chunk_size=1)
        session.set_grad_sync(sync)
        per_chunk = []
        for _ in range(steps):
            session.train_step()
            per_chunk.append(sync.hook_s / len(sync.chunks))
        session.close()
    return statistics.median(per_chunk[1:])


def measure_host_rates(
    device: torch.device, world_size: int, group: dist.ProcessGroup | None = None
) -> HostRates:
    """This machine's rates for the cost model.

    With ``group`` (call on every rank) the host reduction is a measured gloo
    all-reduce fit; without it, the host adds G contributions at its measured
    add bandwidth, the paper's host-side sum.
    """
    d2h, h2d = copy_bandwidths(device)
    if group is not None and world_size > 1:
        latency, reduce_bw = fit_gloo_allreduce(group)
        source = "measured copies and gloo all-reduce"
    else:
        adds = host_add_bandwidth(threads=None)
        latency, reduce_bw = 0.0, host_sum_bandwidth(adds, world_size)
        source = "measured copies and host adds"
    return HostRates(
        d2h_bw=d2h,
        h2d_bw=h2d,
        reduce_bw=reduce_bw,
        reduce_latency=latency,
        sync_s=measure_sync_overhead(device),
        source=source,
    )
