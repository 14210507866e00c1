"""Throughput cost of the telemetry samplers on a running job, side by side in one run.

    .venv/bin/python benchmarks/telemetry_overhead.py [--steps 400] [--window 4]

One long trial of example:cnn on 2 gloo ranks (the real trial launcher). While
it runs, the samplers (host + NVML where present + py-spy, at the settings
given) are switched on and off in alternating windows of ``--window`` seconds,
so both conditions see the same processes, warm caches and neighbours; each
step (rank 0's ``progress.jsonl``: end time and duration) is assigned to the
window it lies wholly inside. Printed: per condition the steps, median and
mean step time, throughput at the median, and the ratio with a bootstrap 95%
interval; then the CPU the samplers themselves use per second (this process
plus the py-spy subprocesses) while watching busy ranks. Target: at most 1%
throughput cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tunekit.observe.telemetry import TelemetrySampler
from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync
from tunekit.workload import load_workload


def run(args) -> int:
    with tempfile.TemporaryDirectory(prefix="tunekit-telemetry-bench-") as tmp:
        trial_dir = Path(tmp)
        spec = TrialSpec(workload="example:cnn", warmup=5, steps=args.steps)
        result: dict = {}
        worker = threading.Thread(
            target=lambda: result.update(
                out=run_trial_sync(spec, LaunchOptions(nproc=args.nproc, timeout_s=1800), trial_dir)
            )
        )
        worker.start()
        windows: list[tuple[float, float, bool]] = []
        notices: list[str] = []
        on = False
        while worker.is_alive():
            t0 = time.time()
            sampler = None
            if on:
                sampler = TelemetrySampler(
                    trial_dir / "pids",
                    interval_s=args.interval,
                    pyspy_interval_s=args.pyspy_interval,
                ).start()
            worker.join(timeout=args.window)
            if sampler is not None:
                sampler.stop()
                notices = notices or sampler.notices
                samples = sampler.summary()["samples"]
            windows.append((t0, time.time(), on))
            if sampler is not None and not samples.get("host"):
                windows[-1] = (t0, time.time(), None)  # the ranks were not up yet
            on = not on
        out = result["out"]
        if not out.ok:
            print(f"trial failed: {out.status}: {out.error}", file=sys.stderr)
            return 1
        steps = [
            json.loads(line)
            for line in (trial_dir / "progress.jsonl").read_text().splitlines()
            if line.strip()
        ]
    measured = [s for s in steps if s.get("phase") == "measure"]
    by_cond: dict[bool, list[float]] = {True: [], False: []}
    for s in measured:
        end, start = s["t"], s["t"] - s["step_s"]
        for a, b, cond in windows:
            if cond is not None and a <= start and end <= b:
                by_cond[cond].append(s["step_s"])
                break
    batch = load_workload("example:cnn").batch_size * args.nproc
    off, on_ = np.array(by_cond[False]), np.array(by_cond[True])
    if len(off) < 5 or len(on_) < 5:
        print("too few steps inside windows; raise --steps or lower --window", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    ratios = [
        np.median(rng.choice(off, off.size)) / np.median(rng.choice(on_, on_.size))
        for _ in range(2000)
    ]
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    print(
        f"example:cnn, {args.nproc} rank(s) ({out.ranks[0].get('device', 'cpu') if out.ranks else 'cpu'}), "
        f"{len(measured)} measured steps, "
        f"{len([w for w in windows if w[2] is not None])} windows of {args.window:.0f} s; "
        f"telemetry every {args.interval} s, py-spy every {args.pyspy_interval} s"
    )
    for n in notices:
        print(f"notice: {n}")
    print(f"{'condition':<16}{'steps':>7}{'median ms':>12}{'mean ms':>10}{'samples/s':>12}")
    for name, arr in (("no telemetry", off), ("telemetry on", on_)):
        med = float(np.median(arr))
        print(
            f"{name:<16}{arr.size:>7}{med * 1e3:>12.2f}{statistics.fmean(arr) * 1e3:>10.2f}"
            f"{batch / med:>12.1f}"
        )
    ratio = float(np.median(off) / np.median(on_))
    print(
        f"throughput ratio on/off: {ratio:.4f} (95% bootstrap interval {lo:.4f} .. {hi:.4f}); "
        f"cost {100 * (1 - ratio):+.2f}% (target <= 1%)"
    )
    return 0


def sampler_cpu_cost(args, seconds: float = 10.0) -> None:
    """CPU the samplers themselves use (this process + py-spy children) per second of wall."""
    import resource
    import subprocess

    busy = "import time\nwhile True: sum(range(10000))\n"
    ranks = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(args.nproc)]
    try:
        time.sleep(0.5)
        before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        t0 = time.perf_counter()
        with TelemetrySampler(
            {r: p.pid for r, p in enumerate(ranks)},
            interval_s=args.interval,
            pyspy_interval_s=args.pyspy_interval,
        ) as sampler:
            time.sleep(seconds)
        wall = time.perf_counter() - t0
        after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    used = [
        a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
        for a, b in zip(after, before, strict=True)
    ]
    n = sampler.summary()["samples"]
    print(
        f"sampler CPU over {wall:.1f} s ({n}): {1e3 * used[0] / wall:.1f} ms/s in-process + "
        f"{1e3 * used[1] / wall:.1f} ms/s py-spy = {100 * sum(used) / wall:.2f}% of one core"
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--window", type=float, default=4.0, help="seconds per on/off window")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--interval", type=float, default=0.5, help="host/NVML sampling interval (s)")
    p.add_argument("--pyspy-interval", type=float, default=2.0, help="py-spy dump interval (s)")
    args = p.parse_args()
    rc = run(args)
    sampler_cpu_cost(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
