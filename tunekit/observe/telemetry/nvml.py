"""GPU telemetry through NVML (``pynvml`` from the nvidia-ml-py package).

Per sample and GPU: utilisation (SM and memory), memory used/total, power,
SM and memory clocks, PCIe TX/RX throughput, NVLink TX/RX throughput where
the GPU reports it, and the memory each rank's process holds (NVML's running
processes mapped to ranks by pid). Once, at start: names, the topology and
peer-to-peer matrix (``nvidia-smi topo -m`` style).

Without an NVIDIA driver (or without ``pynvml``) the source is unavailable,
says so once in :attr:`NvmlSource.notice` and samples nothing. A metric a GPU
does not support is left out of its samples and listed once in
``static["unsupported"]``; no NVML error ever escapes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

# NVML's topology levels, named as nvidia-smi topo -m names them.
_TOPOLOGY = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_ALL_LINKS = 0xFFFFFFFF  # scopeId asking NVML for the sum over all NVLinks


def _index(value) -> int:
    # Some nvidia-ml-py releases define NVML_P2P_CAPS_INDEX_READ as a 1-tuple.
    return int(value[0]) if isinstance(value, tuple) else int(value)


class NvmlSource:
    """Samples every visible NVIDIA GPU; unavailable (with a notice) without one."""

    name = "nvml"

    def __init__(self) -> None:
        self.available = False
        self.notice = ""
        self.static: dict[str, Any] = {}
        # The pynvml module once initialised (read as Any: its API is untyped), else None.
        self._nv: Any = None
        self._handles: list[Any] = []
        self._unsupported: set[str] = set()
        try:
            nv = importlib.import_module("pynvml")
        except ImportError as exc:
            self.notice = f"NVML unavailable (pynvml not importable: {exc}); host metrics only"
            return
        try:
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.notice = f"no NVIDIA GPU or driver ({exc}); host metrics only"
            return
        if count == 0:
            self.notice = "NVML found no GPU; host metrics only"
            self._shutdown(nv)
            return
        self._nv = nv
        self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.available = True
        self.static = self._static_info()

    # -- helpers -------------------------------------------------------------------------

    def _try(self, metric: str, fn: Callable[..., Any]) -> Any:
        """``fn()``, or None (remembering ``metric`` as unsupported) on any NVML error."""
        # Callable[..., Any]: the callers' lambdas bind loop variables as defaults
        # (``lambda h=h: ...``), which mypy cannot infer against Callable[[], Any].
        if metric in self._unsupported:
            return None
        try:
            return fn()
        except Exception:
            self._unsupported.add(metric)
            return None

    @staticmethod
    def _shutdown(nv) -> None:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass

    # -- once ----------------------------------------------------------------------------

    def _static_info(self) -> dict[str, Any]:
        nv = self._nv
        devices = []
        bus_ids = []
        for i, h in enumerate(self._handles):
            name = self._try("name", lambda h=h: nv.nvmlDeviceGetName(h))
            if isinstance(name, bytes):
                name = name.decode()
            mem = self._try("memory", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
            pci = self._try("pci_info", lambda h=h: nv.nvmlDeviceGetPciInfo(h))
            bus = getattr(pci, "busId", b"") if pci is not None else b""
            bus_ids.append(bus.decode() if isinstance(bus, bytes) else str(bus))
            devices.append(
                {
                    "index": i,
                    "name": name,
                    "memory_total_bytes": int(mem.total) if mem is not None else None,
                    "pcie_gen": self._try(
                        "pcie_gen", lambda h=h: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)
                    ),
                    "pcie_width": self._try(
                        "pcie_width", lambda h=h: nv.nvmlDeviceGetCurrPcieLinkWidth(h)
                    ),
                }
            )
        driver = self._try("driver", nv.nvmlSystemGetDriverVersion)
        if isinstance(driver, bytes):
            driver = driver.decode()
        return {
            "driver": driver,
            "devices": devices,
            "topology": self._topology(bus_ids),
            "p2p": self._p2p_matrix(),
        }

    def _nvlinks(self, h, bus_ids: list[str]) -> dict[int, int]:
        """Active NVLinks from GPU ``h`` to each other GPU index."""
        nv = self._nv
        counts: dict[int, int] = {}
        max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))
        for link in range(max_links):
            state = self._try(
                "nvlink_state", lambda link=link: nv.nvmlDeviceGetNvLinkState(h, link)
            )
            if state is None:
                break  # not supported, or past the last link
            if state != getattr(nv, "NVML_FEATURE_ENABLED", 1):
                continue
            remote = self._try(
                "nvlink_remote", lambda link=link: nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
            )
            bus = getattr(remote, "busId", b"") if remote is not None else b""
            bus = bus.decode() if isinstance(bus, bytes) else str(bus)
            if bus in bus_ids:
                j = bus_ids.index(bus)
                counts[j] = counts.get(j, 0) + 1
        self._unsupported.discard("nvlink_state")  # running past the last link is normal
        return counts

    def _topology(self, bus_ids: list[str]) -> list[list[str]]:
        """``topology[i][j]``: ``X``, ``NV<n>`` (n NVLinks), ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``."""
        nv = self._nv
        n = len(self._handles)
        links = [self._nvlinks(h, bus_ids) for h in self._handles]
        matrix = []
        for i, hi in enumerate(self._handles):
            row = []
            for j, hj in enumerate(self._handles):
                if i == j:
                    row.append("X")
                elif links[i].get(j):
                    row.append(f"NV{links[i][j]}")
                else:
                    level = self._try(
                        "topology",
                        lambda hi=hi, hj=hj: nv.nvmlDeviceGetTopologyCommonAncestor(hi, hj),
                    )
                    row.append(_TOPOLOGY.get(int(level), str(level)) if level is not None else "?")
            matrix.append(row)
        return matrix if n else []

    def _p2p_matrix(self) -> list[list[str]]:
        """``p2p[i][j]``: ``OK`` when GPU i can read GPU j's memory directly, else ``NS``."""
        nv = self._nv
        read = _index(getattr(nv, "NVML_P2P_CAPS_INDEX_READ", 0))
        ok = getattr(nv, "NVML_P2P_STATUS_OK", 0)
        out = []
        for i, hi in enumerate(self._handles):
            row = []
            for j, hj in enumerate(self._handles):
                if i == j:
                    row.append("X")
                    continue
                st = self._try("p2p", lambda hi=hi, hj=hj: nv.nvmlDeviceGetP2PStatus(hi, hj, read))
                row.append("?" if st is None else ("OK" if st == ok else "NS"))
            out.append(row)
        return out

    # -- per sample ---------------------------------------------------------------------

    def sample(self, pids: Mapping[int, int]) -> dict[str, Any] | None:
        """One reading of every GPU; ``pids`` maps rank -> pid for per-process memory."""
        if not self.available:
            return None
        nv = self._nv
        rank_of = {pid: rank for rank, pid in pids.items()}
        gpus = []
        ranks: dict[str, dict[str, Any]] = {}
        for i, h in enumerate(self._handles):
            g: dict[str, Any] = {"index": i}
            util = self._try("utilization", lambda h=h: nv.nvmlDeviceGetUtilizationRates(h))
            if util is not None:
                g["util_gpu_pct"] = float(util.gpu)
                g["util_mem_pct"] = float(util.memory)
            mem = self._try("memory", lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
            if mem is not None:
                g["mem_used_bytes"] = int(mem.used)
                g["mem_total_bytes"] = int(mem.total)
            power = self._try("power", lambda h=h: nv.nvmlDeviceGetPowerUsage(h))
            if power is not None:
                g["power_w"] = power / 1000.0  # NVML reports milliwatts
            for key, clock in (
                ("sm_clock_mhz", "NVML_CLOCK_SM"),
                ("mem_clock_mhz", "NVML_CLOCK_MEM"),
            ):
                v = self._try(
                    key, lambda h=h, c=clock: nv.nvmlDeviceGetClockInfo(h, getattr(nv, c))
                )
                if v is not None:
                    g[key] = int(v)
            for key, counter in (
                ("pcie_tx_bytes_s", "NVML_PCIE_UTIL_TX_BYTES"),
                ("pcie_rx_bytes_s", "NVML_PCIE_UTIL_RX_BYTES"),
            ):
                v = self._try(
                    key, lambda h=h, c=counter: nv.nvmlDeviceGetPcieThroughput(h, getattr(nv, c))
                )
                if v is not None:
                    g[key] = int(v) * 1024  # NVML reports KB/s
            g.update(self._nvlink_throughput(h))
            procs = self._try("processes", lambda h=h: nv.nvmlDeviceGetComputeRunningProcesses(h))
            for p in procs or []:
                used = getattr(p, "usedGpuMemory", None)
                if p.pid in rank_of and used is not None:
                    entry = ranks.setdefault(str(rank_of[p.pid]), {"pid": p.pid, "gpus": {}})
                    entry["gpus"][str(i)] = int(used)
            gpus.append(g)
        return {"gpus": gpus, "ranks": ranks}

    def _nvlink_throughput(self, h) -> dict[str, int]:
        nv = self._nv
        ids = ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX")
        if not all(hasattr(nv, i) for i in ids):
            return {}
        fields = [(getattr(nv, i), _ALL_LINKS) for i in ids]
        values = self._try("nvlink_throughput", lambda: nv.nvmlDeviceGetFieldValues(h, fields))
        if values is None:
            return {}
        out = {}
        for key, v in zip(("nvlink_tx_bytes", "nvlink_rx_bytes"), values, strict=False):
            if getattr(v, "nvmlReturn", 0) == 0:
                out[key] = int(v.value.ullVal) * 1024  # cumulative KiB counters
        return out

    def unsupported(self) -> list[str]:
        return sorted(self._unsupported)

    def close(self) -> None:
        if self._nv is not None:
            self._shutdown(self._nv)
            self._nv = None
        self.available = False


def summarize_nvml(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per GPU mean/max utilisation, peak memory, mean power; per rank peak GPU memory."""
    per_gpu: dict[int, dict[str, list[float]]] = {}
    per_rank: dict[str, int] = {}
    for s in samples:
        for g in s["data"].get("gpus", []):
            acc = per_gpu.setdefault(g["index"], {})
            for k, v in g.items():
                if k != "index" and isinstance(v, int | float):
                    acc.setdefault(k, []).append(float(v))
        for rank, r in s["data"].get("ranks", {}).items():
            per_rank[rank] = max(per_rank.get(rank, 0), sum(r["gpus"].values()))
    gpus = {}
    for idx, acc in sorted(per_gpu.items()):
        out: dict[str, float] = {}
        for k, vs in acc.items():
            if k.startswith(("util", "power", "sm_clock", "mem_clock", "pcie")):
                out[f"{k}_mean"] = sum(vs) / len(vs)
            out[f"{k}_max"] = max(vs)
        # NVLink counters are cumulative: report the rate over the run.
        ts = [s["t"] for s in samples if any(g["index"] == idx for g in s["data"].get("gpus", []))]
        for k in ("nvlink_tx_bytes", "nvlink_rx_bytes"):
            if k in acc and len(acc[k]) > 1 and ts[-1] > ts[0]:
                out[f"{k}_per_s"] = (acc[k][-1] - acc[k][0]) / (ts[-1] - ts[0])
        gpus[str(idx)] = out
    return {"gpus": gpus, "rank_gpu_memory_max_bytes": per_rank}
