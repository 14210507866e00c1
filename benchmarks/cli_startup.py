"""CPU seconds of the ``tunekit`` commands that need no model, for two installs side by side.

    .venv/bin/python benchmarks/cli_startup.py OLD/bin/tunekit NEW/bin/tunekit [ROUNDS]

Runs each command with each executable in turn (interleaved, ROUNDS times, default 3) in a
scratch folder holding an empty study store and a stopped run ``job``, and prints the median
user+system CPU of each command and the totals. Only the commands' own output is discarded.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tunekit.runtime.rundir import RunDir
from tunekit.store import Store

COMMANDS = [
    "--help",
    "report --help",
    "auto --help",
    "report",
    "report --list",
    "report 7",
    "status job",
    "stop job",
    "auto example:nope",
    "auto --plugins nope",
    "plan nope",
    "run nope",
    "run example:nope",
    "profile missing.py:fn",
]


def cpu_of(exe: str, args: str, cwd: Path) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([exe, *args.split()], cwd=cwd, capture_output=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        Store.open_default(cwd / ".tunekit").close()
        rd = RunDir.create(cwd / ".tunekit", {"workload": "example:cnn", "nproc": 2}, name="job")
        rd.write_status({"status": "stopped", "step": 5, "world_size": 2, "config": {}})
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for args in COMMANDS:
                for exe in (old, new):
                    times.setdefault((exe, args), []).append(cpu_of(exe, args, cwd))
    print(
        f"{'tunekit ...':<24} {'old s':>7} {'new s':>7}  (median CPU of {rounds}, {os.cpu_count()} cores)"
    )
    total = {old: 0.0, new: 0.0}
    for args in COMMANDS:
        med = {exe: statistics.median(times[exe, args]) for exe in (old, new)}
        total[old] += med[old]
        total[new] += med[new]
        print(f"{args:<24} {med[old]:7.2f} {med[new]:7.2f}")
    print(f"{'total':<24} {total[old]:7.2f} {total[new]:7.2f}  ({total[old] / total[new]:.1f}x)")


if __name__ == "__main__":
    main()
