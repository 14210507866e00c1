"""The demo against its promise: `tunekit auto` with no arguments, timed, in fresh folders.

    .venv/bin/python benchmarks/demo_minute.py [--runs 3] [--keep-store] [--out DIR]

Each run is the command a new user types after the install, `tunekit auto`, in a folder
of its own (a fresh study store: the probe, the layer timings and every tuner's
measurements are paid again; `--keep-store` runs them all in one folder, as a user
running the demo twice would). Per run it prints the wall time of the whole command, the
lines it printed, the decision and whether the study's own measurements support it (a
candidate measured, `still_unclear` found nothing left to measure, a winner confirmed), and
where the time went, stage by stage, from report.json's `timings` (wall and CPU seconds).

The promise (issue 35): at most 60 s a run on the idle 2-core machine, each ending in a
decision its confirmation supports, at most ~40 lines of output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMISE_S = 60.0
PROMISE_LINES = 40


def run_once(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "tunekit", "auto"],
        cwd=folder,
        capture_output=True,
        text=True,
        env=None,
    )
    wall = time.monotonic() - start
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    out = {"wall_s": wall, "rc": res.returncode, "lines": len(lines), "stderr": res.stderr[-500:]}
    report_path = folder / "tunekit-out" / "report.json"
    if res.returncode == 0 and report_path.exists():
        report = json.loads(report_path.read_text())
        d = report["decision"]
        more = d.get("measured_more") or {}
        winner = next(
            (c for c in d.get("candidates", []) if c.get("trial_id") == d.get("winner_trial")),
            None,
        )
        out.update(
            winner=d.get("winner"),
            speedup=d.get("speedup"),
            reason=d.get("reason", ""),
            # A decision: some candidate measured, nothing left unclear, a winner confirmed.
            tried=any(c.get("comparison") for c in d.get("candidates", [])),
            # Two winners within each other's noise: the win is clear, either config gains it.
            clear=bool(more.get("clear", True) or more.get("rival_only")),
            confirmed=winner is None or winner.get("runs", 0) >= 2,
            timings=report.get("timings", []),
        )
    return out


def stage_table(timings: list[dict]) -> list[str]:
    rows = [f"  {'stage':52} {'wall':>7} {'CPU':>7}"]
    for s in timings:
        name = ("  " if s.get("part_of") else "") + s["stage"]
        cpu = "—" if s.get("cpu_s") is None else f"{s['cpu_s']:.1f}"
        rows.append(f"  {name[:52]:52} {s['wall_s']:7.1f} {cpu:>7}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep-store", action="store_true", help="all runs in one folder")
    ap.add_argument("--out", type=Path, default=None, help="keep the runs' folders here")
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="tunekit-demo-"))
    results = []
    for i in range(1, args.runs + 1):
        folder = root / ("demo" if args.keep_store else f"run{i}")
        r = run_once(folder)
        results.append(r)
        verdict = (
            "decided, supported by its own measurements"
            if r.get("tried") and r.get("clear") and r.get("confirmed")
            else "NOT supported: " + r.get("reason", r["stderr"])
        )
        print(
            f"run {i}: {r['wall_s']:.1f} s, {r['lines']} lines, rc {r['rc']}: "
            f"{r.get('winner')} {r.get('speedup') or 1:.2f}x — {verdict}",
            flush=True,
        )
        print("\n".join(stage_table(r.get("timings", []))), flush=True)
    ok = [
        r["rc"] == 0
        and r["wall_s"] <= PROMISE_S
        and r["lines"] <= PROMISE_LINES
        and r.get("tried")
        and r.get("clear")
        and r.get("confirmed")
        for r in results
    ]
    print(
        f"{sum(ok)} of {len(results)} runs within {PROMISE_S:.0f} s and {PROMISE_LINES} lines, "
        f"with a decision their own measurements support (folders in {root})"
    )


if __name__ == "__main__":
    main()
