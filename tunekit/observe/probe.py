"""Measure this machine: collective and point-to-point sweeps fitted to latency + bytes/bandwidth.

:func:`probe_hardware` starts ``nproc`` real ranks (``tunekit.testing.run_ranks``:
gloo on loopback; on a GPU machine the ranks add an NCCL group and time on
their GPUs) and measures, for message sizes from 4 KiB to 16 MiB:

* ``all_reduce`` over all ranks: per size, the median over repeats of the
  slowest rank's time (a collective ends when its last rank does);
* ``p2p`` between ranks 0 and 1: half the median ping-pong round trip;
* on a GPU, ``h2d`` / ``d2h`` copies between pinned host memory and rank 0's GPU.

Collectives use NCCL when every rank has its own GPU, gloo otherwise.

Each sweep is fitted to ``t(bytes) = latency + bytes / bandwidth`` by least
squares on relative error (each point weighted by ``1/t``, so small and large
messages count alike; non-negative coefficients via ``scipy.optimize.nnls``).
The fit's ``residual`` is the RMS relative error of the fit over the sweep.
The result is a :class:`~tunekit.hardware.Hardware` from
:func:`~tunekit.observe.local.describe_local_machine` carrying the fits, with
its links' bandwidth and latency taken from the point-to-point fit.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tunekit.hardware import GB, CollectiveFit, Hardware
from tunekit.observe.local import describe_local_machine
from tunekit.testing import run_ranks

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(7))  # 4 KiB .. 16 MiB
"""Message sizes in bytes of the default sweep."""


@dataclass
class Sweep:
    """Measured (bytes, seconds) points of one operation and their fit."""

    op: str
    backend: str
    world_size: int
    points: list[tuple[int, float]]
    fit: CollectiveFit

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "backend": self.backend,
            "world_size": self.world_size,
            "points": [list(p) for p in self.points],
            "latency_s": self.fit.latency,
            "bandwidth_bytes_s": self.fit.bandwidth,
            "residual": self.fit.residual,
        }


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


def fit_latency_bandwidth(
    points: list[tuple[float, float]], backend: str, op: str, world_size: int
) -> CollectiveFit:
    """Least-squares fit of ``t = latency + bytes / bandwidth`` on relative error."""
    if len(points) < 2:
        raise ValueError("a fit needs at least two message sizes")
    x = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    if np.any(t <= 0):
        raise ValueError("measured times must be positive")
    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    from scipy.optimize import nnls  # here: scipy costs every command a third of a second

    (lat, inv_bw), _ = nnls(a, np.ones_like(t))
    pred = lat + inv_bw * x
    residual = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    # A sweep too noisy to show any slope still needs a finite bandwidth: take
    # the largest message's effective rate.
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float(x[-1] / t[-1])
    return CollectiveFit(backend, op, world_size, float(lat), float(bandwidth), residual)


# -- what each rank runs ---------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sweep_rank(rank: int, world: int, sizes: list[int], repeats: int, use_cuda: bool) -> dict:
    """Time all-reduce (and p2p, copies) at each size on this rank (run by run_ranks)."""
    group = None
    device = torch.device("cpu")
    backend = "gloo"
    gpus = torch.cuda.device_count() if use_cuda and torch.cuda.is_available() else 0
    if gpus >= world:  # NCCL needs one GPU per rank; with fewer, collectives stay on gloo
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = dist.new_group(backend="nccl")
        backend = "nccl"
    out: dict[str, Any] = {"backend": backend, "all_reduce": [], "p2p": [], "h2d": [], "d2h": []}
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)
            if i >= 2:  # two warm-up rounds per size
                times.append(time.perf_counter() - t0)
        out["all_reduce"].append((nbytes, times))
        if world >= 2:
            out["p2p"].append((nbytes, _ping_pong(rank, buf, repeats, device, group)))
        if gpus and rank == 0:
            dev_buf = buf if buf.is_cuda else buf.to("cuda:0")
            out["h2d"].append((nbytes, _copy_times(dev_buf, "h2d", repeats)))
            out["d2h"].append((nbytes, _copy_times(dev_buf, "d2h", repeats)))
    return out


def _ping_pong(rank: int, buf: torch.Tensor, repeats: int, device, group) -> list[float]:
    """One-way times between ranks 0 and 1 (half a round trip); other ranks wait."""
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1, group=group)
            dist.recv(buf, 1, group=group)
        elif rank == 1:
            dist.recv(buf, 0, group=group)
            dist.send(buf, 0, group=group)
        _sync(device)
        if i >= 2 and rank in (0, 1):
            times.append((time.perf_counter() - t0) / 2)
    return times


def _copy_times(dev_buf: torch.Tensor, direction: str, repeats: int) -> list[float]:
    host = torch.empty(dev_buf.shape, dtype=dev_buf.dtype, pin_memory=True)
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if direction == "h2d":
            dev_buf.copy_(host, non_blocking=True)
        else:
            host.copy_(dev_buf, non_blocking=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


# -- the probe --------------------------------------------------------------------------------


def _combine(
    per_rank: list[list[tuple[int, list[float]]]], slowest: bool
) -> list[tuple[int, float]]:
    """Per size: the median over repeats of the slowest rank (or of the ranks that timed it)."""
    points = []
    for entries in zip(*per_rank, strict=True):
        nbytes = entries[0][0]
        timed = [times for _, times in entries if times]
        by_repeat = list(zip(*timed, strict=True))
        step = [max(r) if slowest else statistics.fmean(r) for r in by_repeat]
        points.append((nbytes, statistics.median(step)))
    return points


def probe_hardware(
    nproc: int = 2,
    *,
    sizes: tuple[int, ...] | list[int] = DEFAULT_SIZES,
    repeats: int = 5,
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
    results = run_ranks(_sweep_rank, nproc, (list(sizes), repeats, use_cuda), timeout_s=timeout_s)
    backend = results[0]["backend"]
    sweeps = []
    ar = _combine([r["all_reduce"] for r in results], slowest=True)
    sweeps.append(
        Sweep(
            "all_reduce",
            backend,
            nproc,
            ar,
            fit_latency_bandwidth(ar, backend, "all_reduce", nproc),
        )
    )
    p2p = _combine([r["p2p"] for r in results[:2]], slowest=True)
    sweeps.append(Sweep("p2p", backend, 2, p2p, fit_latency_bandwidth(p2p, backend, "p2p", 2)))
    for op in ("h2d", "d2h"):
        if results[0][op]:
            pts = [(n, statistics.median(ts)) for n, ts in results[0][op]]
            sweeps.append(Sweep(op, "cuda", 1, pts, fit_latency_bandwidth(pts, "cuda", op, 1)))
    hw = describe_local_machine(nproc, device_type, tuple(s.fit for s in sweeps))
    return ProbeResult(hw, sweeps, time.perf_counter() - start)


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
    return "\n".join(lines) + "\n"
