"""An inventory of this machine as a :class:`Hardware`, without measuring anything.

The probe (``tunekit hardware probe``, :mod:`tunekit.observe.probe`) adds
measured fits. Given a point-to-point fit, the links take its measured
bandwidth and latency; without one they carry placeholder loopback numbers
that only order plans.
"""

from __future__ import annotations

import os
import platform

import psutil
import torch

from tunekit.hardware import GB, CollectiveFit, Device, Hardware, Host, Link

# Loopback between CPU ranks goes through shared memory and the kernel's TCP
# stack; these placeholders only order plans until a probe measures the truth.
_LOOPBACK_BW = 2.0 * GB
_LOOPBACK_LAT = 50e-6


def describe_local_machine(
    nproc: int, device_type: str, fits: tuple[CollectiveFit, ...] = ()
) -> Hardware:
    """This machine with ``nproc`` ranks on ``device_type`` ("cpu" or "cuda")."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    host = Host(cores=cores, memory_bytes=float(psutil.virtual_memory().total), sockets=("cpu0",))
    devices: list[Device] = []
    links: list[Link] = []
    p2p = next((f for f in fits if f.op == "p2p"), None)
    if device_type == "cuda" and torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(min(nproc, n)):
            prop = torch.cuda.get_device_properties(i)
            devices.append(
                Device(f"gpu{i}", "gpu", prop.name, float(prop.total_memory), _gpu_peak(prop))
            )
            h2d = next((f for f in fits if f.op == "h2d"), None)
            bw, lat = (h2d.bandwidth, h2d.latency) if h2d else (12 * GB, 5e-6)
            links.append(Link(f"gpu{i}", "cpu0", bw, lat, "pcie"))
    else:
        per_rank_mem = host.memory_bytes / max(nproc, 1)
        cpu = platform.processor() or platform.machine()
        threads = max(1, cores // max(nproc, 1))
        for i in range(nproc):
            devices.append(
                Device(f"rank{i}", "cpu", f"{cpu} ({threads} cores)", per_rank_mem, threads * 50e9)
            )
            # A rank-to-rank message crosses two of these links: each takes half the
            # measured one-way latency and the measured bandwidth.
            bw, lat = (p2p.bandwidth, p2p.latency / 2) if p2p else (_LOOPBACK_BW, _LOOPBACK_LAT)
            links.append(Link(f"rank{i}", "cpu0", bw, lat, "loopback"))
    return Hardware(
        name=f"local-{platform.node() or 'host'}",
        devices=tuple(devices),
        links=tuple(links),
        host=host,
        collectives=tuple(fits),
        description=f"this machine, {nproc} {device_type} rank(s)",
        source="probe" if fits else "local",
    )


def _gpu_peak(prop) -> float:
    # FP32 lanes per SM by major architecture; a coarse but honest estimate.
    lanes = {6: 64, 7: 64, 8: 128, 9: 128, 10: 128}.get(prop.major, 64)
    clock_hz = getattr(prop, "clock_rate", 1_500_000) * 1e3  # kHz -> Hz where torch reports it
    return 2.0 * lanes * prop.multi_processor_count * clock_hz
