"""overlap_chunking tuned vs DDP's defaults, on 2 gloo ranks, side by side in one run.

    .venv/bin/python benchmarks/overlap_chunking_tuned.py [--workloads cnn,alexnet@2]
        [--candidates 3] [--warmup 2] [--steps 4] [--rounds 3]

Per workload:

1. probe this machine's all-reduce (``tunekit.observe.probe``) for the
   communication model;
2. in one pair of ranks: measure the baseline (PyTorch's DDP defaults: 25 MiB
   buckets, 1 MiB first bucket), let the tuner plan on rank 0 (per-layer times
   measured there, calibrated to that baseline), then run the baseline, the
   baseline with per-bucket timing on (the cost of measuring R), and each
   candidate, switched live at step boundaries and interleaved in ``--rounds``
   rounds so drift on a shared machine hits all of them alike;
3. print, per config: predicted and measured step time (median over steps of
   the slower rank), the prediction error, the measured and predicted overlap
   ratio R, and the speed-up over the default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tunekit.config import TuningConfig
from tunekit.hardware import Hardware
from tunekit.observe.observation import Measurement, Observation, summarize_model
from tunekit.observe.probe import probe_hardware
from tunekit.plugins.overlap_chunking.plugin import OverlapChunking
from tunekit.runtime.dist import broadcast_object
from tunekit.runtime.session import Session
from tunekit.runtime.sync import DDPSync
from tunekit.testing import run_ranks
from tunekit.workload import load_workload

NAME = "overlap_chunking"


def _measure(session: Session, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Per measured step the slower rank's time, and this rank's R per step."""
    for _ in range(warmup):
        session.train_step()
    recs = [session.train_step() for _ in range(steps)]
    times = torch.tensor([r.step_s for r in recs], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist(), [r.metrics["overlap_R"] for r in recs if "overlap_R" in r.metrics]


def _install(
    session: Session, tuner: OverlapChunking, knobs: dict | None, measured_default: bool
) -> None:
    config = TuningConfig({NAME: knobs}) if knobs else TuningConfig()
    session.apply_config(config, {NAME: tuner})
    if measured_default:
        session.set_grad_sync(DDPSync(measure=True))


def bench_rank(
    rank: int, world: int, spec: str, batch: int | None, hw: dict, opts: dict
) -> dict | None:
    workload = load_workload(spec)
    if batch:
        workload.batch_size = batch
    session = Session(workload, rank=rank, world_size=world, group=dist.group.WORLD)
    tuner = OverlapChunking()
    warmup, steps = opts["warmup"], opts["steps"]

    # The baseline the tuner plans from (as the orchestrator's baseline trial);
    # a longer warm-up: the first steps of a fresh job run slow.
    base_times, _ = _measure(session, 2 * warmup + 2, 2 * steps)
    plan = None
    if rank == 0:
        t0 = time.perf_counter()
        summary = summarize_model(workload.model(), workload.example_batch(2)[0])
        median = statistics.median(base_times)
        baseline = Measurement(base_times, median, 0.0, world * workload.batch_size / median)
        obs = Observation(
            spec, workload, world, "gloo", "cpu", Hardware.from_dict(hw), summary, baseline=baseline
        )
        diagnosis = tuner.diagnose(obs)
        candidates = tuner.plan(obs, opts["candidates"])
        default = diagnosis.details["predicted_default"]
        plan = {
            "plan_s": time.perf_counter() - t0,
            "baseline_s": median,
            "scale": diagnosis.details["compute_scale"],
            "diagnosis": diagnosis.summary,
            "default": {"predicted": default["step_s"], "R": default["overlap_R"]},
            "candidates": [
                {
                    "knobs": c.knobs,
                    "predicted": c.predicted_step_s,
                    "R": c.details["overlap_R"],
                    "why": c.rationale,
                }
                for c in candidates
            ],
        }
    plan = broadcast_object(plan)

    configs = [("DDP default (25 MiB, first 1 MiB)", None, False, plan["default"])]
    configs.append(("DDP default, T_c/T_b timed", None, True, plan["default"]))
    for c in plan["candidates"]:
        configs.append((_label(c["knobs"]), c["knobs"], False, c))
    rows = {label: {"times": [], "R": []} for label, *_ in configs}
    for _ in range(opts["rounds"]):
        for label, knobs, timed, _pred in configs:
            _install(session, tuner, knobs, timed)
            times, rs = _measure(session, warmup, steps)
            rows[label]["times"] += times
            rows[label]["R"] += rs
    session.close()
    if rank != 0:
        return None
    return {
        "plan": plan,
        "rows": [
            {"label": label, "predicted": pred["predicted"], "R_pred": pred["R"], **rows[label]}
            for label, _knobs, _timed, pred in configs
        ],
    }


def _label(knobs: dict) -> str:
    if knobs["mode"] == "two_chunk":
        return f"two_chunk k={knobs['k']} f={knobs['f']}"
    return f"DDP {knobs['bucket_cap_mb']:g} MiB, first {knobs['first_bucket_mb']:g} MiB"


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[1], q[2] - q[0]


def print_table(spec: str, result: dict, probe_fit) -> None:
    plan = result["plan"]
    scale = plan["scale"] or float("nan")
    print(
        f"\n## {spec}  (2 gloo ranks; all-reduce fit {probe_fit.latency * 1e6:.0f} us + "
        f"bytes / {probe_fit.bandwidth / 1e9:.2f} GB/s; compute scale {scale:.2f}; "
        f"diagnose + plan {plan['plan_s']:.1f} s; planned from a baseline of "
        f"{plan['baseline_s'] * 1e3:.1f} ms)"
    )
    print(f"diagnosis: {plan['diagnosis']}")
    head = (
        f"{'config':<36} {'predicted':>10} {'measured':>10} {'IQR':>8} {'error':>7} "
        f"{'R meas':>7} {'R pred':>7} {'speed-up':>8} {'predicted':>9}"
    )
    print(head)
    print("-" * len(head))
    rows = result["rows"]
    default_ms = statistics.median(rows[0]["times"]) * 1e3
    default_pred = rows[0]["predicted"] * 1e3
    errors = []
    for i, row in enumerate(rows):
        median, iqr = _quartiles(row["times"])
        ms = median * 1e3
        pred = row["predicted"] * 1e3
        err = (pred - ms) / ms * 100
        if i >= 2:  # the candidates (the default's prediction is calibrated to it)
            errors.append(abs(err))
        r_meas = f"{statistics.median(row['R']):.0f}" if row["R"] else "-"
        r_pred = f"{row['R_pred']:.0f}" if row["R_pred"] is not None else "-"
        print(
            f"{row['label']:<36} {pred:>8.1f}ms {ms:>8.1f}ms {iqr * 1e3:>6.1f}ms {err:>+6.0f}% "
            f"{r_meas:>7} {r_pred:>7} {default_ms / ms:>7.2f}x {default_pred / pred:>8.2f}x"
        )
    winner = min([rows[0], *rows[2:]], key=lambda r: statistics.median(r["times"]))
    timed = statistics.median(rows[1]["times"]) * 1e3
    print(
        f"tuned: {winner['label']} ({default_ms / (statistics.median(winner['times']) * 1e3):.2f}x "
        f"the default); mean |prediction error| of the candidates {statistics.mean(errors):.0f}%; "
        f"timing DDP's buckets costs {(timed - default_ms) / default_ms * 100:+.1f}% (noise level: IQR above)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workloads",
        default="cnn,alexnet@2",
        help="comma-separated example names or specs; NAME@B sets the per-rank batch to B",
    )
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    probe = probe_hardware(2, sizes=tuple(4096 * 4**i for i in range(9)), repeats=3)
    hw = probe.hardware
    fit = hw.fit("all_reduce", 2)
    print(
        f"probe: {probe.wall_s:.1f} s; torch {torch.__version__}; {torch.get_num_threads()} threads here"
    )
    opts = {
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "candidates": args.candidates,
    }
    for item in args.workloads.split(","):
        name, _, batch = item.partition("@")
        spec = name if ":" in name else f"example:{name}"
        args_ = (spec, int(batch) if batch else None, hw.to_dict(), opts)
        result = run_ranks(bench_rank, 2, args_, timeout_s=1800)[0]
        print_table(f"{spec}, batch {batch} per rank" if batch else spec, result, fit)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
