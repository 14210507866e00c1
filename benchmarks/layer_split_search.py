"""layer_split: search time and predicted speed-ups on DeePa's 16 x K80 machine, beside the paper's.

    .venv/bin/python benchmarks/layer_split_search.py [--repeats 20] [--models alexnet vgg16 inception_v3]

Part 1 times the elimination search (tables prebuilt, as the paper's ~100 ms
for Inception-v3 on 16 GPUs counts only the search) over the full config
space, and shows how far each graph reduces.

Part 2 predicts, with Eq. 1 on the ``k80x16`` profile (global batch 512, the
paper's setting), the step time of image parallelism, OWT and the best plan,
and prints the speed-ups beside the paper's measured ones (Sec. 7.1: 6.5x /
1.9x / 1.5x over TensorFlow/PyTorch image parallelism; OWT 1.4x / 1.2x / 1.07x
over image parallelism in DeePa), together with the data moved per step
(paper: "reduces data transfers by up to 23x").
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from tunekit.hardware import load_profile
from tunekit.observe.graph import trace_model
from tunekit.plugins.layer_split.model import CostOptions, build_tables, specs_from_graph
from tunekit.plugins.layer_split.search import compare, cost_graph, search
from tunekit.search.elimination import solve
from tunekit.workload import load_workload

PAPER = {  # Sec. 7.1, 16 K80s, batch 512: speed-up of DeePa's best over image parallelism
    # (TensorFlow/PyTorch), and of OWT over image parallelism (both in DeePa).
    "alexnet": {"best": 6.5, "owt": 1.4, "search_s": 0.7},
    "vgg16": {"best": 1.9, "owt": 1.2, "search_s": 1.1},
    "inception_v3": {"best": 1.5, "owt": 1.07, "search_s": 4.8},
}
BATCH, DEVICES = 512, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--models", nargs="+", default=list(PAPER))
    ap.add_argument(
        "--efficiency",
        type=float,
        default=CostOptions().efficiency,
        help="analytic compute: fraction of the K80's peak a slice reaches",
    )
    args = ap.parse_args()
    console = Console(width=170)
    hw = load_profile("k80x16")

    timing = Table(
        title=f"Elimination search, full config space, {DEVICES} devices "
        f"(median of {args.repeats}; paper: Inception-v3 ~100 ms)"
    )
    for col in (
        "model",
        "layers",
        "edges",
        "configs/layer (max)",
        "after elimination",
        "eliminations (node/edge)",
        "search ms",
        "tables s",
        "trace s",
    ):
        timing.add_column(col, justify="right" if col != "model" else "left")
    speed = Table(
        title=f"Predicted speed-ups on k80x16 (Eq. 1, batch {BATCH}) vs the paper's measured"
    )
    for col in (
        "model",
        "model conv.",
        "image ms",
        "OWT ms",
        "best ms",
        "best/image",
        "paper",
        "OWT/image",
        "paper OWT",
        "bytes image/best",
        "bytes OWT/best",
    ):
        speed.add_column(col, justify="right" if col not in ("model", "model conv.") else "left")

    for name in args.models:
        wl = load_workload(f"example:{name}")
        t0 = time.perf_counter()
        graph = trace_model(wl.model(), wl.example_batch(1)[0])
        trace_s = time.perf_counter() - t0
        specs = specs_from_graph(graph, BATCH)
        options = CostOptions(efficiency=args.efficiency)
        t0 = time.perf_counter()
        tables = build_tables(specs, hw, DEVICES, options)
        tables_s = time.perf_counter() - t0
        g, _ = cost_graph(tables, "best")
        secs = []
        for _ in range(args.repeats):
            sol = solve(g)
            secs.append(sol.stats.seconds)
        st = sol.stats
        timing.add_row(
            name,
            str(st.nodes_before),
            str(st.edges_before),
            str(max(len(s) for s in tables.spaces.values())),
            f"{st.nodes_after} nodes, {st.edges_after} edge(s)",
            f"{st.node_eliminations}/{st.edge_eliminations}",
            f"{statistics.median(secs) * 1e3:.1f}",
            f"{tables_s:.2f}",
            f"{trace_s:.1f}",
        )
        for conv, opts in (
            ("paper", options),
            ("exact", CostOptions(xfer="exact", update="exact", efficiency=args.efficiency)),
        ):
            t = tables if conv == "paper" else build_tables(specs, hw, DEVICES, opts)
            plans = compare(t)
            tot = {k: p.totals() for k, p in plans.items()}
            img, owt, best = tot["image"], tot["owt"], tot["best"]

            def moved(x):
                return x["xfer_bytes"] + x["update_bytes"]

            speed.add_row(
                name,
                conv,
                f"{img['total_s'] * 1e3:.0f}",
                f"{owt['total_s'] * 1e3:.0f}",
                f"{best['total_s'] * 1e3:.0f}",
                f"{img['total_s'] / best['total_s']:.2f}x",
                f"{PAPER[name]['best']}x" if conv == "paper" else "",
                f"{img['total_s'] / owt['total_s']:.2f}x",
                f"{PAPER[name]['owt']}x" if conv == "paper" else "",
                f"{moved(img) / moved(best):.1f}x",
                f"{moved(owt) / moved(best):.1f}x",
            )
        best_plan = search(tables)
        changed = sorted(
            {
                r.config.label()
                for r in best_plan.rows
                if r.kind in ("conv", "pool", "linear", "concat")
            }
        )
        console.print(f"[dim]{name}: best plan uses configs {', '.join(changed)}[/]")

    console.print(timing)
    console.print(speed)
    console.print(
        "Why the numbers differ from the paper's: (1) the paper's speed-ups are measured throughput; "
        "its runtime overlaps gradient transfers with back-propagation (Sec. 5), while Eq. 1 -- which "
        "the paper itself uses to choose plans -- is a plain sum, so it charges image parallelism its "
        "whole gradient synchronisation (16 x the parameters at 2.25 GB/s: 1.7 s for AlexNet) and "
        "over-states the gain of plans that avoid replicated weights (AlexNet, VGG-16); (2) compute "
        "here is analytic (FLOPs at a fixed fraction of the K80's peak), linear in the slice, so the "
        "faster cuDNN kernels DeePa measured for some h/w splits (its Fig. 1) never appear, which is "
        "where Inception-v3's gain came from; (3) the paper's image-parallel baseline is "
        "TensorFlow/PyTorch, ours is image parallelism under the same model. The 'exact' rows count "
        "only bytes really moved (halos and backward gradients included, data already on a device "
        "excluded) and a ring all-reduce's 2(r-1) x weights instead of the paper's r x weights, at "
        "the same 2.25 GB/s: replicated weights cost more still, and the gains grow."
    )


if __name__ == "__main__":
    main()
