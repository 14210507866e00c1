"""hybrid_mp: measured per-step speed-up of 2-way model parallelism vs DLPlacer's prediction.

    .venv/bin/python benchmarks/hybrid_mp_speedup.py [--workload SPEC] [--steps 8]

On 2 CPU gloo ranks (one thread each) against one process with one thread:

1. Δ(k) measured: every layer's forward and backward timed standalone
   (``tunekit.observe.layer_profile``); the link measured: the core's send/recv
   ping-pong between the two ranks (``tunekit.observe.timing.measure_link``:
   warm-up, repeats, medians) fitted to latency + bytes / bandwidth.
2. DLPlacer places the model on the two ranks and predicts SU^2.
3. The placement runs for real (``hybrid_mp``'s executor) and its step time is
   compared with one process training the same batches.

The default workload has Inception-like blocks wide enough for the towers to
outweigh the transfers. Wall-clock speed-up needs two otherwise idle cores;
the load average is printed, and so is the CPU time each rank spends per
step (``time.process_time``), which shows how the work was split whatever
else runs on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from rich.console import Console
from rich.table import Table

from tunekit.observe.graph import trace_model
from tunekit.observe.layer_profile import profile_layers
from tunekit.observe.timing import measure_link
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import op_graph_from_model
from tunekit.plugins.hybrid_mp.placement_codec import nodes_of
from tunekit.plugins.hybrid_mp.render import format_gantt, format_summary
from tunekit.plugins.hybrid_mp.search import PlacerOptions, place
from tunekit.plugins.hybrid_mp.tests.ranks_hybrid_mp import hybrid_rank, reference_run
from tunekit.testing import run_ranks
from tunekit.workload import load_workload

SIZES = [4_096, 65_536, 1_048_576, 4_194_304, 16_777_216]


def _median_iqr(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return statistics.median(xs), q[2] - q[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workload", default="tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp:branchy_wide"
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    console = Console(width=160)
    torch.set_num_threads(1)
    workload = load_workload(args.workload)
    b = workload.batch_size

    # 1. measured inputs
    torch.manual_seed(workload.seed)
    model = workload.model()
    x, _ = workload.example_batch(b)
    graph = trace_model(model, x)
    prof = profile_layers(model, x, graph, warmup=2, repeats=5)
    link = run_ranks(measure_link, 2, args=(SIZES,))[0]
    bandwidth, latency = link.bandwidth, link.latency
    measured = {name: (t.forward_s, t.backward_s) for name, t in prof.layers.items()}
    og = op_graph_from_model(graph, measured=measured)
    mem = 64e9
    hw = HardwareGraph.of({"rank0": mem, "rank1": mem}, [("rank0", "rank1", bandwidth, latency)])
    console.print(
        f"{workload.name}: {len(og.ops)} layers, batch {b}; layers sum to "
        f"{og.serial_time() * 1e3:.1f} ms (fwd {prof.forward_s * 1e3:.1f} + bwd {prof.backward_s * 1e3:.1f}); "
        f"gloo p2p fit: {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us"
    )

    # 2. DLPlacer's prediction
    p = place(og, hw, PlacerOptions(time_limit_s=60))
    console.print(format_summary(p))
    console.print(format_gantt(p, width=110))
    plan = nodes_of(graph, p)

    # 3. the real thing
    steps = args.warmup + args.steps
    load_before = os.getloadavg()[0]
    ref = reference_run(args.workload, steps, 1, workload.lr / 2, threads=1)
    ranks = run_ranks(hybrid_rank, 2, args=(args.workload, steps, 2, plan))
    load_after = os.getloadavg()[0]
    per_step = [max(r["step_s"][i] for r in ranks) for i in range(args.warmup, steps)]
    t1, s1 = _median_iqr(ref["step_s"][args.warmup :])
    t2, s2 = _median_iqr(per_step)
    c1 = statistics.median(ref["cpu_s"][args.warmup :])
    c_ranks = [statistics.median(r["cpu_s"][args.warmup :]) for r in ranks]
    table = Table(title="2-way model parallelism on 2 CPU gloo ranks (1 thread each) vs 1 process")
    for col in ("quantity", "value"):
        table.add_column(col)
    table.add_row("1 process, step (median, IQR)", f"{t1 * 1e3:.1f} ms ({s1 * 1e3:.1f})")
    table.add_row("2 ranks, step (median, IQR)", f"{t2 * 1e3:.1f} ms ({s2 * 1e3:.1f})")
    table.add_row("measured SU^2 (wall clock)", f"{t1 / t2:.3f}")
    table.add_row(
        "CPU per step: 1 process | rank 0 | rank 1",
        f"{c1 * 1e3:.1f} | {c_ranks[0] * 1e3:.1f} | {c_ranks[1] * 1e3:.1f} ms",
    )
    table.add_row("work split: 1-process CPU / busiest rank's CPU", f"{c1 / max(c_ranks):.3f}")
    table.add_row("load average (1 min) before | after", f"{load_before:.1f} | {load_after:.1f}")
    table.add_row("DLPlacer predicted SU^2 (measured layers, fitted link)", f"{p.speedup:.3f}")
    table.add_row("predicted step from the layer profile", f"{p.makespan * 1e3:.1f} ms")
    table.add_row("measured / predicted", f"{(t1 / t2) / p.speedup:.3f}")
    table.add_row("paper (Inception-V3, 2 V100s)", "1.32 measured, within 6% of DLPlacer")
    console.print(table)


if __name__ == "__main__":
    main()
