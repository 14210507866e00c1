"""Measure this machine: collective and point-to-point sweeps fitted to latency + bytes/bandwidth.

:func:`probe_hardware` starts ``nproc`` real ranks (``tunekit.testing.run_ranks``:
gloo on loopback; on a GPU machine the ranks add an NCCL group and time on
their GPUs) and measures, for message sizes from 4 KiB to 16 MiB, with the
robust primitives of :mod:`tunekit.observe.timing` (warm-up rounds, repeats
interleaved across sizes, medians with 95 % bootstrap intervals):

* ``all_reduce`` over all ranks: per repeat the slowest rank's time (a
  collective ends when its last rank does);
* ``p2p`` between ranks 0 and 1: half a ping-pong round trip, timed on rank 0;
* on a GPU, ``h2d`` / ``d2h`` copies between pinned host memory and rank 0's GPU.

Collectives use NCCL when every rank has its own GPU, gloo otherwise.

Each sweep is fitted to ``t(bytes) = latency + bytes / bandwidth`` on its
per-size medians by least squares on relative error (each point weighted by
``1/t``; non-negative coefficients via ``scipy.optimize.nnls``), and carries
95 % intervals of its latency and bandwidth from refitting bootstrap
resamples (:func:`~tunekit.observe.timing.fit_samples`). The fit's
``residual`` is the RMS relative error of the fit over the medians. The
result is a :class:`~tunekit.hardware.Hardware` from
:func:`~tunekit.observe.local.describe_local_machine` carrying the fits, with
its links' bandwidth and latency taken from the point-to-point fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tunekit.hardware import GB, CollectiveFit, Hardware
from tunekit.observe.local import describe_local_machine
from tunekit.observe.timing import (
    allreduce_timings,
    copy_timings,
    fit_latency_bandwidth,
    fit_samples,
    ping_pong,
)
from tunekit.testing import run_ranks

__all__ = [
    "DEFAULT_SIZES",
    "ProbeResult",
    "Sweep",
    "fit_latency_bandwidth",
    "hardware_to_toml",
    "probe_hardware",
    "probe_result",
    "sweep_rank",
]

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB
"""Message sizes in bytes of the default sweep."""
DEFAULT_REPEATS = 9
"""Timed repeats per size: enough for a bootstrap interval of the median to mean something."""


@dataclass
class Sweep:
    """Timings of one operation per message size, their medians and the fit."""

    op: str
    backend: str
    world_size: int
    samples: dict[int, list[float]]
    fit: CollectiveFit

    @property
    def points(self) -> list[tuple[int, float]]:
        """``(bytes, median seconds)`` per size, smallest first."""
        return [(n, float(np.median(self.samples[n]))) for n in sorted(self.samples)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "backend": self.backend,
            "world_size": self.world_size,
            "points": [list(p) for p in self.points],
            "samples": {str(n): ts for n, ts in sorted(self.samples.items())},
            "latency_s": self.fit.latency,
            "bandwidth_bytes_s": self.fit.bandwidth,
            "latency_interval_s": _as_list(self.fit.latency_interval),
            "bandwidth_interval_bytes_s": _as_list(self.fit.bandwidth_interval),
            "residual": self.fit.residual,
        }


def _as_list(pair: tuple[float, float] | None) -> list[float] | None:
    return None if pair is None else list(pair)


@dataclass
class ProbeResult:
    hardware: Hardware
    sweeps: list[Sweep] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware.to_dict(),
            "sweeps": [s.to_dict() for s in self.sweeps],
            "wall_s": self.wall_s,
        }


# -- what each rank runs ---------------------------------------------------------------------


def sweep_rank(rank: int, world: int, sizes: list[int], repeats: int, use_cuda: bool) -> dict:
    """Time all-reduce (and p2p, copies) at each size on this rank, in the default process
    group: run by :func:`probe_hardware`'s ranks, or by a study's baseline trial after its
    measured steps (its ranks are up already; see ``TrialSpec.probe``)."""
    group = None
    device = torch.device("cpu")
    backend = "gloo"
    gpus = torch.cuda.device_count() if use_cuda and torch.cuda.is_available() else 0
    if gpus >= world:  # NCCL needs one GPU per rank; with fewer, collectives stay on gloo
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = dist.new_group(backend="nccl")
        backend = "nccl"
    out: dict[str, Any] = {
        "backend": backend,
        "all_reduce": allreduce_timings(sizes, repeats, device=device, group=group),
    }
    if world >= 2:
        out["p2p"] = ping_pong(rank, sizes, repeats, device=device, group=group)
    if gpus and rank == 0:
        for direction in ("h2d", "d2h"):
            out[direction] = copy_timings(sizes, repeats, device="cuda:0", direction=direction)
    return out


# -- the probe --------------------------------------------------------------------------------


def probe_hardware(
    nproc: int = 2,
    *,
    sizes: tuple[int, ...] | list[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    device_type: str | None = None,
    timeout_s: float = 300,
) -> ProbeResult:
    """Measure collectives on ``nproc`` ranks of this machine; see the module docstring."""
    if nproc < 2:
        raise ValueError("a probe needs at least 2 ranks")
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    use_cuda = device_type == "cuda"
    start = time.perf_counter()
    results = run_ranks(sweep_rank, nproc, (list(sizes), repeats, use_cuda), timeout_s=timeout_s)
    return probe_result(results[0], nproc, device_type, time.perf_counter() - start)


def probe_result(first: dict[str, Any], nproc: int, device_type: str, wall_s: float) -> ProbeResult:
    """Rank 0's :func:`sweep_rank` timings (all-reduce and ping-pong samples are the same on
    every rank) fitted, as this machine's :class:`Hardware`. Sizes may come as JSON's strings."""
    first = {
        k: {int(n): t for n, t in v.items()} if isinstance(v, dict) else v for k, v in first.items()
    }
    backend = first["backend"]
    measured = [
        ("all_reduce", backend, nproc),
        ("p2p", backend, 2),
        ("h2d", "cuda", 1),
        ("d2h", "cuda", 1),
    ]
    sweeps = [
        Sweep(op, b, world, first[op], fit_samples(first[op], b, op, world))
        for op, b, world in measured
        if first.get(op)
    ]
    hw = describe_local_machine(nproc, device_type, tuple(s.fit for s in sweeps))
    return ProbeResult(hw, sweeps, wall_s)


# -- TOML ------------------------------------------------------------------------------------


def hardware_to_toml(hw: Hardware) -> str:
    """A profile ``tunekit.hardware.load_profile`` reads back into an equal :class:`Hardware`."""

    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def num(v: float) -> str:
        return repr(float(v)) if not float(v).is_integer() else str(int(v))

    lines = [f"name = {q(hw.name)}"]
    if hw.description:
        lines.append(f"description = {q(hw.description)}")
    lines += [
        "",
        "[host]",
        f"cores = {hw.host.cores}",
        f"memory_gb = {num(hw.host.memory_bytes / GB)}",
        "sockets = [" + ", ".join(q(s) for s in hw.host.sockets) + "]",
    ]
    for d in hw.devices:
        lines += [
            "",
            "[[devices]]",
            f"name = {q(d.name)}",
            f"kind = {q(d.kind)}",
            f"model = {q(d.model)}",
            f"memory_gb = {num(d.memory_bytes / GB)}",
            f"peak_tflops = {num(d.peak_flops / 1e12)}",
        ]
    for s in hw.switches:
        lines += ["", "[[switches]]", f"name = {q(s)}"]
    for lk in hw.links:
        lines += [
            "",
            "[[links]]",
            f"between = [{q(lk.a)}, {q(lk.b)}]",
            f"bandwidth_gb_s = {num(lk.bandwidth / GB)}",
            f"latency_us = {num(lk.latency * 1e6)}",
        ]
        if lk.kind:
            lines.append(f"kind = {q(lk.kind)}")
    for c in hw.collectives:
        lines += [
            "",
            "[[collectives]]",
            f"backend = {q(c.backend)}",
            f"op = {q(c.op)}",
            f"world_size = {c.world_size}",
            f"latency_us = {num(c.latency * 1e6)}",
            f"bandwidth_gb_s = {num(c.bandwidth / GB)}",
            f"residual = {num(c.residual)}",
        ]
        if c.latency_interval is not None:
            low, high = c.latency_interval
            lines.append(f"latency_us_interval = [{num(low * 1e6)}, {num(high * 1e6)}]")
        if c.bandwidth_interval is not None:
            low, high = c.bandwidth_interval
            lines.append(f"bandwidth_gb_s_interval = [{num(low / GB)}, {num(high / GB)}]")
    return "\n".join(lines) + "\n"
