"""How good are tunekit's predictions: every tuner's top candidates, predicted vs measured.

    .venv/bin/python benchmarks/prediction_error.py [--workloads cnn,alexnet,resnet,lstm,transformer,
        gpt-sharded,gpt-small-sharded,gpt-small]
        [--plugins cgdp,...] [--top 3] [--steps 10] [--warmup 2] [--out benchmarks/results/prediction_error]

For each workload of the corpus, one study on 2 gloo ranks (``tunekit auto``'s
pipeline through its Python API): the baseline is measured and profiled, every
tuner diagnoses and plans, and every applicable tuner's top ``--top``
candidates run as real trials in plan order, interleaved with baseline runs
(``AutoSettings(rerank=False)``: nothing is dropped or re-ordered, so every
prediction meets its measurement). In-job searches are left out: they carry no
prediction. The sharded and checkpointed workloads (``gpt-sharded``, ``gpt-small-sharded``)
and a replicated one near its bound (``gpt-small``) bring the ``sharding`` tuner in; the
small GPT's two run under sharding_vs_grid.py's ``--memory-cap``. Beside step times, the
peak memory per rank each trial's tuner predicted is compared with the measured one.

Per tuner and overall it prints:

* the median relative error |predicted − measured| / measured of the raw
  predictions (the tuners' calibrated models) and of the corrected ones (each
  trial's prediction as corrected by the same tuner's earlier trials in its
  study: the feedback of ``tunekit.trials.feedback``, as it stood when the
  trial ran);
* the Spearman rank correlation of predicted against measured change, where a
  change is a step time over its study's baseline (so workloads of different
  speed are comparable).

Results go to ``OUT/prediction_error.json`` and ``OUT/prediction_error.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from scipy.stats import spearmanr

from tunekit.events import Notice, PluginProblem, TrialFinished
from tunekit.orchestrator import AutoSettings, run_auto
from tunekit.store import Store
from tunekit.trials.feedback import measured_peak, predicted_peaks, relative_error

HERE = Path(__file__).resolve().parent
CORPUS = {
    "cnn": "example:cnn",
    "alexnet": "example:alexnet",
    "resnet": f"{HERE / 'workloads.py'}:resnet",
    "lstm": "example:lstm",
    "transformer": f"{HERE / 'workloads.py'}:transformer_lm",
    # Sharded and checkpointed jobs (the sharding tuner; every tuner says what it does there).
    "gpt-sharded": "example:gpt-sharded",
    "gpt-small-sharded": "tunekit.plugins.sharding.tests.workloads_sharding:gpt_sharded",
    "gpt-small": "tunekit.plugins.sharding.tests.workloads_sharding:gpt_ddp",
}
MEMORY_CAPS = {"gpt-small-sharded": 44 * 2**20, "gpt-small": 84 * 2**20}
"""Per-rank --memory-cap of the memory-bound jobs (sharding_vs_grid.py's), so the sharding
tuner plans against a bound there; the others run uncapped."""


def run_study(name: str, spec: str, args, root: Path) -> dict:
    """One study of ``spec``; its trials as plain rows."""
    settings = AutoSettings(
        workload=spec,
        nproc=2,
        plugins=args.plugins,
        trials=None,
        plan_limit=args.top,
        rerank=False,
        in_job_search=False,
        steps=args.steps,
        warmup=args.warmup,
        out_dir=root / name / "out",
        store_dir=root / name / "store",
        memory_cap_bytes=MEMORY_CAPS.get(name),
    )

    async def drive() -> None:
        async for ev in run_auto(settings):
            if isinstance(ev, TrialFinished):
                pred = f" predicted {ev.predicted_s * 1e3:.1f} ms" if ev.predicted_s else ""
                got = f"{ev.median_s * 1e3:.1f} ms" if ev.median_s else ev.status
                print(f"  {name}: {ev.role} {ev.description[:70]}: {got}{pred}", flush=True)
            elif isinstance(ev, Notice | PluginProblem):
                print(
                    f"  {name}: {getattr(ev, 'message', '') or getattr(ev, 'error', '')}",
                    flush=True,
                )

    start = time.monotonic()
    asyncio.run(drive())
    store = Store.open_default(settings.store_dir)
    try:
        study = store.latest_study()
        trials = store.trials(study.id)
        diagnoses = (study.observation or {}).get("diagnoses", {})
        peaks = predicted_peaks(study.observation or {})
    finally:
        store.close()
    base = [t.median_s for t in trials if t.role == "baseline" and t.status == "ok"]
    base_runs = [(t.seq, t.median_s) for t in trials if t.role == "baseline" and t.status == "ok"]
    rows = []
    for t in trials:
        if t.role not in ("candidate", "confirm"):
            continue
        earlier = [
            u
            for u in trials
            if u.plugin == t.plugin
            and u.seq < t.seq
            and u.status == "ok"
            and u.role in ("candidate", "confirm")
            and u.predicted_s
        ]
        rows.append(
            {
                "plugin": t.plugin,
                "role": t.role,
                "config": t.config,
                "status": t.status,
                "predicted_s": t.predicted_s,
                "corrected_s": t.corrected_s,
                "measured_s": t.median_s,
                "had_feedback": bool(earlier),
                "load": load_factor(t.seq, base_runs),
                "predicted_peak_bytes": peaks.get(t.config_id),
                "measured_peak_bytes": measured_peak(t.result),
            }
        )
    return {
        "workload": spec,
        "baseline_s": statistics.median(base),
        "baseline_runs": len(base),
        "drift": max(base) / min(base),
        "applies": {n: d["applies"] for n, d in diagnoses.items()},
        "trials": rows,
        "wall_s": time.monotonic() - start,
    }


def load_factor(seq: int, base_runs: list[tuple[int, float]]) -> float | None:
    """How much slower the machine ran around trial ``seq`` than for the first baseline: the
    mean of the baseline runs just before and after it, over the first. The predictions are
    made against the first baseline, so on a machine whose load drifts, ``predicted × load``
    separates the model's error from the drift (reported beside the plain error)."""
    if not base_runs:
        return None
    before = [m for s, m in base_runs if s < seq][-1:]
    after = [m for s, m in base_runs if s > seq][:1]
    near = before + after
    return statistics.mean(near) / base_runs[0][1] if near else None


def summarise(studies: dict[str, dict]) -> dict:
    """Per tuner and overall: median raw and corrected error, Spearman of the changes."""
    points: dict[str, list[dict]] = {}
    peaks: dict[str, list[float]] = {}
    for wl, st in studies.items():
        for r in st["trials"]:
            if r.get("predicted_peak_bytes") and r.get("measured_peak_bytes"):
                # signed: below 0 the model under-predicted (a candidate that could run out)
                peaks.setdefault(r["plugin"], []).append(
                    r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
                )
            if r["status"] != "ok" or not r["predicted_s"] or not r["measured_s"]:
                continue
            points.setdefault(r["plugin"], []).append(
                {
                    "workload": wl,
                    "raw": relative_error(r["predicted_s"], r["measured_s"]),
                    "at_load": relative_error(r["predicted_s"] * r["load"], r["measured_s"])
                    if r.get("load")
                    else None,
                    "corrected": relative_error(r["corrected_s"], r["measured_s"]),
                    "had_feedback": r["had_feedback"],
                    "predicted_change": r["predicted_s"] / st["baseline_s"],
                    "measured_change": r["measured_s"] / st["baseline_s"],
                }
            )

    def stats(ps: list[dict], memory: list[float]) -> dict:
        corrected = [p["corrected"] for p in ps if p["corrected"] is not None]
        fed = [p for p in ps if p["had_feedback"] and p["corrected"] is not None]
        rho = None
        if len(ps) >= 3:
            rho = float(
                spearmanr([p["predicted_change"] for p in ps], [p["measured_change"] for p in ps])[
                    0
                ]
            )
        return {
            "trials": len(ps),
            "workloads": sorted({p["workload"] for p in ps}),
            "median_error": statistics.median(p["raw"] for p in ps) if ps else None,
            "median_error_at_load": (
                statistics.median(x)
                if (x := [p["at_load"] for p in ps if p["at_load"] is not None])
                else None
            ),
            "median_corrected_error": statistics.median(corrected) if corrected else None,
            "with_feedback": len(fed),
            "median_error_with_feedback_raw": statistics.median(p["raw"] for p in fed)
            if fed
            else None,
            "median_error_with_feedback_corrected": statistics.median(p["corrected"] for p in fed)
            if fed
            else None,
            "spearman": rho,
            "peak_trials": len(memory),
            "median_peak_error": statistics.median(abs(m) for m in memory) if memory else None,
            "worst_peak_under_prediction": min(memory) if memory else None,
        }

    out = {name: stats(ps, peaks.get(name, [])) for name, ps in sorted(points.items())}
    out["overall"] = stats(
        [p for ps in points.values() for p in ps], [m for ms in peaks.values() for m in ms]
    )
    return out


def markdown(summary: dict, studies: dict[str, dict], command: str) -> str:
    def pct(x):
        return "—" if x is None else f"{x:.0%}"

    lines = [
        f"`{command}`",
        "",
        "Median |predicted − measured| / measured. *After feedback*: every trial's prediction as "
        "corrected by its tuner's earlier trials in the study (a tuner's first trial has none); "
        "*trials with feedback*: only the trials that had an earlier one, raw → corrected.",
        "",
        "*At the trial's load*: the raw prediction scaled by how much slower the baseline runs "
        "beside the trial were than the first (the machine's drift, not the model's error).",
        "",
        "*Peak memory*: |predicted − measured| / measured peak per rank of the trials whose "
        "tuner predicted one (the core memory model), and the worst under-prediction.",
        "",
        "| tuner | trials | workloads | median error (raw) | at the trial's load | after feedback | "
        "trials with feedback | Spearman | peak memory: median error, worst under |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in summary.items():
        rho = "—" if s["spearman"] is None else f"{s['spearman']:.2f}"
        fed = (
            f"{s['with_feedback']}: {pct(s['median_error_with_feedback_raw'])} → "
            f"{pct(s['median_error_with_feedback_corrected'])}"
            if s["with_feedback"]
            else "—"
        )
        lines.append(
            f"| {name} | {s['trials']} | {', '.join(s['workloads'])} | {pct(s['median_error'])} | "
            f"{pct(s['median_error_at_load'])} | {pct(s['median_corrected_error'])} | {fed} | {rho} | "
            + (
                f"{pct(s['median_peak_error'])}, {pct(s['worst_peak_under_prediction'])} "
                f"({s['peak_trials']})"
                if s["peak_trials"]
                else "—"
            )
            + " |"
        )
    lines += [
        "",
        "| workload | baseline (median of runs) | baseline runs | drift (slowest/fastest) | trials | wall |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for wl, st in studies.items():
        lines.append(
            f"| {wl} | {st['baseline_s'] * 1e3:.1f} ms | {st['baseline_runs']} | {st['drift']:.2f}x | "
            f"{len(st['trials'])} | {st['wall_s']:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(CORPUS))
    ap.add_argument(
        "--plugins",
        type=lambda v: [p.strip() for p in v.split(",") if p.strip()],
        default=None,
        help="tuners to measure (comma-separated; default: all)",
    )
    ap.add_argument("--top", type=int, default=3, help="candidates per tuner")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "prediction_error")
    args = ap.parse_args()
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [n for n in names if n not in CORPUS]
    if unknown:
        raise SystemExit(
            f"unknown workload(s) {', '.join(unknown)}; the corpus is {', '.join(CORPUS)}"
        )
    studies = {}
    with tempfile.TemporaryDirectory(prefix="tunekit-prediction-") as tmp:
        for name in names:
            print(f"{name}: {CORPUS[name]}", flush=True)
            studies[name] = run_study(name, CORPUS[name], args, Path(tmp))
    summary = summarise(studies)
    command = (
        "python benchmarks/prediction_error.py --workloads "
        + ",".join(names)
        + (f" --plugins {','.join(args.plugins)}" if args.plugins else "")
        + f" --top {args.top} --steps {args.steps} --warmup {args.warmup}"
    )
    text = markdown(summary, studies, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prediction_error.json").write_text(
        json.dumps({"summary": summary, "studies": studies}, indent=2)
    )
    (args.out / "prediction_error.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
