"""What forking ranks from their agent saves: CPU and time of whole trials, side by side.

    .venv/bin/python benchmarks/rank_start.py [--workload example:cnn] [--nproc 2] [--pairs 5]

Runs the same short trial ``--pairs`` times with each way of starting ranks,
interleaved (fork, spawn, fork, spawn, ...): ``fork`` (the default; each rank
forks from its torchrun agent, torch and ``torch._dynamo`` already imported) and
``spawn`` (``TUNEKIT_RANK_START=spawn``: a fresh Python per rank, as plain
torchrun does). Each trial runs in a child process, so its CPU is the whole
process tree's (agent and ranks): the child's ``RUSAGE_CHILDREN`` after it
waited for them. Prints each arm's median wall time and CPU, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TRIAL = """
import json, resource, sys, time
from pathlib import Path
from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync
workload, nproc, steps, trial_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
out = run_trial_sync(TrialSpec(workload, warmup=1, steps=steps), LaunchOptions(nproc=nproc),
                     Path(trial_dir))
wall = time.perf_counter() - start
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"status": out.status, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "error": out.error}))
"""


def one_trial(mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TUNEKIT_RANK_START=mode)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-c", TRIAL, args.workload, str(args.nproc), str(args.steps), tmp]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"a {mode} trial failed: {done.stderr.strip().splitlines()[-1:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if row["status"] != "ok":
        sys.exit(f"a {mode} trial ended {row['status']}: {row['error']}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="example:cnn")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {"fork": [], "spawn": []}
    for i in range(args.pairs):
        for mode in ("fork", "spawn") if i % 2 == 0 else ("spawn", "fork"):
            rows[mode].append(one_trial(mode, args))
            r = rows[mode][-1]
            print(f"pair {i + 1} {mode:5}  wall {r['wall_s']:5.2f} s  cpu {r['cpu_s']:5.2f} s")
            time.sleep(0.5)
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
        for mode, rs in rows.items()
    }
    print(
        f"\n{args.workload}, {args.nproc} ranks, {args.steps} steps, {args.pairs} pairs (medians)"
    )
    print(f"{'':6}{'wall s':>8}{'CPU s':>8}")
    for mode, m in med.items():
        print(f"{mode:6}{m['wall_s']:8.2f}{m['cpu_s']:8.2f}")
    print(
        f"fork/spawn: wall {med['fork']['wall_s'] / med['spawn']['wall_s']:.2f}x, "
        f"CPU {med['fork']['cpu_s'] / med['spawn']['cpu_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
