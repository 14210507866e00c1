"""layer_split on 2 gloo ranks: measured step time of applied plans vs their predictions.

    .venv/bin/python benchmarks/layer_split_runtime.py [--steps 12] [--warmup 3]

1. Probes this machine (``tunekit.observe.probe.probe_hardware``): point-to-point
   and all-reduce times of the 2 ranks over a size sweep, fitted to latency +
   bytes/bandwidth (the hardware model's collective fits).
2. Builds the cost tables of the example CNN for those 2 ranks, with compute
   MEASURED per (layer, config) by layer_split's ``time_layer_split`` at one thread per rank.
3. Runs plans for real (image parallelism, OWT, DeePa's best, the best under the
   exact-bytes model, and a hand-mixed plan) plus plain DDP, and prints each
   plan's measured median step beside three predictions:
   * Eq. 1, paper convention (what the search ranks by);
   * Eq. 1, exact bytes (halos, residency, backward gradients, message latency);
   * the executor's own cost: compute + exact transfers + the one all-reduce of
     every gradient it does to keep parameters replicated (instead of DeePa's
     per-layer update).
"""

from __future__ import annotations

import argparse
import json
import os

from rich.console import Console
from rich.table import Table

from tunekit.observe.observation import Observation, summarize_model
from tunekit.observe.probe import probe_hardware
from tunekit.plugins.layer_split.model import CostOptions, build_tables
from tunekit.plugins.layer_split.plugin import LayerSplit
from tunekit.plugins.layer_split.search import evaluate, named_configs, search
from tunekit.plugins.layer_split.tests.ranks_layer_split import train_plans
from tunekit.testing import run_ranks
from tunekit.workload import load_workload

SPEC = "example:cnn"
MIXED = {
    "_0": "n2",
    "_2": "h2",
    "_3": "h2",
    "_5": "c2",
    "_6": "w2",
    "_8": "c2",
    "_10": "c2",
    "_12": "1",
    "_14": "n2",
    "output": "n2",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    console = Console(width=150)

    sizes = [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20]
    hw = probe_hardware(2, sizes=sizes, device_type="cpu").hardware
    p2p, ar = hw.fit("p2p", 2), hw.fit("all_reduce", 2)
    p2p_lat, p2p_bw, ar_lat, ar_bw = p2p.latency, p2p.bandwidth, ar.latency, ar.bandwidth
    console.print(
        f"probe: p2p {p2p_lat * 1e6:.0f} us + bytes / {p2p_bw / 1e9:.2f} GB/s; "
        f"all-reduce {ar_lat * 1e6:.0f} us + bytes / {ar_bw / 1e9:.2f} GB/s"
    )

    wl = load_workload(SPEC)
    obs = Observation(
        SPEC, wl, 2, "gloo", "cpu", hw, summarize_model(wl.model(), wl.example_batch(2)[0])
    )
    tuner = LayerSplit()
    paper = tuner.tables(obs)
    console.print(f"compute: {paper.compute_source}")

    def measured(spec, cfg):
        return float(paper.compute[spec.name][paper.spaces[spec.name].index(cfg)])

    exact = build_tables(
        paper.specs,
        hw,
        2,
        CostOptions(xfer="exact", update="exact"),
        measured,
        paper.compute_source,
        paper.spaces,
    )
    from tunekit.plugins.layer_split.search import decode_plan

    plans = {
        "image": named_configs(paper.specs, paper.spaces, "image"),
        "owt": named_configs(paper.specs, paper.spaces, "owt"),
        "best (paper model)": search(paper).configs,
        "best (exact model)": search(exact).configs,
        "mixed": {
            **named_configs(paper.specs, paper.spaces, "image"),
            **decode_plan(json.dumps(MIXED)),
        },
    }
    grad_bytes = sum(s.param_bytes for s in paper.specs.values())
    sync_s = hw.allreduce_time(grad_bytes, 2)

    cases = [(SPEC, "ddp", args.steps + args.warmup, args.warmup)]
    cases += [
        (
            SPEC,
            json.dumps({k: c.label() for k, c in p.items()}),
            args.steps + args.warmup,
            args.warmup,
        )
        for p in plans.values()
    ]
    results = run_ranks(train_plans, 2, (cases,), timeout_s=900)[0]

    table = Table(
        title=f"example CNN on 2 gloo ranks (batch {wl.batch_size} per rank): "
        f"median of {args.steps} steps after {args.warmup} warm-up, ms"
    )
    for col in (
        "plan",
        "configs",
        "Eq.1 paper",
        "Eq.1 exact",
        "executor model",
        "measured",
        "measured / executor",
    ):
        table.add_column(col, justify="left" if col in ("plan", "configs") else "right")
    table.add_row("DDP (untuned)", "", "", "", "", f"{results[0]['median_s'] * 1e3:.1f}", "")
    for (name, cfgs), res in zip(plans.items(), results[1:], strict=True):
        p_paper = evaluate(paper, cfgs).totals()
        p_exact = evaluate(exact, cfgs).totals()
        executor = p_exact["compute_s"] + p_exact["xfer_s"] + sync_s
        labels = " ".join(
            cfgs[v].label() for v in paper.specs if paper.specs[v].kind not in ("input", "output")
        )
        table.add_row(
            name,
            labels,
            f"{p_paper['total_s'] * 1e3:.1f}",
            f"{p_exact['total_s'] * 1e3:.1f}",
            f"{executor * 1e3:.1f}",
            f"{res['median_s'] * 1e3:.1f}",
            f"{res['median_s'] / executor:.2f}",
        )
    console.print(table)
    console.print(
        f"load average during the run: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} CPUs"
    )
    console.print(
        "The executor model leaves out what a step does besides layers and messages: building the "
        "global batch on every rank, the optimizer step, Python dispatch per layer and per message "
        "(about a dozen layers, each with its own exchange). On a loaded 2-core machine those and "
        "timing noise dominate a model this small; the ranking of plans is what the search relies on."
    )


if __name__ == "__main__":
    main()
