"""How well batch_ps_sizing predicts the step time of the batches it proposes.

    .venv/bin/python benchmarks/batch_ps_sizing_predictions.py [--workloads cnn,resnet,lstm,transformer,alexnet]
        [--top 3] [--steps 10] [--warmup 2] [--out benchmarks/results/batch_ps_sizing_predictions]

Per workload of the prediction corpus, on 2 gloo ranks, as ``tunekit auto``
does it but with nothing re-ranked or dropped: the baseline trial is measured
and profiled (``obs.truth``), the tuner diagnoses and plans, and its top
``--top`` candidates run as real trials in plan order, each followed by a
baseline re-run. ``alexnet`` runs 6 measured steps (seconds per step here).

Printed, and written to ``OUT/predictions.json`` and ``OUT/predictions.md``:

* per candidate: predicted and measured step, the error |predicted - measured| /
  measured, and the *drift-corrected* error, with the measured step taken
  against the mean of the baselines run right before and after it (the
  machine's load drifts during a study; what is left is the model's own error);
* the median error, raw and drift-corrected, and the Spearman rank correlation
  of predicted against measured change (a step over its study's baseline);
* the noise floor: how far each study's first baseline misses its own re-runs.
  No prediction made from that baseline can be expected to do better.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from scipy.stats import spearmanr

from tunekit.config import TuningConfig
from tunekit.observe.breakdown import analyze_trial
from tunekit.observe.static import observe_static
from tunekit.orchestrator import PROFILE_STEPS
from tunekit.plugins.batch_ps_sizing.plugin import BatchPsSizing
from tunekit.store import Store
from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial
from tunekit.workload import resolve_spec

HERE = Path(__file__).resolve().parent
CORPUS = {
    "cnn": ("example:cnn", None),
    "resnet": (f"{HERE / 'workloads.py'}:resnet", None),
    "lstm": ("example:lstm", None),
    "transformer": (f"{HERE / 'workloads.py'}:transformer_lm", None),
    "alexnet": ("example:alexnet", 6),
}


def trial(spec: str, knobs: dict, steps: int, warmup: int, trial_dir: Path, profile: int = 0):
    """One 2-rank trial; its measurement (None if it failed or hung)."""
    config = TuningConfig({"batch_ps_sizing": knobs} if knobs else {}).to_dict()
    ts = TrialSpec(workload=spec, config=config, warmup=warmup, steps=steps, profile_steps=profile)
    out = asyncio.run(run_trial(ts, LaunchOptions(nproc=2), trial_dir.resolve()))
    m = out.measurement
    shown = f"{m.median_s * 1e3:.1f} ms" if m else f"{out.status}: {out.error[:120]}"
    print(f"    {trial_dir.name}: {shown}", flush=True)
    return m


def study(name: str, args, root: Path) -> dict:
    spec, steps = CORPUS[name]
    spec, steps = resolve_spec(spec), steps or args.steps
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    store = Store.open_default(root / "store")
    static = observe_static(spec, 2, "cpu", None, store, 0, None, True, False)
    base_dir = root / "trials" / "000-baseline"
    baseline = trial(spec, {}, steps, args.warmup, base_dir, PROFILE_STEPS)
    if baseline is None:
        raise SystemExit(f"{name}: the baseline trial failed")
    obs = static.observation(2, baseline, store)
    obs.breakdown = analyze_trial(base_dir.resolve())
    tuner = BatchPsSizing()
    plan_start = time.monotonic()
    diagnosis = tuner.diagnose(obs)
    candidates = tuner.plan(obs, args.top)
    plan_s = time.monotonic() - plan_start
    print(f"  {name} ({plan_s:.0f} s to plan): {diagnosis.summary}", flush=True)
    baselines = [baseline.median_s]
    rows = []
    for i, cand in enumerate(candidates, start=1):
        batch = cand.knobs["batch_size"]
        got = trial(
            spec, cand.knobs, steps, args.warmup, root / "trials" / f"{2 * i - 1:03d}-batch{batch}"
        )
        again = trial(spec, {}, steps, args.warmup, root / "trials" / f"{2 * i:03d}-baseline")
        baselines.append(again.median_s if again else None)
        rows.append(
            {
                "batch": batch,
                "predicted_s": cand.predicted_step_s,
                "range_s": list(cand.predicted_range_s) if cand.predicted_range_s else None,
                "measured_s": got.median_s if got else None,
                "baselines_around_s": [b for b in baselines[-2:] if b],
                "rationale": cand.rationale,
            }
        )
    store.close()
    return {
        "workload": spec,
        "baseline_s": baseline.median_s,
        "baselines_s": baselines,
        "truth": obs.truth.describe(),
        "diagnosis": diagnosis.summary,
        "plan_s": plan_s,
        "wall_s": time.monotonic() - start,
        "candidates": rows,
    }


def summarise(studies: dict[str, dict]) -> dict:
    points, floor = [], []
    for name, st in studies.items():
        base = st["baseline_s"]
        floor += [abs(base - b) / b for b in st["baselines_s"][1:] if b]
        for c in st["candidates"]:
            if not c["measured_s"] or not c["predicted_s"]:
                continue
            around = statistics.mean(c["baselines_around_s"])
            change_measured = c["measured_s"] / base
            change_local = c["measured_s"] / around
            change_predicted = c["predicted_s"] / base
            points.append(
                {
                    "workload": name,
                    "batch": c["batch"],
                    "error": abs(c["predicted_s"] - c["measured_s"]) / c["measured_s"],
                    "drift_corrected_error": abs(change_predicted - change_local) / change_local,
                    "predicted_change": change_predicted,
                    "measured_change": change_measured,
                    "in_range": bool(
                        c["range_s"] and c["range_s"][0] <= c["measured_s"] <= c["range_s"][1]
                    ),
                }
            )
    rho = None
    if len(points) >= 3:
        rho = float(
            spearmanr(
                [p["predicted_change"] for p in points], [p["measured_change"] for p in points]
            )[0]
        )
    return {
        "trials": len(points),
        "median_error": statistics.median(p["error"] for p in points) if points else None,
        "median_drift_corrected_error": (
            statistics.median(p["drift_corrected_error"] for p in points) if points else None
        ),
        "spearman": rho,
        "in_range": sum(p["in_range"] for p in points),
        "noise_floor": statistics.median(floor) if floor else None,
        "points": points,
    }


def markdown(summary: dict, studies: dict[str, dict], command: str) -> str:
    def pct(x):
        return "—" if x is None else f"{x:.0%}"

    lines = [
        f"`{command}`",
        "",
        "| workload | batch | predicted | measured | error | drift-corrected |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    by_key = {(p["workload"], p["batch"]): p for p in summary["points"]}
    for name, st in studies.items():
        for c in st["candidates"]:
            p = by_key.get((name, c["batch"]))
            measured = f"{c['measured_s'] * 1e3:,.0f} ms" if c["measured_s"] else "failed"
            lines.append(
                f"| {name} | {c['batch']} | {c['predicted_s'] * 1e3:,.0f} ms | {measured} | "
                f"{pct(p and p['error'])} | {pct(p and p['drift_corrected_error'])} |"
            )
    rho = "—" if summary["spearman"] is None else f"{summary['spearman']:.2f}"
    lines += [
        "",
        f"Median error {pct(summary['median_error'])}, drift-corrected "
        f"{pct(summary['median_drift_corrected_error'])}; Spearman {rho}; measured within the "
        f"predicted range {summary['in_range']}/{summary['trials']}; noise floor (first baseline "
        f"against its re-runs) {pct(summary['noise_floor'])}.",
        "",
        "| workload | baselines | plan | wall |",
        "| --- | --- | --- | --- |",
    ]
    for name, st in studies.items():
        shown = ", ".join(f"{b * 1e3:,.0f}" for b in st["baselines_s"] if b)
        lines.append(f"| {name} | {shown} ms | {st['plan_s']:.0f} s | {st['wall_s']:.0f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(CORPUS))
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "batch_ps_sizing_predictions")
    args = ap.parse_args()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [n for n in names if n not in CORPUS]
    if unknown:
        raise SystemExit(
            f"unknown workload(s) {', '.join(unknown)}; the corpus is {', '.join(CORPUS)}"
        )
    studies = {}
    for name in names:
        print(f"{name}: {CORPUS[name][0]}", flush=True)
        studies[name] = study(name, args, args.out / name)
    summary = summarise(studies)
    command = (
        f"python benchmarks/batch_ps_sizing_predictions.py --workloads {','.join(names)} "
        f"--top {args.top} --steps {args.steps} --warmup {args.warmup}"
    )
    text = markdown(summary, studies, command)
    (args.out / "predictions.json").write_text(
        json.dumps({"summary": summary, "studies": studies}, indent=2)
    )
    (args.out / "predictions.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
