"""The sharding tuner's pick against an exhaustive grid of layouts, under a memory cap.

    .venv/bin/python benchmarks/sharding_vs_grid.py [--jobs over,near] [--steps 8] [--warmup 3]
        [--final-rounds 2] [--plugins all|sharding] [--quick] [--out benchmarks/results/sharding_vs_grid]

Two jobs on 2 gloo ranks, each under a ``--memory-cap`` (per rank; a step over it fails
its trial as an out-of-memory), both the example GPT's model at a size whose activations
fill most of a rank's memory (``plugins/sharding/tests/workloads_sharding.py``):

* ``over`` — written as jobs that do not fit replicated are: FSDP2, resharded after
  forward, every block checkpointed; the cap (44 MiB) is about half what plain DDP at its
  batch needs (~77 MiB measured), so no DDP setting without checkpointing or micro-batches fits;
* ``near`` — plain DDP, fitting but near its bound (a cap of 84 MiB, ~92% used).

Per job:

1. **The grid**: every setting of the stated space runs as a real trial
   (``tunekit.trials.launcher``, the cap enforced as in a study), interleaved with a
   baseline run after every three, configs in a shuffled order::

       strategy        ddp, fsdp (reshard after forward), fsdp (no reshard)
       checkpointing   none, full (every block), selective (every block)
       micro-batches   1, 2, 4 (x accumulation at the same 16 samples per rank and step)

   3 x 3 x 3 = 27 settings, the job's own among them (it is the baseline). Each is
   compared per sample with the pooled baseline (``tunekit.trials.stats.compare_runs``).
2. **tunekit**: ``tunekit auto --memory-cap`` with its default budget (3 candidate
   trials; ``--plugins`` every installed tuner, or the ones given) through the Python API;
   its pick, its trials (every non-baseline trial run: searches, candidates,
   confirmations, combinations) and whether any ran out of memory (a trial, or a variant
   an in-job search had to drop).
3. **Side by side**: the baseline, the grid's best and tunekit's pick in
   ``--final-rounds`` interleaved rounds, so the two picks meet on the same machine state.

Printed: the grid's best against the best DDP setting that fits, tunekit's pick against
the grid's best (throughput ratio with its 95% bootstrap interval; the target: within 5%),
tunekit's trials as a share of the grid's (target: at most 25%), and out-of-memory trials
(the grid's, expected; tunekit's, the target: none). ``--quick`` runs a third of the grid
(every strategy, one checkpointing and one split each, chosen at random) to smoke-test the
script.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import tempfile
from pathlib import Path

import grid_bench as gb

from tunekit.config import TuningConfig
from tunekit.events import Event, Notice, TrialFinished
from tunekit.orchestrator import AutoSettings
from tunekit.plugins.sharding.plugin import Sharding
from tunekit.workload import load_workload

HERE = Path(__file__).resolve().parent
WORKLOADS = "tunekit.plugins.sharding.tests.workloads_sharding"
JOBS = {
    "over": (f"{WORKLOADS}:gpt_sharded", 44 * gb.MiB),
    "near": (f"{WORKLOADS}:gpt_ddp", 84 * gb.MiB),
}
STRATEGIES = {
    "ddp": {"sharding": "ddp"},
    "fsdp": {"sharding": "fsdp", "reshard_after_forward": True},
    "fsdp-no-reshard": {"sharding": "fsdp", "reshard_after_forward": False},
}
CHECKPOINTING = {
    "none": {"checkpointing": "none"},
    "full": {"checkpointing": "full", "checkpoint_every": 1},
    "selective": {"checkpointing": "selective", "checkpoint_every": 1},
}
MICRO_BATCHES = (1, 2, 4)


def grid(spec: str, quick: bool) -> list[dict]:
    """The stated space (module docstring) as sharding-tuner configs, the job's own left out."""
    w = load_workload(spec)
    own = w.layout()
    configs = []
    for (_, strategy), (_, ckpt), micro in itertools.product(
        STRATEGIES.items(), CHECKPOINTING.items(), MICRO_BATCHES
    ):
        layout = own.with_changes({**strategy, **ckpt, "checkpoint_blocks": None})
        if layout == own and micro == w.accumulation:
            continue  # the baseline
        configs.append({"plugins": {"sharding": {**strategy, **ckpt, "micro_batches": micro}}})
    if quick:
        configs = random.Random(1).sample(configs, len(configs) // 3)
    return configs


def strategy_of(config: dict) -> str:
    knobs = (config.get("plugins") or {}).get("sharding") or {}
    return knobs.get("sharding", "workload")


def describe(config: dict | None) -> str:
    """The config's knobs that differ from their defaults (a found search records them all)."""
    if not config or not config.get("plugins"):
        return "baseline"
    defaults = {"sharding": {**Sharding().defaults(), "search": ""}}
    return TuningConfig.from_dict(config).describe(defaults)


def tunekit_pick(spec: str, cap: int, root: Path, args) -> dict:
    """``tunekit auto --memory-cap`` with its default budget: its pick, trials and OOMs."""
    settings = AutoSettings(
        workload=spec,
        nproc=2,
        plugins=args.plugins,
        steps=args.steps,
        warmup=args.warmup,
        out_dir=root / "auto-out",
        store_dir=root / "auto-store",
        memory_cap_bytes=cap,
    )

    def show(ev: Event) -> None:
        if isinstance(ev, TrialFinished):
            got = f"{ev.median_s * 1e3:.1f} ms" if ev.median_s else ev.status
            pred = f" (predicted {ev.predicted_s * 1e3:.1f} ms)" if ev.predicted_s else ""
            print(f"  tunekit {ev.role} {ev.description[:80]}: {got}{pred}", flush=True)
        elif isinstance(ev, Notice):
            print(f"  tunekit: {ev.message}", flush=True)

    winner, trials = gb.tunekit_auto(settings, show)
    ran = gb.trials_run(trials)
    dropped = [
        v
        for t in ran
        for v in (((t.result or {}).get("search") or {}).get("trace") or [])
        if v.get("status") == "over cap"
    ]
    return {
        "pick": winner,
        "trials": len(ran),
        "baselines": sum(t.role == "baseline" for t in trials),
        "oom_trials": [describe(t.config) for t in ran if t.status == "oom"],
        "search_variants_over_cap": len(dropped),
        "rows": [
            {
                "role": t.role,
                "config": describe(t.config),
                "status": t.status,
                "predicted_s": t.predicted_s,
                "median_s": t.median_s,
            }
            for t in trials
        ],
    }


def bench(name: str, args, root: Path) -> dict:
    spec, cap = JOBS[name]
    print(f"{name}: {spec} under a {cap / gb.MiB:.0f} MiB cap", flush=True)
    trials = gb.Trials(spec, args, root / name, cap, describe)
    results = gb.run_grid(trials, grid(spec, args.quick))
    best = gb.best_of(results)
    best_ddp = gb.best_of([r for r in results if strategy_of(r["config"]) == "ddp"])

    auto = tunekit_pick(spec, cap, root / name, args)
    arms = [("baseline", gb.BASELINE), ("grid", best["config"] if best else gb.BASELINE)]
    arms.append(("tunekit", auto["pick"]))
    if best_ddp is not None:
        arms.append(("ddp", best_ddp["config"]))
    final = gb.side_by_side(trials, arms, args.final_rounds)
    ratio, ci = gb.ratio_with_interval(final["grid"], final["tunekit"])  # > 1: tunekit is faster
    return {
        "workload": spec,
        "cap_bytes": cap,
        "grid": results,
        "grid_trials": len(results),
        "grid_oom": sum(r["status"] == "oom" for r in results),
        "grid_best": best["config"] if best else None,
        "grid_best_vs_baseline": best["speedup"] if best else None,
        "best_ddp": best_ddp["config"] if best_ddp else None,
        "grid_best_vs_best_ddp": gb.versus(final, "ddp", "grid"),
        "tunekit": auto,
        "tunekit_vs_grid": ratio,
        "tunekit_vs_grid_interval": ci,
        "final_tunekit_vs_baseline": gb.versus(final, "baseline", "tunekit"),
    }


def markdown(results: dict, command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| job | cap | grid best | vs best DDP that fits | tunekit's pick | tunekit vs grid best "
        "(95% interval) | tunekit trials / grid trials | OOM trials: tunekit, grid |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        t = r["tunekit"]
        share = t["trials"] / r["grid_trials"] if r["grid_trials"] else 0.0
        ddp = describe(r["best_ddp"]) if r["best_ddp"] else "none fits"
        tk_oom = len(t["oom_trials"]) + t["search_variants_over_cap"]
        lines.append(
            f"| {name} | {r['cap_bytes'] / gb.MiB:.0f} MiB | {describe(r['grid_best'])} | "
            f"{gb.times(r['grid_best_vs_best_ddp'])} ({ddp}) | {describe(t['pick'])} | "
            f"{gb.times(r['tunekit_vs_grid'])}{gb.interval(r['tunekit_vs_grid_interval'])} | "
            f"{t['trials']}/{r['grid_trials']} ({share:.0%}; +{t['baselines']} baseline runs) | "
            f"{tk_oom}, {r['grid_oom']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default=",".join(JOBS))
    gb.trial_arguments(ap, steps=8, warmup=3, timeout=600.0)
    ap.add_argument(
        "--plugins",
        type=lambda v: None if v == "all" else [p.strip() for p in v.split(",") if p.strip()],
        default=None,
        help="tuners tunekit auto uses (comma-separated; default: all)",
    )
    ap.add_argument("--quick", action="store_true", help="a third of the grid (a smoke run)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "sharding_vs_grid")
    args = ap.parse_args()
    names = gb.chosen(args.jobs, JOBS, "job(s)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="tunekit-sharding-grid-") as tmp:
        for name in names:
            results[name] = bench(name, args, Path(tmp))
    command = "python benchmarks/sharding_vs_grid.py " + " ".join(sys.argv[1:])
    gb.write_results(args.out, "sharding_vs_grid", results, markdown(results, command.strip()))


if __name__ == "__main__":
    main()
