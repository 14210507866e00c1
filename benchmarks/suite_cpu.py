"""Where the test suite's CPU goes: by kind of process and by test; beside busy loops, what
share of the machine the suite got.

    .venv/bin/python benchmarks/suite_cpu.py [--busy-loops N [--own-sessions]] [pytest arguments ...]

Runs ``pytest`` (the README's command, or the arguments given) with a
``sitecustomize`` on ``PYTHONPATH`` that makes every Python process the suite
starts (xdist workers, torchrun agents, ranks, ``tunekit`` commands, workload
children) append its CPU time, its command and the test that started it
(``PYTEST_CURRENT_TEST``, which children inherit) to a log when it exits. Then
prints the CPU by kind of process, the share spent in processes that imported
torch, and the tests whose processes cost the most.

A process ended by a signal (a rank a test kills, an agent stopped at a
timeout) runs no exit hook and is missing from the tables; the first line
compares what they hold with the CPU of the whole process tree (the
runner's ``RUSAGE_CHILDREN``), so the gap is visible.

``--busy-loops N`` runs N ``python -c "while True: pass"`` beside the suite (issue 29's
load), started from this process's session as a script would start them, or each in a
session of its own with ``--own-sessions`` (as from other terminals: Linux's autogroup
scheduler shares the CPU between sessions first), and prints the CPU the loops and the
suite got: where the suite gets about one core, its test time cannot fall below about its
CPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

HOOK = """
import atexit, json, os, sys, time

_log = os.environ.get("TUNEKIT_SUITE_CPU_LOG")


def _write():
    t = os.times()
    row = {
        "argv": sys.argv[:4],
        "cpu": t.user + t.system,
        "torch": "torch" in sys.modules,
        "dynamo": "torch._dynamo" in sys.modules,
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0],
    }
    with open(_log, "a") as f:  # one short line per write: appends do not interleave
        f.write(json.dumps(row) + "\\n")


def _again_in_a_fork():
    # A forked process (tunekit's warm server forks agents and workload processes) logs its
    # own CPU: once, even where the process it forked from dropped its exit hooks.
    atexit.unregister(_write)
    atexit.register(_write)


if _log:
    atexit.register(_write)
    os.register_at_fork(after_in_child=_again_in_a_fork)
"""

KINDS = (
    ("tunekit.runtime.worker", "trial rank"),
    ("tunekit/runtime/worker.py", "trial rank"),
    ("tunekit.runtime.live", "live-job rank"),
    ("tunekit/runtime/live.py", "live-job rank"),
    ("tunekit.trials.agent", "torchrun agent (tunekit's)"),
    ("tunekit/trials/agent.py", "torchrun agent (tunekit's)"),
    ("torch/distributed/run.py", "torchrun agent"),
    ("torch.distributed.run", "torchrun agent"),
    ("workload_child", "workload child (observation, diagnoses)"),
    ("pytest", "pytest (the runner, tests' own pytest runs)"),
    ("tunekit/__main__.py", "tunekit command"),
    ("bin/tunekit", "tunekit command"),
)


def kind(argv: list[str]) -> str:
    line = " ".join(argv)
    for needle, name in KINDS:
        if needle in line:
            return name
    if argv[:1] == ["-c"]:
        return "python -c (xdist workers, tests' helpers)"
    return Path(argv[0]).name if argv else "?"


def table(title: str, rows: dict[str, list[float]], limit: int) -> None:
    print(f"\n{title}")
    print(f"{'CPU s':>8} {'procs':>6} {'torch':>6}  what")
    for name, (cpu, n, torch) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:limit]:
        print(f"{cpu:8.1f} {n:6.0f} {torch:6.0f}  {name}")


def stop(loops: list[subprocess.Popen]) -> None:
    for p in loops:
        p.kill()  # nothing where it already ended
        p.wait()  # its CPU joins RUSAGE_CHILDREN, taken out of the suite's below


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--busy-loops", type=int, default=0)
    parser.add_argument("--own-sessions", action="store_true")
    ours, args = parser.parse_known_args()
    loops: list[subprocess.Popen] = []
    try:
        for _ in range(ours.busy_loops):
            loops.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"], start_new_session=ours.own_sessions
                )
            )
        measure(args, loops, ours.own_sessions)
    except KeyboardInterrupt:
        sys.exit("interrupted")
    finally:  # never leave a loop spinning, Ctrl+C included
        stop(loops)


def measure(args: list[str], loops: list[subprocess.Popen], own_sessions: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(HOOK)
        log = Path(tmp) / "procs.jsonl"
        env = dict(os.environ, TUNEKIT_SUITE_CPU_LOG=str(log))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, env.get("PYTHONPATH")]))
        wall = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env)
        wall = time.perf_counter() - wall
        loops_cpu = [sum(psutil.Process(p.pid).cpu_times()[:2]) for p in loops]
        stop(loops)
        tree = resource.getrusage(resource.RUSAGE_CHILDREN)
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    logged = sum(r["cpu"] for r in rows)
    suite = tree.ru_utime + tree.ru_stime - sum(loops_cpu)
    print(
        f"\npytest exited {done.returncode} after {wall:.0f} s; CPU of the process tree "
        f"{suite:.0f} s, {len(rows)} processes logged "
        f"{logged:.0f} s (the log misses processes ended by a signal, the tree those whose "
        "parent never waited for them)"
    )
    if loops:
        where = "each in a session of its own" if own_sessions else "in this session"
        cores = os.cpu_count() or 1
        print(
            f"beside {len(loops)} busy loops ({where}): the loops got {sum(loops_cpu):.0f} s "
            f"of CPU ({sum(loops_cpu) / wall:.2f} cores), the suite at least "
            f"{max(suite, logged):.0f} s ({max(suite, logged) / wall:.2f} cores) of the "
            f"{cores} cores' {cores * wall:.0f} s"
        )
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    by_test: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    for r in rows:
        for key, into in ((kind(r["argv"]), by_kind), (r["test"], by_test)):
            if key:
                into[key][0] += r["cpu"]
                into[key][1] += 1
                into[key][2] += r["torch"]
    table("by kind of process (torch: how many imported it)", by_kind, 20)
    table("by the test that started them (the xdist workers' own CPU not included)", by_test, 30)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
