"""The report as plain data, rebuilt from the study store."""

from __future__ import annotations

import shlex
import statistics
from collections.abc import Mapping
from typing import Any

from tunekit.config import TuningConfig
from tunekit.contract import Candidate, Tuner
from tunekit.diagnosis_text import body_points, outcomes
from tunekit.store import Store
from tunekit.trials.decide import decide
from tunekit.trials.feedback import measured_peak, predicted_peaks, relative_error
from tunekit.trials.launcher import LaunchOptions
from tunekit.trials.stats import ranks_global_batch


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
    planned = _planned_candidates(obs)
    job_batch = (obs.get("summary") or {}).get("global_batch")
    rows = []
    for t in trials:
        m = (t.result or {}).get("measurement") or {}
        ranks = (t.result or {}).get("ranks") or []
        rs = [r["overlap_R"] for r in ranks if r.get("overlap_R") is not None]
        candidate = planned.get(t.config_id, {})
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
                "global_batch": _global_batch(ranks, t.role, candidate, job_batch),
                "rationale": candidate.get("rationale", ""),
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
    diagnoses = obs.get("diagnoses", {})
    verdicts = outcomes(diagnoses, decision)
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
        "diagnoses": {
            name: {**d, "headline": o.headline, "points": body_points(d.get("summary", ""))}
            for (name, d), o in zip(diagnoses.items(), verdicts, strict=True)
        },
        "tuners": [o.to_dict() for o in verdicts],
        "problems": obs.get("problems", []),
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
            training=summary.get("training"),
        ),
        "explanation": explanation(decision, obs.get("plans", {}), tuners),
        "timings": obs.get("timings", []),
    }


def _planned_candidates(obs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each planned candidate by config id: its rationale and the global batch it trains
    (the pool lists a tuner's candidates in the order of its plan)."""
    out: dict[str, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    plans = obs.get("plans", {})
    for entry in obs.get("pool", []):
        plugin = entry["plugin"]
        i = seen[plugin] = seen.get(plugin, -1) + 1
        cands = plans.get(plugin, [])
        out.setdefault(
            entry["config_id"],
            {
                "config_id": entry["config_id"],
                "rationale": cands[i].get("rationale", "") if i < len(cands) else "",
                "global_batch": entry.get("global_batch"),
            },
        )
    return out


def _global_batch(
    ranks: list[dict[str, Any]], role: str, candidate: dict[str, Any], job_batch: int | None
) -> int | None:
    """Samples one step of a trial trains over all ranks: as its ranks reported it, else as
    its candidate was planned (None there: the job's own)."""
    if ranks:
        return ranks_global_batch(ranks)
    if candidate:
        return candidate.get("global_batch") or job_batch
    return job_batch if role == "baseline" else None


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
    training: Mapping[str, Any] | None = None,
) -> str:
    """Ready-to-use instructions for the winning config, as Markdown; the commands name
    the config file by ``config_path`` (a path that works from where tunekit ran).
    ``training``: the workload's :func:`~tunekit.workload.prepare_arguments`, from which the
    ``tunekit.prepare(...)`` call is written so that it trains the job that was tuned."""
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
        lines += [
            "`tunekit.prepare` applies the config to your model, optimizer and loss, and gives you "
            "a `step` that trains exactly as `tunekit run` would (see docs/workloads.md, "
            '"Your own training loop"):',
            "",
            "```python",
            "import tunekit",
            "",
            *prepare_call(config_path, batch_size, training),
            "for inputs, targets in loader:  # a loader of step.batch_size samples per rank",
            "    loss = step(inputs, targets)",
            "```",
            "",
        ]
        if code:
            lines += ["Or, in plain PyTorch without tunekit:", "", "```python", *code, "```", ""]
    lines += ["Launch it as before:", "", "```sh", torchrun, "```", ""]
    return "\n".join(lines)


def prepare_call(
    config_path: str, batch_size: int | None, training: Mapping[str, Any] | None
) -> list[str]:
    """``tunekit.prepare(...)`` with every argument that makes it train as the tuned workload:
    its batch, learning-rate rule, precision, accumulation, scheduler and clipping. Each is
    written out, the defaults too, so the call does not lean on ``prepare``'s defaults (which
    are not the workload's: ``lr_scaling`` is linear there, sqrt for a Hugging Face workload);
    a sharded or checkpointed workload's layout fields follow (plain DDP's are left out)."""
    batch = batch_size or (training or {}).get("batch_size") or "YOUR_PER_RANK_BATCH"
    if not training:  # a study stored before the workload's training facts were kept
        return [
            "model, optimizer, step = tunekit.prepare(",
            f'    model, optimizer, loss_fn, config="{config_path}", batch_size={batch}',
            ")",
        ]
    lines = []
    if training.get("lr") is not None:
        lines.append(
            f"# optimizer: built with lr={training['lr']!r}, the workload's at batch {batch} "
            "(prepare rescales it by lr_scaling when the config changes the batch)"
        )
    scheduler = training.get("scheduler")
    if scheduler is None:
        sched = "None,"
    elif scheduler.isidentifier():
        sched = f"{scheduler}(optimizer),  # the workload's scheduler, on this optimizer"
    else:
        sched = "scheduler,  # what the workload's scheduler factory builds on this optimizer"
    clip = training.get("clip_grad_norm")
    lines += [
        "model, optimizer, step = tunekit.prepare(",
        "    model,",
        "    optimizer,",
        "    loss_fn,",
        f'    config="{config_path}",',
        f"    batch_size={batch},",
        f'    lr_scaling="{training.get("lr_scaling", "linear")}",',
        f'    precision="{training.get("precision", "fp32")}",',
        f"    accumulation={int(training.get('accumulation') or 1)},",
        f"    clip_grad_norm={clip!r},",
        *(
            f"    {name}={_literal(value)},"
            for name, value in (training.get("layout") or {}).items()
        ),
        f"    scheduler={sched}",
        ")",
    ]
    return lines


def _literal(value: Any) -> str:
    """A layout field as Python source (``checkpoint_blocks``, a list in JSON, as the tuple
    ``prepare`` takes)."""
    return repr(tuple(value)) if isinstance(value, list) else repr(value)
