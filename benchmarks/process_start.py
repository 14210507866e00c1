"""What forking tunekit's processes from a warm server saves: a study's trials, side by side.

    .venv/bin/python benchmarks/process_start.py [--workload example:cnn] [--trials 4] [--pairs 3]

Runs ``--trials`` short trials one after another in one process, as a study
does, ``--pairs`` times with each way of starting their torchrun agents,
interleaved (fork, spawn, spawn, fork, ...): ``fork`` (the default; each agent
forks from a server that imported torch, its elastic agent and ``torch._dynamo``
once: :mod:`tunekit.trials.warm_start`) and ``spawn``
(``TUNEKIT_PROCESS_START=spawn``: a fresh Python per agent). Ranks fork from
their agent in both. Each arm runs in a child process, so its CPU is the whole
process tree's (server, agents, ranks): the child's ``RUSAGE_CHILDREN`` after it
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

STUDY = """
import json, resource, sys, time
from pathlib import Path
from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync
workload, trials, steps, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
for i in range(trials):
    out = run_trial_sync(TrialSpec(workload, warmup=1, steps=steps), LaunchOptions(nproc=2),
                         Path(root) / f"trial{i}")
    if out.status != "ok":
        sys.exit(f"trial {i} ended {out.status}: {out.error}")
wall = time.perf_counter() - start
"""
# The server is this process's child too: it ends (and is waited for) when the process exits.
MEASURE = """
import atexit, json, os, resource, socket, time
@atexit.register
def _report():
    from tunekit.trials import warm_start
    for server in warm_start._servers.values():
        server.sock.shutdown(socket.SHUT_RDWR)  # the server sees us gone, ends, is waited for
        server.wait()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime}))
"""


def one_study(mode: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TUNEKIT_PROCESS_START=mode)
    with tempfile.TemporaryDirectory() as tmp:
        code = STUDY + MEASURE
        cmd = [sys.executable, "-c", code, args.workload, str(args.trials), str(args.steps), tmp]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"a {mode} study failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="example:cnn")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    rows = run_interleaved(args.pairs, lambda mode: one_study(mode, args))
    print_medians(
        rows,
        f"{args.trials} trials of {args.workload} on 2 ranks, {args.steps} steps each, "
        f"{args.pairs} pairs",
    )


if __name__ == "__main__":
    main()
