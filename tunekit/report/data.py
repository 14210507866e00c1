"""The report as plain data, rebuilt from the study store."""

from __future__ import annotations

import shlex
import statistics
from collections.abc import Mapping
from typing import Any

from tunekit.config import TuningConfig
from tunekit.contract import Candidate, Tuner
from tunekit.store import Store
from tunekit.trials.decide import decide
from tunekit.trials.feedback import measured_peak, predicted_peaks, relative_error
from tunekit.trials.launcher import LaunchOptions


def report_data(
    store: Store,
    study_id: int,
    tuners: Mapping[str, Tuner],
    launch: LaunchOptions,
    config_path: str = "best_config.json",
) -> dict[str, Any]:
    """``config_path``: where best_config.json is, as the commands in the snippet should name it."""
    study = store.study(study_id)
    trials = store.trials(study_id)
    defaults = {name: t.defaults() for name, t in tuners.items()}

    def describe(cfg: dict[str, Any]) -> str:
        return TuningConfig.from_dict(cfg).describe(defaults)

    decision = study.decision or decide(trials, study.settings.get("min_effect", 0.01), describe)
    obs = study.observation or {}
    peaks = predicted_peaks(obs)
    rows = []
    for t in trials:
        m = (t.result or {}).get("measurement") or {}
        ranks = (t.result or {}).get("ranks") or []
        rs = [r["overlap_R"] for r in ranks if r.get("overlap_R") is not None]
        rows.append(
            {
                "id": t.id,
                "seq": t.seq,
                "role": t.role,
                "plugin": t.plugin,
                "config": t.config,
                "description": describe(t.config),
                "status": t.status,
                "predicted_s": t.predicted_s,
                "corrected_s": t.corrected_s,
                "prediction_error": relative_error(t.predicted_s, t.median_s),
                "corrected_prediction_error": relative_error(t.corrected_s, t.median_s),
                "median_s": t.median_s,
                "spread_s": t.spread_s,
                "samples_per_s": t.samples_per_s,
                "step_s": m.get("step_s"),
                "overlap_R": sum(rs) / len(rs) if rs else None,
                "error": t.error,
                "wall_s": (t.result or {}).get("wall_s"),
                "predicted_peak_bytes": peaks.get(t.config_id)
                or (peaks.get(f"search:{t.plugin}") if t.role == "search" else None),
                "peak_bytes": measured_peak(t.result),
                **_length_columns(t.result, t.error),
            }
        )
    best = TuningConfig.from_dict(decision.get("winner_config") or {})
    base_rows = [r for r in rows if r["role"] == "baseline" and r["status"] == "ok"]
    summary = obs.get("summary", {})
    base_batch = decision.get("baseline_global_batch") or summary.get("global_batch") or 0
    best_batch = decision.get("winner_global_batch") or base_batch
    base_med = decision.get("baseline_median_s")
    best_med = decision.get("winner_median_s") or base_med
    return {
        "study": {
            "id": study.id,
            "workload": study.workload,
            "status": study.status,
            "nproc": study.nproc,
            "settings": study.settings,
            "graph_hash": study.graph_hash,
            "hardware": study.hw_fingerprint,
            "created": study.created,
            "finished": study.finished,
        },
        "observation": summary,
        "diagnoses": obs.get("diagnoses", {}),
        "plans": obs.get("plans", {}),
        "trials": rows,
        "prediction_errors": prediction_errors(rows),
        "corrections": obs.get("corrections", {}),
        "decision": decision,
        "headline": {
            "baseline_median_s": base_med,
            "best_median_s": best_med,
            "baseline_samples_per_s": base_batch / base_med if base_med else None,
            "best_samples_per_s": best_batch / best_med if best_med else None,
            "speedup": decision.get("speedup"),
            "speedup_ci": decision.get("ci"),
            "baseline_runs": len(base_rows),
        },
        "best_config": {
            **best.to_dict(),
            "workload": study.workload,
            "description": decision.get("winner", "baseline"),
            "measured_median_s": best_med,
            "speedup": decision.get("speedup"),
        },
        "snippet": snippet(
            study.workload,
            best,
            tuners,
            launch,
            (summary.get("batch_size") or 0) or None,
            config_path=config_path,
        ),
        "explanation": explanation(decision, obs.get("plans", {}), tuners),
    }


def prediction_errors(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tuner: median |predicted - measured| / measured of its trials, raw and corrected."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["role"] == "baseline" or r["prediction_error"] is None or not r["plugin"]:
            continue
        entry = out.setdefault(r["plugin"], {"trials": 0, "raw": [], "corrected": []})
        entry["trials"] += 1
        entry["raw"].append(r["prediction_error"])
        if r["corrected_prediction_error"] is not None:
            entry["corrected"].append(r["corrected_prediction_error"])
    for entry in out.values():
        entry["median_error"] = statistics.median(entry.pop("raw"))
        corrected = entry.pop("corrected")
        entry["median_corrected_error"] = statistics.median(corrected) if corrected else None
    return out


def _length_columns(result: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    """The steps a trial was launched with (warm-up + measured) and its note: its error, or why it ran fewer."""
    length = (result or {}).get("length") or {}
    ran = f"{length['warmup']}+{length['steps']}" if length.get("steps") else None
    return {
        "steps_run": ran,
        "length": length or None,
        "note": error or length.get("reason") or None,
    }


def explanation(
    decision: dict[str, Any], plans: dict[str, list], tuners: Mapping[str, Tuner]
) -> str | None:
    """The winning tuner's own account of its candidate (``Tuner.explain``)."""
    winner = decision.get("winner_config") or {}
    for name, knobs in (winner.get("plugins") or {}).items():
        tuner = tuners.get(name)
        if tuner is None:
            continue
        for cand in plans.get(name, []):
            if tuner.validate(cand["knobs"]) == tuner.validate(knobs):
                return tuner.explain(Candidate(**cand))
    return None


def snippet(
    workload: str,
    best: TuningConfig,
    tuners: Mapping[str, Tuner],
    launch: LaunchOptions,
    batch_size: int | None = None,
    config_path: str = "best_config.json",
) -> str:
    """Ready-to-use instructions for the winning config, as Markdown; the commands name
    the config file by ``config_path`` (a path that works from where tunekit ran)."""
    nodes = (
        ["--standalone"]
        if launch.nnodes == 1
        else [
            "--nnodes",
            str(launch.nnodes),
            "--node-rank",
            "$NODE_RANK",
            "--rdzv-backend",
            launch.rdzv_backend,
            "--rdzv-endpoint",
            launch.rdzv_endpoint or "HOST:PORT",
        ]
    )
    torchrun = shlex.join(["torchrun", *nodes, "--nproc-per-node", str(launch.nproc)]) + " train.py"
    lines = [
        "# Best config",
        "",
        f"Workload `{workload}`: **{best.describe({n: t.defaults() for n, t in tuners.items()})}**.",
        "",
        "## With tunekit",
        "",
        "```sh",
        f"tunekit run {shlex.quote(workload)} --nproc {launch.nproc} --config {shlex.quote(config_path)}",
        "```",
        "",
        "or, to a job already running (`tunekit run`), at its next step boundary:",
        "",
        "```sh",
        f"tunekit apply RUN {shlex.quote(config_path)}",
        "```",
        "",
        "## In your own training script",
        "",
    ]
    code = []
    for name, knobs in best.plugins.items():
        tuner = tuners.get(name)
        text = tuner.snippet(tuners[name].validate(knobs)) if tuner else None
        if text:
            code.append(f"# {name}\n{text}")
    if best.is_baseline:
        lines += ["Nothing to change: the baseline (PyTorch's defaults) was fastest.", ""]
    else:
        batch = batch_size if batch_size else "YOUR_PER_RANK_BATCH"
        lines += [
            "`tunekit.prepare` applies the config to your model, optimizer and loss, and gives you "
            "a `step` that trains exactly as `tunekit run` would (see docs/workloads.md):",
            "",
            "```python",
            "import tunekit",
            "",
            "model, optimizer, step = tunekit.prepare(",
            f'    model, optimizer, loss_fn, config="{config_path}", batch_size={batch}',
            ")",
            "for inputs, targets in loader:  # a loader of step.batch_size samples per rank",
            "    loss = step(inputs, targets)",
            "```",
            "",
        ]
        if code:
            lines += ["Or, in plain PyTorch without tunekit:", "", "```python", *code, "```", ""]
    lines += ["Launch it as before:", "", "```sh", torchrun, "```", ""]
    return "\n".join(lines)
