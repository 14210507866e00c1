"""report.md from report data."""

from __future__ import annotations

from typing import Any

from tunekit.memory import format_bytes
from tunekit.observe.truth import PART_LABELS
from tunekit.trials.nodes import describe_slowest


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f} ms"


def render_markdown(data: dict[str, Any], plot_name: str = "trials.png") -> str:
    st, obs, dec, head = data["study"], data["observation"], data["decision"], data["headline"]
    out = [
        f"# tunekit report — study {st['id']}",
        "",
        f"Workload `{st['workload']}` on {obs.get('world_size', st['nproc'])} rank(s) "
        f"({obs.get('backend', '?')}, {obs.get('device', '?')}), hardware `{obs.get('hardware', '?')}`; "
        f"{obs.get('num_params', 0):,} parameters, global batch {obs.get('global_batch', '?')}.",
        "",
        "## Result",
        "",
        "| | median step | samples/s | speed-up |",
        "| --- | --- | --- | --- |",
        f"| baseline | {_ms(head['baseline_median_s'])} | {_num(head['baseline_samples_per_s'])} | 1.00x |",
        f"| best: {dec.get('winner', 'baseline')} | {_ms(head['best_median_s'])} | "
        f"{_num(head['best_samples_per_s'])} | {_speedup(head)} |",
        "",
        f"Decision: {dec.get('reason', '')}. Baseline pooled from {head['baseline_runs']} run(s); "
        f"a winner must beat it by more than {dec.get('min_effect', 0.01):.0%} with 95% confidence.",
        "",
    ]
    out += _problems_section(data.get("problems") or [])
    out += _observation_section(obs)
    out += [
        "## Diagnoses",
        "",
    ]
    if data["diagnoses"]:
        out += [
            "Each tuner's verdict, the gain its model expects (with its range) and the measured "
            "figure it rests on; beside it, the best its own trials measured (samples/s over the "
            "baseline) and what came of it.",
            "",
            "| tuner | diagnosis | measured | outcome |",
            "| --- | --- | --- | --- |",
        ]
        for t in data["tuners"]:
            outcome = "won" if t["won"] and not t["note"] else t["note"] or "—"
            out.append(
                f"| {t['plugin']} | {_cell(t['headline'])} | {t['measured']} | {_cell(outcome)} |"
            )
        out.append("")
        for name, d in data["diagnoses"].items():
            out += [f"### {name}", ""]
            out += [f"- {_cell(p)}" for p in d["points"]] or ["- (no text)"]
            out.append("")
    else:
        out.append("No tuner diagnosed this job.")
    out.append("")
    out += _trials_section(data["trials"])
    out += _prediction_section(data)
    out += [
        "",
        f"![trials]({plot_name})",
        "",
        data["snippet"].replace("# Best config", "## Best config"),
    ]
    if data.get("explanation"):
        out += ["## The winning plan in detail", "", data["explanation"], ""]
    return "\n".join(out) + "\n"


def _trials_section(trials: list[dict[str, Any]]) -> list[str]:
    """Every trial: what it trained (its global batch), each prediction, what was measured
    per step and per sample, and the tuner's reason for it."""
    out = [
        "## Trials",
        "",
        "*Predicted*: the tuner's cost model, calibrated on the measured baseline, per step; "
        "*corrected*: that prediction corrected by the trials that ran before it; *error*: "
        "|prediction − measured| / measured, raw → corrected. A step over a larger global "
        "batch takes longer: compare trials of different batches by *samples/s*. *Peak/rank*: "
        "memory per rank, predicted (core memory model) → measured (the largest rank's).",
        "",
        "| # | role | config | status | steps | global batch | predicted | corrected "
        "| measured (median ± IQR) | samples/s | error | peak/rank | R | why | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    for t in trials:
        measured = "—" if t["median_s"] is None else f"{_ms(t['median_s'])} ± {_ms(t['spread_s'])}"
        r = "—" if t.get("overlap_R") is None else f"{t['overlap_R']:.0f}"
        note = (t.get("note") or "").replace("|", "/")[:200]
        why = (t.get("rationale") or "").replace("|", "/") or "—"
        out.append(
            f"| {t['seq']} | {t['role']} | {t['description']} | {t['status']} | {t.get('steps_run') or '—'} | "
            f"{t.get('global_batch') or '—'} | {_ms(t['predicted_s'])} | "
            f"{_ms(t.get('corrected_s'))} | {measured} | {_num(t.get('samples_per_s'))} | "
            f"{_errors(t)} | {_peaks(t)} | {r} | {why} | {note} |"
        )
    return out


def _problems_section(problems: list[dict[str, Any]]) -> list[str]:
    """Tuners that could not take part (a hook that raised, a plugin that did not load), each
    with its error, where in the plugin it was raised and the traceback."""
    if not problems:
        return []
    out = [
        "## Problems",
        "",
        f"{len(problems)} tuner(s) could not take part in this study; the others ran without them.",
        "",
        "| tuner | what failed | error | where |",
        "| --- | --- | --- | --- |",
    ]
    for p in problems:
        error = p["error"].replace("|", "/").replace("\n", " ")
        out.append(f"| {p['plugin']} | {p['what']} | {error} | {p.get('where') or '—'} |")
    out.append("")
    for p in problems:
        if p.get("traceback"):
            out += [
                f"{p['plugin']} ({p['what']}):",
                "",
                "```text",
                p["traceback"].rstrip(),
                "```",
                "",
            ]
    return out


def _nodes_section(obs: dict[str, Any]) -> list[str]:
    """Each node of a study across machines, and the slowest named."""
    nodes = obs.get("nodes")
    if not nodes:
        return []
    out = [
        "## Nodes",
        "",
        "| node | host | cores | GPUs | its ranks' compute per step | CPU busy | all-reduce within it (probe) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in nodes["rows"]:
        cpu = "—" if row.get("cpu_pct_mean") is None else f"{row['cpu_pct_mean']:.0f}%"
        link = "—" if row.get("all_reduce_gbps") is None else f"{row['all_reduce_gbps']:.2f} GB/s"
        out.append(
            f"| {row['node']} | {row.get('host') or '?'} | {row.get('cores') or '?'} | "
            f"{', '.join(row.get('gpus') or []) or 'none'} | {_ms(row.get('compute_s'))} | {cpu} | {link} |"
        )
    line = describe_slowest(nodes)
    out += [
        "",
        (line[0].upper() + line[1:] + ".") if line else "Only one node's ranks were timed.",
        "",
    ]
    return out


def _observation_section(obs: dict[str, Any]) -> list[str]:
    """The baseline's step breakdown and slowest layers, when they were observed."""
    out: list[str] = _nodes_section(obs)
    b = obs.get("truth")
    if b and b.get("parts_s"):
        out += [
            "## Where the baseline's step goes",
            "",
            "| part | per step | share |",
            "| --- | --- | --- |",
        ]
        for part, seconds in b["parts_s"].items():
            out.append(f"| {PART_LABELS[part]} | {_ms(seconds)} | {b['fractions'][part]:.0%} |")
        out += ["", f"Source: {b['source']}. Every diagnosis below starts from these figures."]
        if b.get("overlap_R") is not None:
            out += [
                "",
                f"Overlap ratio R (Lee et al. Eq. 11): {b['overlap_R']:.1f} — the share of "
                "communication time hidden behind computation.",
            ]
        out.append("")
    if obs.get("top_layers"):
        out += [
            "| slowest layers | kind | forward | backward | GFLOP (forward) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for t in obs["top_layers"]:
            out.append(
                f"| {t['name']} | {t['kind']} | {_ms(t['forward_s'])} | {_ms(t['backward_s'])} | "
                f"{_gflop(t.get('flops'))} |"
            )
        out.append("")
    if obs.get("blocks"):
        total = sum(r["forward_s"] + r["backward_s"] for r in obs["blocks"]) or 1.0
        out += [
            "## By transformer block",
            "",
            "| block | layers | forward | backward | share of layer time | GFLOP (forward) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in obs["blocks"]:
            share = (r["forward_s"] + r["backward_s"]) / total
            out.append(
                f"| {r['unit']} | {r['layers']} | {_ms(r['forward_s'])} | {_ms(r['backward_s'])} | "
                f"{share:.0%} | {_gflop(r['flops'])} |"
            )
        out += [
            "",
            "Layers timed alone, at one rank's batch (the step breakdown above is the measured whole).",
        ]
        out.append("")
    out += _memory_section(obs.get("memory"))
    return out


def _memory_section(memory: dict[str, Any] | None) -> list[str]:
    """What fills a rank's memory in the baseline: the memory model's parts, calibrated on the
    measured peak."""
    if not memory:
        return []
    from tunekit.memory import PART_ORDER, PART_WORDS

    predicted = memory["predicted"]
    measured = memory.get("measured_peak_bytes")
    cap = memory.get("cap_bytes")
    out = [
        "## Memory per rank",
        "",
        f"Layout: {memory['layout']}. Measured peak: {format_bytes(measured)}"
        + (f" of a {format_bytes(cap)} cap (--memory-cap)" if cap else "")
        + f"; at the {predicted['moment']} peak the memory model (calibrated on it) finds:",
        "",
        "| part | bytes | share |",
        "| --- | --- | --- |",
    ]
    total = predicted["peak_bytes"] or 1.0
    for part in PART_ORDER:
        value = predicted["parts"].get(part)
        if value:
            out.append(f"| {PART_WORDS[part]} | {format_bytes(value)} | {value / total:.0%} |")
    if predicted.get("host_bytes"):
        out.append(f"| (in host memory: CPU offload) | {format_bytes(predicted['host_bytes'])} | |")
    out.append("")
    return out


def _cell(text: str) -> str:
    """Text for a Markdown table cell or list item: one line, no column breaks."""
    return " ".join(text.split()).replace("|", "/")


def _gflop(flops: float | None) -> str:
    return "—" if flops is None else f"{flops / 1e9:.3f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _errors(t: dict[str, Any]) -> str:
    raw, corrected = t.get("prediction_error"), t.get("corrected_prediction_error")
    if raw is None:
        return "—"
    return _pct(raw) if corrected is None else f"{_pct(raw)} → {_pct(corrected)}"


def _prediction_section(data: dict[str, Any]) -> list[str]:
    """How far each tuner's predictions were from what its trials measured."""
    errors = data.get("prediction_errors") or {}
    if not errors:
        return []
    out = [
        "",
        "## How good were the predictions",
        "",
        "| tuner | trials | median error | corrected | correction learnt |",
        "| --- | --- | --- | --- | --- |",
    ]
    corrections = data.get("corrections") or {}
    for name, e in sorted(errors.items()):
        learnt = (corrections.get(name) or {}).get("text", "—")
        out.append(
            f"| {name} | {e['trials']} | {_pct(e['median_error'])} | "
            f"{_pct(e['median_corrected_error'])} | {learnt} |"
        )
    return out


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:,.1f}"


def _speedup(head: dict[str, Any]) -> str:
    sp = head.get("speedup")
    if sp is None:
        return "—"
    ci = head.get("speedup_ci")
    return f"{sp:.2f}x" + (f" (95% CI {ci[0]:.2f}–{ci[1]:.2f})" if ci else "")


def _peaks(t: dict[str, Any]) -> str:
    """``38 MiB → 40 MiB``: the predicted and the measured peak per rank."""
    predicted, measured = t.get("predicted_peak_bytes"), t.get("peak_bytes")
    if predicted is None and measured is None:
        return "—"
    return f"{format_bytes(predicted)} → {format_bytes(measured)}"
