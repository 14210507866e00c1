"""An inventory of this machine as a :class:`Hardware`, without measuring anything.

The probe (``tunekit hardware probe``) adds measured collective fits; until
then links carry no fit and plans fall back to the inventory alone.
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


def describe_local_machine(nproc: int, device_type: str, fits: tuple[CollectiveFit, ...] = ()) -> Hardware:
    """This machine with ``nproc`` ranks on ``device_type`` ("cpu" or "cuda")."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    host = Host(cores=cores, memory_bytes=float(psutil.virtual_memory().total), sockets=("cpu0",))
    devices: list[Device] = []
    links: list[Link] = []
    if device_type == "cuda" and torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(min(nproc, n)):
            prop = torch.cuda.get_device_properties(i)
            devices.append(Device(f"gpu{i}", "gpu", prop.name, float(prop.total_memory), _gpu_peak(prop)))
            links.append(Link(f"gpu{i}", "cpu0", 12 * GB, 5e-6, "pcie"))
    else:
        per_rank_mem = host.memory_bytes / max(nproc, 1)
        cpu = platform.processor() or platform.machine()
        threads = max(1, cores // max(nproc, 1))
        for i in range(nproc):
            devices.append(Device(f"rank{i}", "cpu", f"{cpu} ({threads} cores)", per_rank_mem, threads * 50e9))
            links.append(Link(f"rank{i}", "cpu0", _LOOPBACK_BW, _LOOPBACK_LAT, "loopback"))
    return Hardware(
        name=f"local-{platform.node() or 'host'}",
        devices=tuple(devices),
        links=tuple(links),
        host=host,
        collectives=tuple(fits),
        description=f"this machine, {nproc} {device_type} rank(s)",
        source="local",
    )


def _gpu_peak(prop) -> float:
    # FP32 lanes per SM by major architecture; a coarse but honest estimate.
    lanes = {6: 64, 7: 64, 8: 128, 9: 128, 10: 128}.get(prop.major, 64)
    clock_hz = getattr(prop, "clock_rate", 1_500_000) * 1e3  # kHz -> Hz where torch reports it
    return 2.0 * lanes * prop.multi_processor_count * clock_hz
