"""The loop and the table that ``rank_start.py`` and ``process_start.py`` share: one run of
each way of starting processes per pair, interleaved (fork, spawn, spawn, fork, ...), then
each way's median wall time and CPU and their ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

MODES = ("fork", "spawn")


def run_interleaved(pairs: int, one: Callable[[str], dict]) -> dict[str, list[dict]]:
    """``one(mode)`` (a dict with ``wall_s`` and ``cpu_s``) ``pairs`` times per mode."""
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(pairs):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            r = one(mode)
            rows[mode].append(r)
            print(f"pair {i + 1} {mode:5}  wall {r['wall_s']:5.2f} s  cpu {r['cpu_s']:5.2f} s")
            time.sleep(0.5)
    return rows


def print_medians(rows: dict[str, list[dict]], title: str) -> None:
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
        for mode, rs in rows.items()
    }
    print(f"\n{title} (medians)")
    print(f"{'':6}{'wall s':>8}{'CPU s':>8}")
    for mode, m in med.items():
        print(f"{mode:6}{m['wall_s']:8.2f}{m['cpu_s']:8.2f}")
    print(
        f"fork/spawn: wall {med['fork']['wall_s'] / med['spawn']['wall_s']:.2f}x, "
        f"CPU {med['fork']['cpu_s'] / med['spawn']['cpu_s']:.2f}x"
    )
