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
import subprocess
import sys
import tempfile

from fork_vs_spawn import print_medians, run_interleaved

TRIAL = """
import json, resource, sys, time
from pathlib import Path
from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync
workload, nproc, steps, trial_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
out = run_trial_sync(TrialSpec(workload, warmup=1, steps=steps), LaunchOptions(nproc=nproc),
                     Path(trial_dir))
wall = time.perf_counter() - start
from tunekit.trials import warm_start  # its agent's server: ended and waited for, so counted
import socket
for server in warm_start._servers.values():
    server.sock.shutdown(socket.SHUT_RDWR)
    server.wait()
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
    rows = run_interleaved(args.pairs, lambda mode: one_trial(mode, args))
    print_medians(
        rows,
        f"{args.workload}, {args.nproc} ranks, {args.steps} steps, {args.pairs} pairs",
    )


if __name__ == "__main__":
    main()
