"""What running the workload's code in a child process costs ``tunekit auto``.

    .venv/bin/python benchmarks/observe_isolation.py [--workload example:cnn] [--repeats 4]

``tunekit auto`` runs no code of the workload in its own process: observation
(build, summarise, trace the model, time its layers) and the tuners' diagnose
and plan run in one child (``tunekit.observe.workload_process``), which pays an
interpreter, a torch import and a second load of the workload. This times, as
``run_auto`` runs them and both ways (in the process as before, and in the
child), loading the plugins and observing on an empty store (the layers are
timed), then every installed tuner's diagnose, and plan where it applies, on one
measured and profiled baseline (in the process with the profiler start that
``tunekit auto`` then needed first).

Every run is a fresh Python process that has already imported the
orchestrator (``tunekit auto`` has too), and in-process and child runs
alternate, so that a busy machine slows both alike. Prints the median and
range of each stage and what running the workload in a child adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(mode: str, workload: str, work: Path) -> dict[str, float]:
    """Seconds each stage took one way, in this (fresh) process, as ``run_auto`` runs them: load the
    plugins, observe (empty store: the layers are timed), then every tuner's diagnose and plan."""
    from tunekit.observe.breakdown import analyze_trial
    from tunekit.observe.observation import Measurement
    from tunekit.observe.static import observe_static
    from tunekit.observe.workload_process import OBSERVE_LOG
    from tunekit.plugin_loading import load_all, select
    from tunekit.store import Store

    db = work / f"{mode}.db"
    db.unlink(missing_ok=True)
    store = Store(db)
    baseline = json.loads((work / "baseline.json").read_text())

    def observed(static):
        obs = static.observation(2, Measurement(**baseline["measurement"]), store)
        obs.breakdown = analyze_trial(baseline["trial_dir"])
        return obs

    start = time.monotonic()
    if mode == "in":
        tuners = select(load_all(), None)
        static = observe_static(workload, 2, "cpu", None, store)
        observed_at = time.monotonic()
        from tunekit.observe.kineto import start_profiler_in_main_thread
        from tunekit.planning import diagnose_and_plan_here

        obs = observed(static)
        start_profiler_in_main_thread()  # tunekit auto needed it before tuners profiled from a thread
        for _ in diagnose_and_plan_here(tuners, obs, 8):
            pass
    else:
        observed_at = asyncio.run(_in_child(workload, store, work / OBSERVE_LOG, observed))
    done = time.monotonic()
    return {"observe": observed_at - start, "tuners": done - observed_at, "total": done - start}


async def _in_child(workload: str, store, log: Path, observed) -> float:
    from tunekit.observe.static import observe_in_child
    from tunekit.observe.workload_process import WorkloadProcess
    from tunekit.planning import ChildHooks, diagnose_and_plan
    from tunekit.plugin_loading import load_all, select

    child = WorkloadProcess(log, 600)
    await child.start()
    tuners = select(load_all(), None)
    static = await observe_in_child(workload, 2, "cpu", None, store, child=child)
    observed_at = time.monotonic()
    obs = observed(static)
    hooks = ChildHooks(child, obs)
    async with child:
        async for _ in diagnose_and_plan(tuners, hooks, 8):
            pass
    return observed_at


def prepare(workload: str, work: Path) -> None:
    """One measured, profiled baseline trial, as a study's first."""
    from tunekit.orchestrator import PROFILE_STEPS
    from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync

    trial_dir = work / "baseline"
    out = run_trial_sync(
        TrialSpec(workload, warmup=2, steps=8, profile_steps=PROFILE_STEPS),
        LaunchOptions(nproc=2, timeout_s=600),
        trial_dir,
    )
    if not out.ok:
        raise SystemExit(f"baseline trial failed: {out.error}")
    (work / "baseline.json").write_text(
        json.dumps({"measurement": out.measurement.to_dict(), "trial_dir": str(trial_dir)})
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="example:cnn")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        mode, work = args.one
        print(json.dumps(one_run(mode, args.workload, Path(work))))
        return
    work = Path(tempfile.mkdtemp(prefix="observe-isolation-"))
    prepare(args.workload, work)
    runs: dict[str, list[dict[str, float]]] = {"in": [], "child": []}
    for i in range(args.repeats):
        for mode in ("in", "child") if i % 2 == 0 else ("child", "in"):
            out = subprocess.run(
                [sys.executable, __file__, "--workload", args.workload, "--one", mode, str(work)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[mode].append(json.loads(out.stdout.splitlines()[-1]))
            t = runs[mode][-1]
            print(
                f"run {i + 1} {mode:6s} observe {t['observe']:6.2f} s  tuners {t['tuners']:6.2f} s  "
                f"total {t['total']:6.2f} s",
                flush=True,
            )
    print(f"\n{args.workload}, {args.repeats} runs each (median, range):")
    for stage in ("observe", "tuners", "total"):
        inp = [r[stage] for r in runs["in"]]
        child = [r[stage] for r in runs["child"]]
        print(
            f"  {stage:8s} in-process {statistics.median(inp):6.2f} s ({min(inp):.2f}-{max(inp):.2f})   "
            f"child {statistics.median(child):6.2f} s ({min(child):.2f}-{max(child):.2f})   "
            f"added {statistics.median(child) - statistics.median(inp):+.2f} s"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
