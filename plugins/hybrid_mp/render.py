"""How hybrid_mp's results look: the placement table, the schedule as a Gantt chart
(text for a terminal, PNG for the report) and the hybrid decision table.

Everything here reads the plain data a :class:`~tunekit.plugins.hybrid_mp.schedule.Placement`
or :class:`~tunekit.plugins.hybrid_mp.model.Decision` holds (or their ``to_dict()``
as stored in ``Candidate.details``), so the CLI and the report can render
what a plan saved earlier.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "placement_rows",
    "format_placement_table",
    "format_gantt",
    "save_gantt_png",
    "format_decision_table",
    "format_summary",
]

_SYMBOLS = string.ascii_uppercase  # forward; backward is the lower-case letter


def _as_dict(obj: Any) -> dict[str, Any]:
    return obj if isinstance(obj, Mapping) else obj.to_dict()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def placement_rows(placement: Any) -> list[dict[str, Any]]:
    """One row per op: device, forward start/end, backward start/end, its layers."""
    p = _as_dict(placement)
    by_op: dict[str, dict[str, Any]] = {}
    for t in p["schedule"]:
        row = by_op.setdefault(
            t["op"],
            {
                "op": t["op"],
                "device": t["device"],
                "layers": p.get("members", {}).get(t["op"], [t["op"]]),
            },
        )
        row[f"{t['phase']}_start_s"] = t["start"]
        row[f"{t['phase']}_end_s"] = t["end"]
    return sorted(by_op.values(), key=lambda r: (r.get("fwd_start_s", 0.0), r["op"]))


def format_placement_table(placement: Any, max_rows: int | None = None) -> str:
    """The placement as a text table (times in ms)."""
    rows = placement_rows(placement)
    has_bwd = any("bwd_start_s" in r for r in rows)
    header = ["op", "device", "fwd start", "fwd ms"] + (["bwd start", "bwd ms"] if has_bwd else [])
    body = []
    for r in rows[: max_rows or len(rows)]:
        line = [
            r["op"] if len(r["layers"]) == 1 else f"{r['op']} (+{len(r['layers']) - 1})",
            r["device"],
            _ms(r["fwd_start_s"]),
            _ms(r["fwd_end_s"] - r["fwd_start_s"]),
        ]
        if has_bwd:
            line += [_ms(r["bwd_start_s"]), _ms(r["bwd_end_s"] - r["bwd_start_s"])]
        body.append(line)
    if max_rows is not None and len(rows) > max_rows:
        body.append(
            [f"... {len(rows) - max_rows} more", "", "", ""] + (["", ""] if has_bwd else [])
        )
    return _table(header, body)


def format_gantt(placement: Any, width: int = 100) -> str:
    """The schedule as a text Gantt chart: one line per device, one letter per op
    (upper case forward, lower case backward; letters repeat after Z), ``.`` idle."""
    p = _as_dict(placement)
    makespan = p["makespan"] or 1.0
    ops = [r["op"] for r in placement_rows(p)]
    symbol = {op: _SYMBOLS[i % len(_SYMBOLS)] for i, op in enumerate(ops)}
    lines = []
    name_w = max(len(d) for d in p["devices"])
    for dev in p["devices"]:
        cells = ["."] * width
        for t in sorted(p["schedule"], key=lambda t: t["start"]):
            if t["device"] != dev or t["end"] <= t["start"]:
                continue
            a = int(t["start"] / makespan * width)
            b = max(a + 1, int(round(t["end"] / makespan * width)))
            ch = symbol[t["op"]]
            if t["phase"] == "bwd":
                ch = ch.lower()
            for i in range(a, min(b, width)):
                cells[i] = ch
        lines.append(f"{dev:>{name_w}} |{''.join(cells)}|")
    axis = f"{'':>{name_w}}  0{'':{width - 12}}{makespan * 1e3:>9.3f} ms"
    lines.append(axis)
    legend = ", ".join(f"{symbol[o]}={o}" for o in ops[: len(_SYMBOLS)])
    more = f" (+{len(ops) - len(_SYMBOLS)} more ops)" if len(ops) > len(_SYMBOLS) else ""
    lines.append(f"{'':>{name_w}}  {legend}{more}")
    return "\n".join(lines)


def save_gantt_png(placement: Any, path: str | Path, title: str = "") -> Path:
    """The schedule as a PNG Gantt chart (forward and backward tasks in two colours)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = _as_dict(placement)
    devices = p["devices"]
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(devices) + 1.4))
    colours = {"fwd": "#4C78A8", "bwd": "#F58518"}
    for row, dev in enumerate(devices):
        for phase in ("fwd", "bwd"):
            spans = [
                (t["start"] * 1e3, (t["end"] - t["start"]) * 1e3)
                for t in p["schedule"]
                if t["device"] == dev and t["phase"] == phase and t["end"] > t["start"]
            ]
            if spans:
                ax.broken_barh(
                    spans,
                    (row - 0.35, 0.7),
                    facecolors=colours[phase],
                    edgecolor="white",
                    linewidth=0.3,
                    label=phase if row == 0 else None,
                )
    ax.set_yticks(range(len(devices)), devices)
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms)")
    su = p.get("speedup") or (p["serial_s"] / p["makespan"] if p["makespan"] else 1.0)
    ax.set_title(
        title or f"DLPlacer schedule: makespan {p['makespan'] * 1e3:.3f} ms, SU^M {su:.3f}"
    )
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_decision_table(decision: Any) -> str:
    """Every factorisation of the budget and the DP-only scales, with Eq. 6's threshold."""
    d = _as_dict(decision)
    best = d["best"]
    header = ["devices", "N (DP)", "M (MP)", "SU^M", "speed-up", "Eq. 6 threshold", "note"]
    body = []
    for r in d["rows"]:
        mark = " <- best" if (r["dp"], r["mp"]) == (best["dp"], best["mp"]) else ""
        body.append(
            [
                str(r["devices"]),
                str(r["dp"]),
                str(r["mp"]),
                f"{r['su_m']:.3f}",
                f"{r['speedup']:.3f}",
                "" if r["threshold"] is None else f"{r['threshold']:.3f}",
                r["note"] + mark,
            ]
        )
    out = _table(header, body)
    return (
        out
        + f"\nbest over the best DP-only scale ({d['best_dp']['dp']} devices): {d['gain_over_dp']:.3f}x"
    )


def format_summary(placement: Any) -> str:
    """One line: SU^M, makespan, how it was found and how good it is proven to be."""
    p = _as_dict(placement)
    su = p.get("speedup") or (p["serial_s"] / p["makespan"] if p["makespan"] else 1.0)
    gap = "" if p.get("gap") is None else f", gap {p['gap'] * 100:.2f}%"
    used = len(set(p["assignment"].values()))
    note = f"; {p['note']}" if p.get("note") else ""
    return (
        f"SU^{len(p['devices'])} = {su:.3f} (step {p['serial_s'] * 1e3:.3f} -> {p['makespan'] * 1e3:.3f} ms "
        f"on {used} of {len(p['devices'])} devices); {p['method']}, {p['status']}{gap}, "
        f"{p.get('solve_s', 0.0):.1f} s{note}"
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
