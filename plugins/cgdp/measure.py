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

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tunekit.api import (
    CollectiveFit,
    ComputeRate,
    Estimate,
    allreduce_timings,
    bandwidth_estimate,
    copy_timings,
    fit_samples,
    time_groups,
    timed_rounds,
)
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
    backward_share: float | None = None
    """Backward's share of forward + backward, measured with the layers (None: unknown).
    It splits the baseline's measured compute into forward and backward."""
    samples: list[list[float]] = field(default_factory=list)
    """``t_bp`` of each timed step (one list per repeat): the run-to-run spread."""
    forward_samples: list[list[float]] = field(default_factory=list)
    """Each layer's forward seconds in each timed step (beside ``samples``, forward order)."""

    @classmethod
    def from_passes(
        cls,
        names: list[str],
        nbytes: list[int],
        forward: list[list[float]],
        samples: list[list[float]],
    ) -> LayerTimes:
        """The figures of timed passes (each pass's per-layer forward and ``t_bp`` seconds),
        robust to load: each layer's own cost over the passes (:func:`own_profile`), and
        backward's share of forward + backward from those."""
        t_bp = own_profile(samples)
        forward_s = sum(own_profile(forward))
        backward_s = sum(t_bp)
        share = backward_s / (forward_s + backward_s) if forward_s > 0 and backward_s > 0 else None
        return cls(names, t_bp, nbytes, share, samples, forward)

    def to_dict(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "t_bp": self.t_bp,
            "nbytes": self.nbytes,
            "backward_share": self.backward_share,
            "samples": self.samples,
            "forward_samples": self.forward_samples,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerTimes:
        return cls(
            list(d["names"]),
            [float(x) for x in d["t_bp"]],
            [int(x) for x in d["nbytes"]],
            d.get("backward_share"),
            [[float(x) for x in row] for row in d.get("samples", [])],
            [[float(x) for x in row] for row in d.get("forward_samples", [])],
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def own_profile(samples: list[list[float]]) -> list[float]:
    """One time per layer from several timed passes: each layer's own cost (:func:`own_cost`).

    On a loaded machine a wait to be scheduled back lands in one layer of one
    pass (a few milliseconds: the whole pass of a small model), in any share of
    the passes; it costs that layer that sample only, and the layer's lower
    quartile over the passes is its own cost again. (Shares of each pass's
    total, the earlier figure, moved every layer whenever most passes held a
    wait somewhere: on a busy machine the verdict changed from run to run.)
    Passes slowed throughout change no layer's lower quartile while a quarter
    of the passes are not.
    """
    if not samples:
        return []
    return [own_cost([row[j] for row in samples]) for j in range(len(samples[0]))]


RESAMPLES = 16
"""Resamples of the timed passes behind the range of the layer times (:func:`resampled_profiles`)."""


def resampled_profiles(samples: list[list[float]], n: int = RESAMPLES) -> list[list[float]]:
    """:func:`own_profile` of ``n`` resamples of the passes (drawn with replacement, always
    the same draws): the spread of the layer times a re-measurement would give, which the
    model's range carries. (The passes themselves spread as far as one scheduling wait: a
    range taken from them moved from run to run on a busy machine.)"""
    if len(samples) < 2:
        return [own_profile(samples)] if samples else []
    rng = random.Random(0)
    return [own_profile(rng.choices(samples, k=len(samples))) for _ in range(n)]


def own_cost(samples: list[float]) -> float:
    """The cost of a piece of work itself: the lower quartile of its timings.

    On a loaded machine a timing is either the work's own cost or that plus
    waits to be scheduled back (tens of ms each on the shared 2-core machine,
    in any share of the samples); the lower quartile keeps the first and is
    not one lucky sample. How much slower the job runs it is the
    calibration's to say.
    """
    if len(samples) < 4:
        return min(samples)
    return statistics.quantiles(samples, n=4)[0]


BACKWARD_REPEATS = 9
"""Timed steps behind ``t_bp``: per-layer medians of shares over this many steps."""


def time_layer_backward(
    model: nn.Module,
    inputs: Any,
    targets: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    repeats: int = BACKWARD_REPEATS,
    warmup: int = 2,
    threads: int | None = None,
) -> LayerTimes:
    """``t_bp`` per parameterised layer, in backward order, from the core's gradient-ready
    timing (:func:`time_groups`), one step at a time so that every step's times are kept.

    ``threads``: intra-op threads while timing (a rank's own count, so that the
    shares are those of the job's kernels); None keeps the process's.
    """
    device = next(model.parameters()).device
    layers = parameterised_layers(model)
    groups = [(layer.name, [layer.path]) for layer in layers]
    # A zero learning rate: the steps time backward without changing the model.
    optimizer = torch.optim.SGD([p for layer in layers for p in layer.params], lr=0.0)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    samples: list[list[float]] = []
    forward: list[list[float]] = []
    try:
        for i in range(repeats):
            timing = time_groups(
                model, optimizer, loss_fn, inputs, targets, groups,
                device=device, warmup=warmup if i == 0 else 0, repeats=1,
            )  # fmt: skip
            samples.append([timing.groups[j].backward_s for j in reversed(range(len(layers)))])
            forward.append([g.forward_s for g in timing.groups])
    finally:
        torch.set_num_threads(before)
        model.zero_grad(set_to_none=True)
    order = list(reversed(range(len(layers))))
    return LayerTimes.from_passes(
        [layers[i].name for i in order],
        [sum(p.numel() * p.element_size() for p in layers[i].params) for i in order],
        forward,
        samples,
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


# -- host rates ----------------------------------------------------------------------------------

HOST_SIZES = (8 * MiB, 32 * MiB, 128 * MiB)
"""Buffer sizes of the host-rate sweeps: from cache-sized to far past a large L3, so the rate
is the memory's and not one run's cache luck (a 16 MiB copy ran at 70 GB/s from L3 one run)."""
HOST_REPEATS = 9
"""Timed rounds per size, after the core's warm-up rounds."""


def copy_bandwidths(
    device: torch.device, sizes: tuple[int, ...] = HOST_SIZES, repeats: int = HOST_REPEATS
) -> tuple[Estimate, Estimate]:
    """(device->host, host->device) bytes/s with 95 % intervals; a one-thread memory copy for a CPU rank.

    Each is the bandwidth of a latency + bytes/bandwidth fit to a sweep of
    copies (:func:`tunekit.observe.timing.fit_samples`).
    """
    if device.type == "cuda":
        d2h, h2d = (
            fit_samples(copy_timings(sizes, repeats, device=device, direction=d), "cuda", d, 1)
            for d in ("d2h", "h2d")
        )
        return bandwidth_estimate(d2h), bandwidth_estimate(h2d)
    copy = bandwidth_estimate(fit_samples(copy_timings(sizes, repeats), "cpu", "memcpy", 1))
    return copy, copy


def host_add_bandwidth(
    threads: int | None = 1, sizes: tuple[int, ...] = HOST_SIZES, repeats: int = HOST_REPEATS
) -> Estimate:
    """Bytes/s of adding one host buffer into another (one contribution of a host sum).

    Measured on ``threads`` threads (one by default: a per-core rate that
    does not depend on how busy the other cores are), as a fitted sweep with
    its 95 % interval.
    """
    pairs = {n: (torch.ones(n // 4), torch.ones(n // 4)) for n in sizes}
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        times = timed_rounds(
            {n: (lambda a=a, b=b: a.add_(b)) for n, (a, b) in pairs.items()}, repeats
        )
    finally:
        torch.set_num_threads(before)
    return bandwidth_estimate(fit_samples(times, "cpu", "add", 1))


def fit_gloo_allreduce(
    group: dist.ProcessGroup,
    sizes: tuple[int, ...] = (64 * 1024, 1 * MiB, 8 * MiB),
    repeats: int = HOST_REPEATS,
) -> CollectiveFit:
    """Gloo all-reduce of host tensors over ``group``, fitted with intervals; call on every rank."""
    times = allreduce_timings(sizes, repeats, group=group, control=group)
    return fit_samples(times, "gloo", "all_reduce", group.size())


SYNC_STEPS = 9
"""Steps of the one-rank CGDP run that times the work per chunk (the first is left out)."""


def measure_sync_overhead(device: torch.device, layers: int = 32, steps: int = SYNC_STEPS) -> float:
    """``t_as`` in practice: seconds the backward thread spends launching one chunk.

    Runs CGDP on one rank over a deep model of tiny layers and divides the
    time spent in chunk launches by the number of chunks (its own cost over
    the steps after the first, :func:`own_cost`). Excludes the collective's
    own launch, which the reduction latency accounts for.
    """
    from tunekit.api import Session, Workload
    from tunekit.plugins.cgdp.runtime import CgdpSync

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
    return own_cost(per_chunk[1:])


OFFLOAD_REPEATS = 9
"""Interleaved optimizer steps behind the offload figure, after one warm-up of each."""


def time_offload_step(
    model_fn: Callable[[], nn.Module],
    optimizer_fn: Callable[[Any], torch.optim.Optimizer],
    device: torch.device,
    *,
    repeats: int = OFFLOAD_REPEATS,
    threads: int | None = None,
) -> dict[str, Any]:
    """The job's optimizer step as the job runs it and as ``offload_optimizer`` runs it.

    Two copies of the model, one stepped by the job's optimizer on the device,
    one by :class:`~tunekit.plugins.cgdp.runtime.HostOptimizer` (host masters,
    host state, then the copy of every parameter back), with the same
    gradients; the steps alternate so that load falls on both alike. Returns
    each one's own cost (:func:`own_cost`) and every sample, in seconds (JSON-able).
    """
    from tunekit.plugins.cgdp.runtime import HostOptimizer

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            plain_model, host_model = model_fn().to(device), model_fn().to(device)
        plain = optimizer_fn(plain_model.parameters())
        params = [p for p in host_model.parameters() if p.requires_grad]
        grads = [torch.randn(p.shape, dtype=p.dtype) * 1e-3 for p in params]  # host buffers
        for p, g in zip(plain_model.parameters(), grads, strict=False):
            p.grad = g.to(device)
        host = HostOptimizer(optimizer_fn(params), params, grads, pin=device.type == "cuda")
        samples: dict[str, list[float]] = {"device": [], "offload": []}
        for i in range(repeats + 1):
            for name, step in (("device", plain.step), ("offload", host.step)):
                _sync(device)
                t0 = time.perf_counter()
                step()
                _sync(device)
                if i:  # the first step of each creates the optimizer state
                    samples[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {
        "device_s": own_cost(samples["device"]),
        "offload_s": own_cost(samples["offload"]),
        "samples": samples,
    }


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
        gloo = fit_gloo_allreduce(group)
        latency, reduce_bw = gloo.latency, gloo.bandwidth
        source = "measured copies and gloo all-reduce"
    else:
        adds = host_add_bandwidth(threads=None)
        latency, reduce_bw = 0.0, host_sum_bandwidth(adds.value, world_size)
        source = "measured copies and host adds"
    return HostRates(
        d2h_bw=d2h.value,
        h2d_bw=h2d.value,
        reduce_bw=reduce_bw,
        reduce_latency=latency,
        sync_s=measure_sync_overhead(device),
        source=source,
    )
