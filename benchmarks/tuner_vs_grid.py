"""tunekit's pick against an exhaustive grid over a coarse knob space of all tuners.

    .venv/bin/python benchmarks/tuner_vs_grid.py [--workloads cnn,resnet,transformer]
        [--steps 10] [--warmup 2] [--final-rounds 2] [--out benchmarks/results/tuner_vs_grid]

Per workload, on 2 gloo ranks:

1. **The grid**: every config of the coarse space below runs as a real trial
   (``tunekit.trials.launcher``), interleaved with a baseline run after every
   three; configs are compared per sample against the pooled baseline with the
   same hierarchical bootstrap ``tunekit auto`` decides with. The space is
   exhaustive over the tuners' aspects, as ``tunekit auto`` can combine them:
   every batch × every gradient-sync setting or placement (a placement replaces
   DDP's gradient sync, so the two never meet), the workload's own batch with
   DDP's defaults being the baseline.

   ============================  =================================================
   batch (batch_ps_sizing)       the workload's, 1/2, 2 and 4 times it (in range)
   gradient sync, one of         DDP's 25 MB buckets (the default);
                                 overlap_chunking bucket_cap_mb 1, 100;
                                 two_chunk k = 2, 8 with f = 0;
                                 cgdp chunk_size 1, 4
   or a placement, one of        layer_split owt (one weird trick);
                                 hybrid_mp mp_degree 2 (placement planned in the trial)
   ============================  =================================================

   With a batch range of four batches that is 4 × 9 − 1 = 35 configs.

2. **tunekit**: ``tunekit auto`` with its default budget (3 candidate trials,
   feedback on) through the Python API; its pick and its trial count.
3. **Side by side**: the baseline, the grid's best and tunekit's pick, run
   again in ``--final-rounds`` interleaved rounds, so the two picks are
   compared in one run on the same machine state.

It prints the grid's best against the baseline, tunekit's pick against the
grid's best (throughput ratio with its 95% bootstrap interval; within 5% is the
target), the baseline's final rounds against each other (the noise floor a 5%
criterion must clear), and tunekit's trials as a share of the grid's (at most
25% is the target).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from pathlib import Path

from tunekit.config import TuningConfig
from tunekit.orchestrator import AutoSettings, run_auto
from tunekit.store import Store
from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync
from tunekit.trials.stats import compare_runs, ranks_global_batch
from tunekit.workload import load_workload, resolve_spec

HERE = Path(__file__).resolve().parent
WORKLOADS = {
    "cnn": "example:cnn",
    "resnet": f"{HERE / 'workloads.py'}:resnet",
    "transformer": f"{HERE / 'workloads.py'}:transformer_lm",
    "lstm": "example:lstm",
}


def grid(spec: str) -> list[dict]:
    """The coarse knob space of every tuner (see the module docstring), exhaustively, as configs."""
    w = load_workload(spec)
    batches: list[int | None] = [None]  # None: the workload's own
    if w.batch_range is not None:
        lo, hi = w.batch_range
        batches += sorted(
            {b for b in (w.batch_size // 2, 2 * w.batch_size, 4 * w.batch_size) if lo <= b <= hi}
        )
    sync = [None]  # None: DDP's defaults
    sync += [{"overlap_chunking": {"bucket_cap_mb": mb}} for mb in (1.0, 100.0)]
    sync += [{"overlap_chunking": {"mode": "two_chunk", "k": k, "f": 0}} for k in (2, 8)]
    sync += [{"cgdp": {"chunk_size": k}} for k in (1, 4)]
    placements = [{"layer_split": {"plan": "owt"}}, {"hybrid_mp": {"mp_degree": 2}}]
    configs = []
    for b in batches:
        for knob in sync + placements:
            plugins = {"batch_ps_sizing": {"batch_size": b}} if b is not None else {}
            plugins.update(knob or {})
            if plugins:  # the baseline runs on its own, between every three
                configs.append({"plugins": plugins})
    return configs


class Session:
    """Trials of one workload, each recorded with its per-sample step times."""

    def __init__(self, spec: str, args, root: Path):
        self.spec, self.args, self.root = resolve_spec(spec), args, root
        self.opts = LaunchOptions(nproc=2, timeout_s=args.timeout)
        self.count = 0
        self.baselines: list[list[float]] = []

    def run(self, config: dict) -> dict:
        self.count += 1
        out = run_trial_sync(
            TrialSpec(self.spec, config, warmup=self.args.warmup, steps=self.args.steps),
            self.opts,
            self.root / f"trial{self.count:03d}",
        )
        row = {"config": config, "status": out.status, "error": out.error[:200]}
        if out.ok and out.measurement is not None:
            batch = ranks_global_batch(out.ranks)
            row["per_sample"] = [s / batch for s in out.measurement.step_s]
            row["median_s"] = out.measurement.median_s
        label = TuningConfig.from_dict(config).describe() if config.get("plugins") else "baseline"
        shown = f"{row['median_s'] * 1e3:.1f} ms/step" if "median_s" in row else out.status
        print(f"  {label[:80]}: {shown}", flush=True)
        return row

    def baseline(self) -> None:
        row = self.run({"plugins": {}})
        if "per_sample" in row:
            self.baselines.append(row["per_sample"])


def speedup(baselines: list[list[float]], runs: list[list[float]]) -> float:
    return compare_runs(baselines, runs, n_boot=500).speedup


def tunekit_pick(spec: str, root: Path, args) -> tuple[dict, int]:
    """``tunekit auto`` with its default budget: the winning config and its candidate trials."""
    settings = AutoSettings(
        workload=spec,
        nproc=2,
        steps=args.steps,
        warmup=args.warmup,
        out_dir=root / "auto-out",
        store_dir=root / "auto-store",
    )

    async def drive() -> None:
        async for _ in run_auto(settings):
            pass

    asyncio.run(drive())
    store = Store.open_default(settings.store_dir)
    try:
        study = store.latest_study()
        trials = store.trials(study.id)
        winner = (study.decision or {}).get("winner_config") or {"plugins": {}}
    finally:
        store.close()
    ran = [t for t in trials if t.role != "baseline" and t.status not in ("pending", "skipped")]
    return winner, len(ran)


def bench(name: str, spec: str, args, root: Path) -> dict:
    print(f"{name}: {spec}", flush=True)
    s = Session(spec, args, root / name)
    s.baseline()
    results = []
    configs = grid(spec)
    random.Random(0).shuffle(configs)  # so a drift of the machine does not follow one knob
    for i, config in enumerate(configs, 1):
        results.append(s.run(config))
        if i % 3 == 0:
            s.baseline()
    s.baseline()
    ok = [r for r in results if "per_sample" in r]
    for r in ok:
        r["speedup"] = speedup(s.baselines, [r["per_sample"]])
    best = max(ok, key=lambda r: r["speedup"], default=None)
    grid_trials = len(results)

    pick, auto_trials = tunekit_pick(spec, root / name, args)
    # Side by side: baseline, the grid's best and tunekit's pick, interleaved.
    final = {"baseline": [], "grid": [], "tunekit": []}
    for _ in range(args.final_rounds):
        for arm, config in (
            ("baseline", {"plugins": {}}),
            ("grid", best["config"] if best else {"plugins": {}}),
            ("tunekit", pick),
        ):
            row = s.run(config)
            if "per_sample" in row:
                final[arm].append(row["per_sample"])
    ratio = interval = self_ratio = None
    if final["grid"] and final["tunekit"]:
        cmp = compare_runs(final["grid"], final["tunekit"], n_boot=500)  # > 1: tunekit is faster
        ratio, interval = cmp.speedup, (cmp.ci_low, cmp.ci_high)
    if len(final["baseline"]) >= 2:  # the noise floor: the baseline's rounds against each other
        half = len(final["baseline"]) // 2
        self_ratio = speedup(final["baseline"][:half], final["baseline"][half:])
    return {
        "workload": spec,
        "grid": results,
        "grid_trials": grid_trials,
        "grid_best": best["config"] if best else None,
        "grid_best_speedup": best["speedup"] if best else None,
        "tunekit_pick": pick,
        "tunekit_trials": auto_trials,
        "tunekit_vs_grid": ratio,
        "tunekit_vs_grid_interval": interval,
        "baseline_vs_itself": self_ratio,
        "final_grid_vs_baseline": speedup(final["baseline"], final["grid"])
        if final["grid"] and final["baseline"]
        else None,
        "final_tunekit_vs_baseline": (
            speedup(final["baseline"], final["tunekit"])
            if final["tunekit"] and final["baseline"]
            else None
        ),
    }


def markdown(results: dict, command: str) -> str:
    def x(v):
        return "—" if v is None else f"{v:.2f}x"

    def ci(v):
        return "" if not v else f" ({v[0]:.2f}-{v[1]:.2f})"

    lines = [
        f"`{command}`",
        "",
        "| workload | grid best | grid best vs baseline | tunekit's pick | tunekit vs grid best "
        "(95% interval) | baseline vs itself | tunekit trials / grid trials |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():

        def desc(cfg):
            return (
                TuningConfig.from_dict(cfg).describe() if cfg and cfg.get("plugins") else "baseline"
            )

        share = r["tunekit_trials"] / r["grid_trials"]
        lines.append(
            f"| {name} | {desc(r['grid_best'])} | {x(r['final_grid_vs_baseline'])} | "
            f"{desc(r['tunekit_pick'])} | {x(r['tunekit_vs_grid'])}{ci(r.get('tunekit_vs_grid_interval'))} | "
            f"{x(r.get('baseline_vs_itself'))} | "
            f"{r['tunekit_trials']}/{r['grid_trials']} ({share:.0%}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="cnn,resnet,transformer")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--final-rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "tuner_vs_grid")
    args = ap.parse_args()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(
            f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}"
        )
    results = {}
    with tempfile.TemporaryDirectory(prefix="tunekit-grid-") as tmp:
        for name in names:
            results[name] = bench(name, WORKLOADS[name], args, Path(tmp))
    command = (
        f"python benchmarks/tuner_vs_grid.py --workloads {','.join(names)} --steps {args.steps} "
        f"--warmup {args.warmup} --final-rounds {args.final_rounds}"
    )
    text = markdown(results, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tuner_vs_grid.json").write_text(json.dumps(results, indent=2, default=str))
    (args.out / "tuner_vs_grid.md").write_text(text)
    print(text)
    print(
        "median tunekit/grid ratio:",
        statistics.median(r["tunekit_vs_grid"] or 0 for r in results.values()),
    )


if __name__ == "__main__":
    main()
