"""CGDP at several chunk sizes against DDP, and the chunk size the in-job searches find.

Two workloads at the ends of CGDP's range (``tunekit.plugins.cgdp.tests.workloads_cgdp``):
``deep_narrow`` (24 small linear layers, ResNet-152's flat profile) and
``wide`` (two small convolutions, three large linear layers, AlexNet's
profile). Each runs on 2 gloo ranks, all configs side by side:

1. a sweep: DDP and CGDP at every distinct chunk layout (k = 1 .. l-1; k >= l
   is the layout of k = 1), plus optimizer offload, interleaved round-robin;
   the cost model's prediction for each k (fed with this job's measured
   layer times and this machine's copy, gloo and hook rates) beside it;
2. the in-job searches: the paper's Algorithm 1 and the noise-aware variant,
   each in a fresh job; the chunk each finds against the best of the sweep,
   and the intervals each used;
3. on a CUDA machine, peak device memory of DDP, CGDP and CGDP with offload.

Run:  .venv/bin/python benchmarks/cgdp_chunks.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from tunekit.plugins.cgdp.tests.ranks_cgdp import live_searches, peak_memory, sweep
from tunekit.testing import run_ranks

WORKLOADS = {
    "deep_narrow": "tunekit.plugins.cgdp.tests.workloads_cgdp:deep_narrow",
    "wide": "tunekit.plugins.cgdp.tests.workloads_cgdp:wide",
}
LAYERS = {"deep_narrow": 24, "wide": 5}
SEARCHES = [
    {"search": "paper", "search_step": 10, "search_range": 5, "search_interval": 10},
    {"search": "noise_aware", "search_step": 10, "search_range": 5, "search_interval": 10},
    {"search": "paper", "search_step": 4, "search_range": 2, "search_interval": 10},
    {"search": "noise_aware", "search_step": 4, "search_range": 2, "search_interval": 10},
]
MiB = 1024 * 1024


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def sweep_table(res: dict) -> str:
    ddp = res["median_s"]["ddp"]
    model = res["model"]
    rows = []
    for name, med in res["median_s"].items():
        k = int(name[2:].split("+")[0]) if name.startswith("k=") else None
        # The model predicts backward; anchor it at DDP's measured step for the rest.
        if k is not None and "+" not in name:
            predicted = ddp - model["ddp_s"] + model["cgdp_s"][k]
        else:
            predicted = None
        mem = res["memory"].get(name, {})
        host = (
            mem.get("host_gradient_buffer_bytes", 0)
            + mem.get("host_master_param_bytes", 0)
            + mem.get("host_optimizer_state_bytes", 0)
        )
        r = res["overlap_R"].get(name)
        rows.append(
            [
                name,
                ms(med),
                ms(res["iqr_s"][name]),
                f"{ddp / med:.2f}x",
                "-" if r is None else f"{r:.0f}",
                ms(predicted),
                f"{host / MiB:.2f}" if mem else "0",
                f"{mem.get('device_bytes_saved', 0) / MiB:.2f}" if mem else "-",
            ]
        )
    return table(
        ["config", "median ms", "IQR ms", "vs DDP", "R %", "model ms", "host MiB", "dev saved MiB"],
        rows,
    )


def search_table(searches: list[dict], res: dict) -> str:
    cgdp = {
        int(n[2:]): t for n, t in res["median_s"].items() if n.startswith("k=") and "+" not in n
    }
    best_k = min(cgdp, key=cgdp.get)
    rows = []
    layers = res["layers"]
    for s in searches:
        k = s["chunk"]
        same = k if k < layers else 1  # k >= l is the layout of k = 1
        t = cgdp[same]
        knobs = s["knobs"]
        rows.append(
            [
                f"{knobs['search']} step={knobs['search_step']} range={knobs['search_range']}",
                str(k),
                str(s["intervals"]),
                str(s["steps"]),
                f"{s['wall_s']:.1f}",
                ms(t),
                f"k={best_k} {ms(cgdp[best_k])}",
                f"{(t / cgdp[best_k] - 1) * 100:+.1f}%",
            ]
        )
    return table(
        [
            "search",
            "found k",
            "intervals",
            "iterations",
            "wall s",
            "found ms",
            "sweep best",
            "regret",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and chunk sizes")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    steps = 3 if args.quick else 5
    started = time.perf_counter()
    for name, spec in WORKLOADS.items():
        layers = LAYERS[name]
        ks = list(range(1, layers))
        if args.quick:
            ks = sorted({1, 2, 4, 8, layers - 1} & set(ks))
        t0 = time.perf_counter()
        res = run_ranks(sweep, 2, (spec, ks, rounds, steps, 1, [ks[0], ks[-1]]), timeout_s=1800)[0]
        searches = run_ranks(live_searches, 2, (spec, SEARCHES, 600), timeout_s=1800)[0]
        print(
            f"\n== {name}: {res['layers']} parameterised layers, 2 gloo ranks "
            f"({rounds} rounds x {steps} steps per config, {time.perf_counter() - t0:.0f} s) =="
        )
        rates = res["model"]["rates"]
        print(
            f"measured rates: host copy {rates['copy_gbs']:.1f} GB/s, gloo all-reduce "
            f"{rates['gloo_gbs']:.2f} GB/s + {rates['gloo_latency_us']:.0f} us, chunk launch "
            f"{rates['sync_us']:.0f} us; backward {res['model']['backprop_s'] * 1e3:.1f} ms; "
            f"model's best k = {res['model']['best_chunk']}"
        )
        print(sweep_table(res))
        print()
        print(search_table(searches, res))
    if torch.cuda.is_available():
        # Both ranks share GPU 0 through gloo: each process's own allocator peak.
        configs = [None, {"chunk_size": 1}, {"chunk_size": 1, "offload_optimizer": True}]
        peaks = run_ranks(
            peak_memory, 2, (WORKLOADS["wide"], configs, 3, "cuda:0"), timeout_s=1800
        )[0]
        print("\n== wide on cuda:0, peak device memory per rank ==")
        print(table(["config", "peak MiB"], [[k, f"{v / MiB:.1f}"] for k, v in peaks.items()]))
    else:
        print("\n(no CUDA: peak device memory not measured; host buffer sizes above)")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
