"""``tunekit profile WORKLOAD``: graph, layer times, step breakdown, telemetry, py-spy hot spots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from tunekit.cli.common import DURATION, Table, console, ensure_writable, styled
from tunekit.examples import DEFAULT_EXAMPLE
from tunekit.observe.breakdown import PARTS
from tunekit.workload_spec import resolve_spec


@click.command("profile")
@click.argument("workload", default=f"example:{DEFAULT_EXAMPLE}")
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Ranks of the profiled run.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Profiled steps (after warm-up).",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="Unprofiled warm-up steps (py-spy samples them too).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tunekit-profile"),
    show_default=True,
    help="Where JSON and traces go.",
)
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
)
@click.option(
    "--top", type=click.IntRange(min=1), default=10, show_default=True, help="Layers to list."
)
@click.option(
    "--timeout",
    "timeout_s",
    type=DURATION,
    default=600.0,
    help="Limit on observing the model and on the profiled run; past it, a hang [default: 10m].",
)
def profile_cmd(workload, nproc, steps, warmup, out_dir, device, top, timeout_s):
    """Profile WORKLOAD on NPROC ranks and print where the step time goes.

    Prints the step breakdown per rank (compute, exposed communication, data,
    optimizer, idle, and the overlap ratio R), the slowest layers, a telemetry
    summary and py-spy hot spots; writes profile.json, telemetry.json and the
    ranks' Chrome traces (open them in Perfetto) under --out.
    """
    ensure_writable(out_dir, "the profile folder (--out)")  # before the profile, not after it
    resolve_spec(workload)  # a missing file: one line now, not after torch has loaded
    from tunekit.observe.kineto import start_profiler_in_main_thread
    from tunekit.observe.profile_job import ProfileOptions, profile_job

    start_profiler_in_main_thread()
    opts = ProfileOptions(
        nproc=nproc,
        steps=steps,
        warmup=warmup,
        out_dir=out_dir,
        device=device,
        top_layers=top,
        timeout_s=timeout_s,
    )
    with console.status("profiling") as status:
        report = profile_job(workload, opts, on_stage=lambda msg: status.update(msg))
    print_report(report)


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1e3:.2f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}"


def _mb(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**20:.1f}"


def print_report(report: dict[str, Any]) -> None:
    """The tables of ``tunekit profile`` for a report from :func:`profile_job`."""
    g = report["graph"]
    console.print(
        styled("[bold]{}[/]", report["workload"]),
        f"on {report['nproc']} rank(s) · graph by {g['method']}: "
        f"{g['layers']} layers, {g['params']:,} parameters, "
        f"{g['forward_flops'] / 1e9:.2f} GFLOP forward at batch {g['batch_size']}",
    )
    for notice in report["notices"]:
        console.print(styled("[yellow]notice:[/] {}", notice))
    _breakdown_table(report["breakdown"])
    _layers_table(report["top_layers"], report["device"])
    if report.get("blocks"):
        _blocks_table(report["blocks"], report["device"])
    _telemetry_tables(report["telemetry"])
    files = report["files"]
    console.print(f"report: {files['report']} · telemetry: {files['telemetry']}")
    for t in files["traces"]:
        console.print(f"trace: {t}")


def _breakdown_table(bd: dict[str, Any]) -> None:
    table = Table(
        title="step breakdown (ms per step, mean over profiled steps)", title_justify="left"
    )
    cols = [
        "rank",
        "step",
        "compute",
        "comm exp",
        "data",
        "optim",
        "idle",
        "comm tot",
        "R %",
        "measured",
    ]
    for c in cols:
        table.add_column(c, justify="right")
    rows = [r for r in bd["ranks"]]
    for r in rows:
        steps = r["steps"]
        n = max(len(steps), 1)
        mean = {p: sum(s[f"{p}_s"] for s in steps) / n for p in ("total", *PARTS, "comm_total")}
        colls = [c for s in steps for c in s["collectives"]]
        tc = sum(c["own_s"] for c in colls)
        R = None if tc <= 0 else 100 * sum(c["own_s"] - c["blocked_s"] for c in colls) / tc
        measured = r.get("measured_step_s")
        table.add_row(
            str(r["rank"]),
            _ms(mean["total"]),
            *(_ms(mean[p]) for p in PARTS),
            _ms(mean["comm_total"]),
            "—" if R is None else f"{R:.0f}",
            _ms(sum(measured) / len(measured)) if measured else "—",
        )
    console.print(table)
    s = bd["summary"]
    fr = s.get("fractions", {})
    if fr:
        console.print(
            "of the step: "
            + ", ".join(f"{p.replace('_', ' ')} {100 * fr[p]:.0f}%" for p in PARTS)
            + ("" if s.get("overlap_R") is None else f"; overlap R = {s['overlap_R']:.0f}%")
        )


def _layers_table(layers: list[dict[str, Any]], device: str) -> None:
    table = Table(title=f"slowest layers (measured standalone on {device})", title_justify="left")
    for c in ("layer", "kind", "output", "fwd ms", "bwd ms", "act MiB", "GFLOP"):
        table.add_column(c, justify="left" if c in ("layer", "kind", "output") else "right")
    for t in layers:
        table.add_row(
            t["name"],
            t["kind"],
            "×".join(map(str, t["output_shape"] or [])),
            _ms(t["forward_s"]),
            _ms(t["backward_s"]),
            _mb(t["activation_bytes"]),
            f"{t['flops'] / 1e9:.3f}",
        )
    console.print(table)


def _blocks_table(blocks: list[dict[str, Any]], device: str) -> None:
    table = Table(
        title=f"by transformer block (layers measured standalone on {device})", title_justify="left"
    )
    for c in ("block", "layers", "fwd ms", "bwd ms", "share", "GFLOP"):
        table.add_column(c, justify="left" if c == "block" else "right")
    total = sum(r["forward_s"] + r["backward_s"] for r in blocks) or 1.0
    for r in blocks:
        table.add_row(
            r["unit"],
            str(r["layers"]),
            _ms(r["forward_s"]),
            _ms(r["backward_s"]),
            f"{(r['forward_s'] + r['backward_s']) / total:.0%}",
            f"{r['flops'] / 1e9:.3f}",
        )
    console.print(table)


def _telemetry_tables(tel: dict[str, Any]) -> None:
    host = tel.get("host")
    if host:
        table = Table(title="host (per rank)", title_justify="left")
        for c in ("rank", "CPU % mean", "CPU % max", "RSS max MiB"):
            table.add_column(c, justify="right")
        for rank, r in host["ranks"].items():
            table.add_row(
                rank, f"{r['cpu_pct_mean']:.0f}", f"{r['cpu_pct_max']:.0f}", _mb(r["rss_max_bytes"])
            )
        console.print(table)
    nv = tel.get("nvml")
    if nv:
        table = Table(title="GPUs", title_justify="left")
        for c in (
            "gpu",
            "util % mean",
            "mem max MiB",
            "power W mean",
            "SM MHz max",
            "PCIe TX MB/s",
            "PCIe RX MB/s",
        ):
            table.add_column(c, justify="right")
        for idx, g in nv["gpus"].items():
            table.add_row(
                idx,
                f"{g.get('util_gpu_pct_mean', float('nan')):.0f}",
                _mb(g.get("mem_used_bytes_max")),
                f"{g.get('power_w_mean', float('nan')):.0f}",
                f"{g.get('sm_clock_mhz_max', float('nan')):.0f}",
                f"{g.get('pcie_tx_bytes_s_mean', 0) / 1e6:.0f}",
                f"{g.get('pcie_rx_bytes_s_mean', 0) / 1e6:.0f}",
            )
        console.print(table)
    spy = tel.get("pyspy")
    if spy:
        table = Table(
            title=f"py-spy hot spots ({spy['samples']} main-thread samples)", title_justify="left"
        )
        for c in ("function", "share"):
            table.add_column(c, justify="left" if c == "function" else "right")
        for f in spy["top_functions"]:
            table.add_row(f["function"], f"{100 * f['fraction']:.0f}%")
        console.print(table)
        cats = ", ".join(
            f"{k} {100 * v:.0f}%"
            for k, v in sorted(spy["categories"].items(), key=lambda kv: -kv[1])
        )
        console.print(f"stack samples: {cats}")
        for flag in spy["flags"]:
            console.print(styled("[yellow]flag:[/] {}", flag))
    if tel.get("errors"):
        console.print(f"telemetry sample errors: {tel['errors']}", style="dim")
