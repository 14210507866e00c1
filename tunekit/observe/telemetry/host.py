"""Host telemetry with psutil: CPU % and RSS of every rank's process, system memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psutil


class HostSource:
    """Samples the ranks' processes (by pid) and the machine's memory and CPU."""

    name = "host"

    def __init__(self) -> None:
        self.available = True
        self.notice = ""
        self.static: dict[str, Any] = {
            "cpus_logical": psutil.cpu_count(logical=True),
            "cpus_physical": psutil.cpu_count(logical=False),
            "memory_total_bytes": psutil.virtual_memory().total,
        }
        self._procs: dict[int, psutil.Process] = {}
        psutil.cpu_percent(None)  # start the system-wide CPU counter

    def _process(self, pid: int) -> tuple[psutil.Process | None, bool]:
        """The process for ``pid`` and whether it was new (its CPU counter just started)."""
        proc = self._procs.get(pid)
        if proc is not None:
            return proc, False
        try:
            proc = psutil.Process(pid)
            proc.cpu_percent(None)  # the first call only starts the counter
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None, False
        self._procs[pid] = proc
        return proc, True

    def sample(self, pids: Mapping[int, int]) -> dict[str, Any]:
        """CPU % since the previous sample (100 = one core; None on a rank's first
        sample, which only starts its counter) and RSS per rank."""
        ranks: dict[str, dict[str, Any]] = {}
        for rank, pid in sorted(pids.items()):
            proc, new = self._process(pid)
            if proc is None:
                continue
            try:
                with proc.oneshot():
                    cpu = proc.cpu_percent(None)
                    ranks[str(rank)] = {
                        "pid": pid,
                        "cpu_pct": None if new else cpu,
                        "rss_bytes": proc.memory_info().rss,
                        "threads": proc.num_threads(),
                    }
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                self._procs.pop(pid, None)
        for pid in set(self._procs) - set(pids.values()):
            self._procs.pop(pid, None)  # a rank that is gone
        vm = psutil.virtual_memory()
        return {
            "ranks": ranks,
            "system": {
                "cpu_pct": psutil.cpu_percent(None),
                "mem_used_bytes": vm.total - vm.available,
                "mem_total_bytes": vm.total,
                "mem_pct": vm.percent,
            },
        }

    def close(self) -> None:
        self._procs.clear()


def summarize_host(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank mean/max CPU % and peak RSS; system CPU mean and peak memory."""
    ranks: dict[str, dict[str, list[float]]] = {}
    sys_cpu, sys_mem = [], []
    for s in samples:
        d = s["data"]
        for rank, r in d.get("ranks", {}).items():
            acc = ranks.setdefault(rank, {"cpu": [], "rss": []})
            if r["cpu_pct"] is not None:
                acc["cpu"].append(r["cpu_pct"])
            acc["rss"].append(r["rss_bytes"])
        sys_cpu.append(d["system"]["cpu_pct"])
        sys_mem.append(d["system"]["mem_used_bytes"])
    out_ranks = {
        rank: {
            "cpu_pct_mean": sum(a["cpu"]) / len(a["cpu"]) if a["cpu"] else None,
            "cpu_pct_max": max(a["cpu"]) if a["cpu"] else None,
            "rss_max_bytes": int(max(a["rss"])),
        }
        for rank, a in sorted(ranks.items(), key=lambda kv: int(kv[0]))
    }
    return {
        "ranks": out_ranks,
        "system_cpu_pct_mean": sum(sys_cpu) / len(sys_cpu) if sys_cpu else None,
        "system_mem_used_max_bytes": int(max(sys_mem)) if sys_mem else None,
    }
