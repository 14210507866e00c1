"""cgdp's model inputs for one job: what the calibrated and the paper's model are fed.

Per-layer backward times and gradient bytes, the host's copy, add and gloo
rates, the offload optimizer step and the peer all-reduce: measured on this
machine (cached in the study store, ``obs.cached``), or, for a hardware
profile, taken from the profile and FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil
import torch

from tunekit.api import (
    Estimate,
    Hardware,
    Observation,
    StepTruth,
    bandwidth_estimate,
    effort_repeats,
    to_device,
)
from tunekit.plugins.cgdp.calibrated import HostWork
from tunekit.plugins.cgdp.model import (
    AllReduceCost,
    HostRates,
    MiB,
    ReduceCosts,
    host_sum_bandwidth,
)

MEASURED_SOURCES = ("local", "probe")
"""Hardware sources that describe the machine tunekit runs on (times are measured here)."""
FLOP_EFFICIENCY = 0.4
"""Fraction of peak FLOP/s assumed when backward times are estimated for another machine."""
MIN_GAIN = 0.01
"""Predicted gains below this fraction of a step are within the model's noise."""
CACHE_VERSION = "v4"
"""Bumped when what is cached changes shape or meaning (v3: per-pass backward samples, offload
step; v4: per-pass forward times, backward's share from each phase's own cost)."""


def measured_keys(obs: Observation, device: torch.device) -> dict[str, str]:
    """The study-cache keys of what the diagnosis measures here: ``layers``
    (:func:`layer_times`), ``host`` (:func:`measure_host_rates`) and ``offload``
    (:func:`measure_offload`); a test or benchmark puts recorded measurements there."""
    hw = obs.hardware
    spec = f"{obs.workload_spec}:{device}:{obs.nproc}"
    return {
        "layers": f"cgdp:layers:{CACHE_VERSION}:{spec}:{hw.devices[0].model}",
        "host": f"cgdp:rates:{CACHE_VERSION}:{hw.fingerprint()}:{device}:True",
        "offload": f"cgdp:offload:{CACHE_VERSION}:{spec}",
    }


def rank_threads(nproc: int) -> int:
    """Intra-op threads of one rank, as the trial launcher gives them (cores shared out)."""
    return max(1, (psutil.cpu_count(logical=False) or 1) // max(nproc, 1))


def layer_times(obs: Observation, device: torch.device, local: bool) -> dict[str, Any]:
    """Per-layer ``t_bp`` and gradient bytes, and the optimizer's state bytes (JSON-able).

    On this machine: timed from gradient readiness over several passes with a
    rank's threads (the whole model's backward, so time in layers without
    parameters falls between the readiness points where it belongs); for a
    hardware profile: estimated from FLOPs. Where the model is calibrated on a
    measured baseline only the layers' shares of backward matter.
    """
    from tunekit.plugins.cgdp.measure import (
        BACKWARD_REPEATS,
        estimate_backward_times,
        time_layer_backward,
    )

    work, target = obs.workload, obs.hardware.devices[0]
    model = work.model().to(device)
    inputs, targets = work.example_batch(work.batch_size)
    inputs, targets = (
        to_device(inputs, device),
        to_device(targets, device),
    )  # inputs may be a dict (HF)
    if local:
        times = time_layer_backward(
            model, inputs, targets, work.loss, threads=rank_threads(obs.nproc),
            repeats=effort_repeats(BACKWARD_REPEATS, 4),
        )  # fmt: skip
        source = (
            f"measured from gradient readiness ({len(times.samples)} passes, each layer's own cost)"
        )
    else:
        times = estimate_backward_times(
            model, inputs, targets, work.loss, target.peak_flops, FLOP_EFFICIENCY
        )
        source = f"FLOPs at {FLOP_EFFICIENCY:.0%} of {target.model}'s peak"
    opt = work.optimizer(model.parameters(), work.lr)
    work.loss(model(inputs), targets).backward()
    opt.step()
    state = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {**times.to_dict(), "state_bytes": state, "source": source}


def measure_host_rates(device: torch.device, local: bool) -> dict[str, Any]:
    """What this machine measures for the host path, with intervals (JSON-able, cached).

    Host adds and the sync cost always; the host link only when the hardware
    is this machine (a profile's host link is read from the profile).
    """
    from tunekit.plugins.cgdp.measure import (
        HOST_REPEATS,
        SYNC_STEPS,
        copy_bandwidths,
        host_add_bandwidth,
        measure_sync_overhead,
    )

    repeats = effort_repeats(HOST_REPEATS, 3)
    out: dict[str, Any] = {
        "add_per_core": host_add_bandwidth(threads=1, repeats=repeats).to_dict(),
        "sync": measure_sync_overhead(device, steps=effort_repeats(SYNC_STEPS, 5)),
    }
    if local:
        d2h, h2d = copy_bandwidths(device, repeats=repeats)
        out.update(d2h=d2h.to_dict(), h2d=h2d.to_dict())
    return out


def measure_offload(obs: Observation, device: torch.device) -> dict[str, Any]:
    """The job's optimizer step on the device and under offload, timed here (JSON-able)."""
    from tunekit.plugins.cgdp.measure import OFFLOAD_REPEATS, time_offload_step

    work = obs.workload
    return time_offload_step(
        work.model, lambda params: work.optimizer(params, work.lr), device,
        repeats=effort_repeats(OFFLOAD_REPEATS, 4), threads=rank_threads(obs.nproc),
    )  # fmt: skip


def profile_host_link(hw: Hardware) -> dict[str, Any]:
    """A profile's host link: its D2H fit (with the fit's interval) or its host links."""
    fit = hw.fit("d2h", 1)
    if fit is not None:
        link = bandwidth_estimate(fit)
    else:
        link = Estimate.exact(hw.host_bandwidth(hw.devices[0].name))
    return {"d2h": link.to_dict(), "h2d": link.to_dict()}


def _rate(measured: dict[str, float], end: str | None) -> float:
    """A measured bandwidth at ``end``: the median (None), its interval's ``"slow"`` or ``"fast"`` end."""
    est = Estimate.from_dict(measured)
    return {None: est.value, "slow": est.low, "fast": est.high}[end]


def host_rates(
    obs: Observation, measured: dict[str, Any], hw: Hardware, host_end: str | None = None
) -> HostRates:
    """Copy, reduction and synchronisation rates of the host path on ``hw``.

    ``host_end`` picks the end of the host rates' intervals; the reduction's
    fit comes from ``hw`` (pass ``hw.at_end(...)`` for the ends of its interval).
    """
    nproc = obs.nproc
    # The reduction across ranks: a measured gloo fit when the hardware has one; CPU ranks on
    # this machine reduce through gloo on loopback whichever sync is used; otherwise the
    # paper's host-side sum of G contributions.
    gloo = hw.fit("all_reduce", nproc, "gloo")
    if gloo is not None:
        latency, reduce_bw, source = gloo.latency, gloo.bandwidth, "gloo all-reduce fit"
    elif obs.device_type == "cpu" and hw.source in MEASURED_SOURCES:
        big = 64 * MiB
        latency = hw.allreduce_time(0, nproc, "gloo")
        reduce_bw = big / max(hw.allreduce_time(big, nproc, "gloo") - latency, 1e-12)
        source = "loopback model"
    else:
        # The paper sums on all host cores (OpenMP). Profiles carry no host memory
        # bandwidth: this machine's per-core add rate times the host's cores (optimistic).
        latency = 0.0
        add = _rate(measured["add_per_core"], host_end)
        reduce_bw = host_sum_bandwidth(add * hw.host.cores, nproc)
        source = f"host adds on {hw.host.cores} cores at this machine's per-core rate"
    return HostRates(
        _rate(measured["d2h"], host_end),
        _rate(measured["h2d"], host_end),
        reduce_bw,
        latency,
        measured["sync"],
        source=source,
    )


def peer(hw: Hardware, nproc: int, backend: str) -> Callable[[float], float]:
    """Seconds of one all-reduce of ``n`` bytes over the devices' peer links (the DDP baseline)."""
    return lambda nbytes: hw.allreduce_time(nbytes, nproc, backend)


def peer_cost(hw: Hardware, nproc: int, backend: str) -> AllReduceCost:
    """The peer all-reduce as ``latency + bytes / bandwidth`` (from the fit or the links)."""
    big = 64 * MiB
    latency = hw.allreduce_time(0, nproc, backend)
    return AllReduceCost(
        latency, big / max(hw.allreduce_time(big, nproc, backend) - latency, 1e-12)
    )


def peer_bus(hw: Hardware, nproc: int, backend: str) -> float:
    """Bus bandwidth of a large peer all-reduce: bytes each rank sends and receives per second."""
    big = 256 * MiB
    return 2 * (nproc - 1) / nproc * big / hw.allreduce_time(big, nproc, backend)


def model_truth(times, hw: Hardware, nproc: int, backend: str, work: HostWork) -> StepTruth:
    """A stand-in for the baseline when none was measured: the model's own DDP step."""
    from tunekit.plugins.cgdp.model import ddp_timeline

    backward = sum(times.t_bp)
    share = times.backward_share or 2 / 3
    ddp = ddp_timeline(times.t_bp, times.nbytes, ReduceCosts.uniform(peer_cost(hw, nproc, backend)))
    step = backward / share + ddp.exposed_s + (work.optimizer_s or 0.0)
    return StepTruth(step_s=step, source="model: no measured baseline")


def gpu_host_path(obs: Observation, host: dict[str, Any], hw: Hardware) -> ReduceCosts:
    """A GPU's host path: copy to the host and the host all-reduce, one pipeline (not DDP's NCCL)."""
    rates = host_rates(obs, host, hw)
    per_byte = 1.0 / rates.d2h_bw + 1.0 / rates.reduce_bw
    return ReduceCosts.uniform(AllReduceCost(rates.reduce_latency, 1.0 / per_byte))
