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
target; 1.00x where the pick is the grid's best itself, its knobs' defaults filled
in, with what the two arms of that one config measured against each other beside
it), the baseline's final rounds against each other (the noise floor a 5%
criterion must clear), and tunekit's trials as a share of the grid's (at most
25% is the target).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import grid_bench as gb

from tunekit.orchestrator import AutoSettings
from tunekit.trials.decide import global_batch
from tunekit.workload import load_workload

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


def tunekit_pick(spec: str, root: Path, args) -> tuple[dict, int, list[dict]]:
    """``tunekit auto`` with its default budget: the winning config, its candidate trials and
    every trial of the study (kept in the results, so that a miss can be explained)."""
    settings = AutoSettings(
        workload=spec,
        nproc=2,
        steps=args.steps,
        warmup=args.warmup,
        out_dir=root / "auto-out",
        store_dir=root / "auto-store",
    )
    winner, trials = gb.tunekit_auto(settings)
    study = [
        {
            "seq": t.seq,
            "role": t.role,
            "config": gb.describe(t.config),
            "status": t.status,
            "median_s": t.median_s,
            "global_batch": global_batch(t) if t.result else None,
        }
        for t in trials
    ]
    return winner, len(gb.trials_run(trials)), study


def bench(name: str, spec: str, args, root: Path) -> dict:
    print(f"{name}: {spec}", flush=True)
    s = gb.Trials(spec, args, root / name)
    results = gb.run_grid(s, grid(spec))
    best = gb.best_of(results)

    pick, auto_trials, study = tunekit_pick(spec, root / name, args)
    # Side by side: baseline, the grid's best and tunekit's pick, interleaved.
    final = gb.side_by_side(
        s,
        [
            ("baseline", gb.BASELINE),
            ("grid", best["config"] if best else gb.BASELINE),
            ("tunekit", pick),
        ],
        args.final_rounds,
    )
    ratio, ci = gb.ratio_with_interval(final["grid"], final["tunekit"])  # > 1: tunekit is faster
    # The same config run as two arms: its ratio is the noise of the final rounds, not a gap.
    same = gb.same_config(pick, best["config"] if best else gb.BASELINE)
    self_ratio = None
    if len(final["baseline"]) >= 2:  # the noise floor: the baseline's rounds against each other
        half = len(final["baseline"]) // 2
        self_ratio = gb.speedup(final["baseline"][:half], final["baseline"][half:])
    return {
        "workload": spec,
        "grid": results,
        "grid_trials": len(results),
        "grid_best": best["config"] if best else None,
        "grid_best_speedup": best["speedup"] if best else None,
        "tunekit_pick": pick,
        "tunekit_trials": auto_trials,
        "tunekit_study": study,
        "tunekit_vs_grid": 1.0 if same else ratio,
        "tunekit_vs_grid_interval": ci,
        "same_config": same,
        "measured_tunekit_vs_grid": ratio,
        "baseline_vs_itself": self_ratio,
        "final_grid_vs_baseline": gb.versus(final, "baseline", "grid"),
        "final_tunekit_vs_baseline": gb.versus(final, "baseline", "tunekit"),
    }


def pick_vs_grid(r: dict) -> str:
    measured = gb.times(r.get("measured_tunekit_vs_grid", r["tunekit_vs_grid"]))
    measured += gb.interval(r.get("tunekit_vs_grid_interval"), "-")
    if r.get("same_config"):
        return f"1.00x: the grid's best itself (measured {measured} against itself)"
    return measured


def markdown(results: dict, command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| workload | grid best | grid best vs baseline | tunekit's pick | tunekit vs grid best "
        "(95% interval) | baseline vs itself | tunekit trials / grid trials |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        share = r["tunekit_trials"] / r["grid_trials"]
        lines.append(
            f"| {name} | {gb.describe(r['grid_best'])} | {gb.times(r['final_grid_vs_baseline'])} | "
            f"{gb.describe(r['tunekit_pick'])} | {pick_vs_grid(r)} | "
            f"{gb.times(r.get('baseline_vs_itself'))} | "
            f"{r['tunekit_trials']}/{r['grid_trials']} ({share:.0%}) |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="cnn,resnet,transformer")
    gb.trial_arguments(ap, steps=10, warmup=2, timeout=300.0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "tuner_vs_grid")
    args = ap.parse_args()
    names = gb.chosen(args.workloads, WORKLOADS, "workload(s)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="tunekit-grid-") as tmp:
        for name in names:
            results[name] = bench(name, WORKLOADS[name], args, Path(tmp))
    command = (
        f"python benchmarks/tuner_vs_grid.py --workloads {','.join(names)} --steps {args.steps} "
        f"--warmup {args.warmup} --final-rounds {args.final_rounds}"
    )
    gb.write_results(args.out, "tuner_vs_grid", results, markdown(results, command))


if __name__ == "__main__":
    main()
