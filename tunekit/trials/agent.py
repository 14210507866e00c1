"""A torchrun agent that writes down how its failed ranks ended.

    python -m tunekit.trials.agent REPORT.json|- [torchrun arguments ...]

torchrun knows each failed rank's exit status (it waited for the process) but
only prints it ("exitcode: -11", "error_file: <N/A>") and exits 1. This runs
torchrun's own ``main`` and, when ranks fail, writes each one's global rank,
pid, exit code and signal to ``REPORT.json`` before exiting as torchrun does,
so that the launcher classifies a trial from facts instead of its log (``-``: no
report, for the live job's supervisor, which reads only the exit code).

When the ranks fork from the agent (:mod:`tunekit.runtime.rank_entry`), the agent
first imports what they will import, so that each rank starts with it in memory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tunekit.runtime import rank_entry


def failures_of(exc) -> list[dict]:
    """A ``ChildFailedError``'s failures, first to fail first."""
    rows = []
    for rank, f in sorted(exc.failures.items(), key=lambda kv: kv[1].timestamp):
        rows.append(
            {
                "rank": int(rank),
                "local_rank": f.local_rank,
                "pid": f.pid,
                "exitcode": f.exitcode,
                "timestamp": f.timestamp,
            }
        )
    return rows


def main(argv: list[str]) -> int:
    if not argv:
        print(
            "usage: python -m tunekit.trials.agent REPORT.json|- [torchrun arguments ...]",
            file=sys.stderr,
        )
        return 2
    report, args = (None if argv[0] == "-" else Path(argv[0])), argv[1:]
    if rank_entry.__file__ in args:  # the ranks fork from here: import their modules once
        rank_entry.preload(args[args.index(rank_entry.__file__) + 1])
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(args)
    except ChildFailedError as exc:
        if report is None:
            raise
        tmp = report.with_suffix(".tmp")
        tmp.write_text(json.dumps({"failures": failures_of(exc)}))
        os.replace(tmp, report)
        print(exc, file=sys.stderr)  # torchrun's own summary, for the log
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
