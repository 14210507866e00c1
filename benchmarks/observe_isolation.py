"""What running the workload's code in a child process costs ``tunekit auto``.

    .venv/bin/python benchmarks/observe_isolation.py [--workload example:cnn] [--repeats 4]

``tunekit auto`` runs no code of the workload in its own process: observation
(build, summarise, trace the model, time its layers) and the tuners' diagnose
and plan run in a child (``tunekit.observe.workload_process``), which pays an
interpreter, a torch import and a second load of the workload. This times both
stages both ways:

* ``observe``: ``observe_static`` in the process (as before) against
  ``observe_in_child``, on an empty store (the layer profile is measured);
* ``tuners``: every installed tuner's diagnose, then plan where it applies, on
  one measured and profiled baseline, in the process (with the profiler start
  ``tunekit auto`` then needed first) against a ``WorkloadProcess``.

Every run is a fresh Python process that has already imported the
orchestrator (``tunekit auto`` has too), and in-process and child runs
alternate, so that a busy machine slows both alike. Prints the median and
range of each, and what isolation adds to a study.
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


def one_run(stage: str, mode: str, workload: str, work: Path) -> float:
    """Seconds one stage took one way (in a fresh process: this is what a child of the benchmark runs)."""
    from tunekit.observe.breakdown import analyze_trial
    from tunekit.observe.observation import Measurement
    from tunekit.orchestrator import observe_in_child, observe_static
    from tunekit.store import Store

    db = work / f"{stage}-{mode}.db"
    db.unlink(missing_ok=True)
    if stage == "observe":
        store = Store(db)
        start = time.monotonic()
        if mode == "in":
            observe_static(workload, 2, "cpu", None, store)
        else:
            asyncio.run(observe_in_child(workload, 2, "cpu", None, store, log_dir=work))
        return time.monotonic() - start
    shutil.copy(work / "template.db", db)
    store = Store(db)
    static = observe_static(workload, 2, "cpu", None, store)  # the layer profile is cached: fast
    baseline = json.loads((work / "baseline.json").read_text())
    obs = static.observation(2, Measurement(**baseline["measurement"]), store)
    obs.breakdown = analyze_trial(baseline["trial_dir"])
    from tunekit.plugin_loading import load_all, select

    tuners = select(load_all(), None)
    start = time.monotonic()
    if mode == "in":
        from tunekit.observe.kineto import start_profiler_in_main_thread

        start_profiler_in_main_thread()
        for tuner in tuners.values():
            if tuner.diagnose(obs).applies:
                tuner.plan(obs, 8)
    else:
        asyncio.run(_tuners_in_child(obs, tuners, work))
    return time.monotonic() - start


async def _tuners_in_child(obs, tuners, work: Path) -> None:
    from tunekit.observe.workload_process import WorkloadProcess, observation_parts

    parts = observation_parts(obs, obs.cache.items())
    async with WorkloadProcess(work / "tuners.log", 600, setup={"op": "observation", "parts": parts}) as child:
        for name in tuners:
            got = await child.call("diagnose", f"running {name}'s diagnose", plugin=name)
            if got["diagnosis"]["applies"]:
                await child.call("plan", f"running {name}'s plan", plugin=name, limit=8)


def prepare(workload: str, work: Path) -> None:
    """A store with the layer profile cached, and one measured, profiled baseline trial."""
    from tunekit.orchestrator import PROFILE_STEPS, observe_static
    from tunekit.store import Store
    from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync

    store = Store(work / "template.db")
    observe_static(workload, 2, "cpu", None, store)
    store.close()
    trial_dir = work / "baseline"
    out = run_trial_sync(TrialSpec(workload, warmup=2, steps=8, profile_steps=PROFILE_STEPS),
                         LaunchOptions(nproc=2, timeout_s=600), trial_dir)
    if not out.ok:
        raise SystemExit(f"baseline trial failed: {out.error}")
    (work / "baseline.json").write_text(json.dumps({"measurement": out.measurement.to_dict(),
                                                    "trial_dir": str(trial_dir)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="example:cnn")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--one", nargs=3, metavar=("STAGE", "MODE", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        stage, mode, work = args.one
        print(json.dumps(one_run(stage, mode, args.workload, Path(work))))
        return
    work = Path(tempfile.mkdtemp(prefix="observe-isolation-"))
    prepare(args.workload, work)
    times: dict[tuple[str, str], list[float]] = {}
    for i in range(args.repeats):
        for stage in ("observe", "tuners"):
            for mode in (("in", "child") if i % 2 == 0 else ("child", "in")):
                out = subprocess.run([sys.executable, __file__, "--workload", args.workload, "--one", stage, mode,
                                      str(work)], capture_output=True, text=True, check=True)
                times.setdefault((stage, mode), []).append(json.loads(out.stdout.splitlines()[-1]))
                print(f"run {i + 1} {stage:8s} {mode:6s} {times[stage, mode][-1]:6.2f} s", flush=True)
    print(f"\n{args.workload}, {args.repeats} runs each (median, range):")
    added = 0.0
    for stage in ("observe", "tuners"):
        inp, child = times[stage, "in"], times[stage, "child"]
        added += statistics.median(child) - statistics.median(inp)
        print(f"  {stage:8s} in-process {statistics.median(inp):6.2f} s ({min(inp):.2f}-{max(inp):.2f})   "
              f"child {statistics.median(child):6.2f} s ({min(child):.2f}-{max(child):.2f})   "
              f"added {statistics.median(child) - statistics.median(inp):+.2f} s")
    print(f"  a study pays {added:+.2f} s for running the workload's code outside tunekit")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
