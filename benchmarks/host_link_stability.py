"""How stable is the "host link" cgdp reports? The same measurement in N fresh processes.

    .venv/bin/python benchmarks/host_link_stability.py [--runs 5] [--pause 5] [--peer]

Each run is a new interpreter that measures this machine's host link as cgdp's
diagnosis does (``plugins/cgdp/measure.py: copy_bandwidths``: a sweep of
one-thread host copies, 8-128 MiB, 2 warm-up and 9 timed rounds interleaved
across sizes, fitted on medians, with a 95 % bootstrap interval). With
``--peer`` each run also probes the gloo all-reduce between 2 ranks (the peer
figure cgdp compares with). Runs are ``--pause`` seconds apart so that they see
different moments of a shared machine's load.

Prints each run's figure with its interval and the spread of the figures over
the runs (max / min, and max - min): the number to compare with the old
measurement, which took the fastest of 7 copies of 16 MiB on all threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

_ONE_RUN = """
import json, sys, torch
from tunekit.plugins.cgdp.measure import copy_bandwidths
out = {"host": copy_bandwidths(torch.device("cpu"))[0].to_dict()}
if "--peer" in sys.argv:
    from tunekit.observe.probe import probe_hardware
    fit = probe_hardware(2, device_type="cpu").hardware.fit("all_reduce", 2)
    low, high = fit.bandwidth_bounds()
    out["peer"] = {"value": fit.bandwidth, "low": low, "high": high}
print(json.dumps(out))
"""


def one_run(peer: bool) -> dict[str, dict[str, float]]:
    """One measurement in a fresh interpreter (nothing cached, nothing warm)."""
    args = [sys.executable, "-c", _ONE_RUN] + (["--peer"] if peer else [])
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pause", type=float, default=5.0)
    ap.add_argument("--peer", action="store_true", help="also probe the gloo all-reduce")
    args = ap.parse_args()
    console = Console(width=120)
    figures = ("host", "peer") if args.peer else ("host",)
    table = Table(title="host link (and peer all-reduce), GB/s: median fit [95 % interval]")
    table.add_column("run", justify="right")
    table.add_column("load avg", justify="right")
    for f in figures:
        table.add_column(f, justify="right")
    results = []
    for i in range(args.runs):
        if i:
            time.sleep(args.pause)
        load = os.getloadavg()[0]
        res = one_run(args.peer)
        results.append(res)
        cells = [
            f"{res[f]['value'] / 1e9:.2f} [{res[f]['low'] / 1e9:.2f}–{res[f]['high'] / 1e9:.2f}]"
            for f in figures
        ]
        table.add_row(str(i + 1), f"{load:.1f}", *cells)
    console.print(table)
    for f in figures:
        values = [r[f]["value"] / 1e9 for r in results]
        console.print(
            f"{f}: medians {min(values):.2f}–{max(values):.2f} GB/s over {len(values)} runs "
            f"(max/min {max(values) / min(values):.2f}x, range {max(values) - min(values):.2f} GB/s)"
        )


if __name__ == "__main__":
    main()
