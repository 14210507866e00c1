"""The core memory model against measured peaks: per rank, over a corpus and a spread of layouts.

    .venv/bin/python benchmarks/memory_model.py [--models cnn,gpt,gpt-small,hf-gpt2,resnet]
        [--steps 3] [--device cpu|cuda] [--nproc 2] [--out benchmarks/results/memory_model]

For each model of the corpus (example:cnn; example:gpt at two sizes, 14 M and 6.8 M
parameters; example:hf-gpt2, a Hugging Face GPT-2; a ResNet-18), the facts the model needs
are measured once on one process (``tunekit.observe.memory_facts``, as a study does), and
every configuration of a spread runs for real on 2 ranks (gloo on the CPU, NCCL on GPUs):
DDP and FSDP (resharding after forward or not, CPU offload), checkpointing (none, full,
every 2nd block, selective) and the micro-batch (the job's, or half of it with 2
accumulation steps at the same samples per step). The measured peak of a configuration is
the largest over ranks of each rank's least per-step peak over ``--steps`` steps after one
warm-up step (``Session.memory``: the CPU allocator's events, or CUDA's allocator). The
least, because on the CPU a step's measured peak is an upper bound that now and then still
holds a buffer gloo freed in its own thread (``tunekit.observe.memory``: by up to ~10 MiB on
example:gpt's FSDP steps); the steps of a configuration at a fixed input shape allocate
alike, so the least is the tightest bound.

The prediction of every configuration is calibrated on the measured peak of the workload's
own layout (what ``tunekit auto`` measures as its baseline), as ``Observation.predict_memory``
does. Configurations run interleaved across models (configuration i of every model, then
i + 1). Printed: per configuration predicted (raw and calibrated) against measured, and over
all configurations but the calibration ones the median |error| and the worst
under-prediction. Results go to OUT/memory_model.json and OUT/memory_model.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("TUNEKIT_REUSE_RANKS", "1")  # one start of the ranks for every run

import torch  # noqa: E402

from tunekit.layout import Layout  # noqa: E402
from tunekit.memory import calibrate, format_bytes, predict  # noqa: E402
from tunekit.testing import run_ranks  # noqa: E402
from tunekit.workload import Workload, load_workload  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = {
    "cnn": "example:cnn",
    "gpt": "example:gpt",
    "gpt-small": "example:gpt-sharded",
    "hf-gpt2": "example:hf-gpt2",
    "resnet": f"{HERE / 'workloads.py'}:resnet",
}
FSDP = {"sharding": "fsdp"}
CONFIGS: list[tuple[dict[str, Any], bool]] = [
    # (layout fields, half micro-batch x 2 accumulation)
    ({}, False),
    ({"checkpointing": "full"}, False),
    ({}, True),
    ({"checkpointing": "full"}, True),
    ({"checkpointing": "selective"}, False),
    (FSDP, False),
    ({**FSDP, "checkpointing": "full"}, False),
    (FSDP, True),
    ({**FSDP, "checkpointing": "full", "checkpoint_every": 2}, False),
    ({**FSDP, "reshard_after_forward": False}, False),
    ({**FSDP, "reshard_after_forward": False, "checkpointing": "full"}, False),
    ({**FSDP, "cpu_offload": True}, False),
    ({**FSDP, "checkpointing": "full"}, True),
]


def job(spec: str, batch: int, accumulation: int, layout: dict[str, Any]) -> Workload:
    w = load_workload(spec)
    fields = {**Layout().to_dict(), **layout}
    fields["checkpoint_blocks"] = None
    return replace(w, batch_size=batch, accumulation=accumulation, batch_range=None, **fields)


_NCCL: dict[str, Any] = {}


def _nccl_group(dev: torch.device):
    """An NCCL group for this call's ranks (the ranks' own group is gloo, for CPU tensors),
    its communicator made before anything is measured: made inside a measured step, its
    buffers would count there."""
    import torch.distributed as dist

    key = str(id(dist.group.WORLD))
    if key not in _NCCL:
        _NCCL.clear()
        _NCCL[key] = dist.new_group(backend="nccl")
        dist.all_reduce(torch.ones(1, device=dev), group=_NCCL[key])
        # cuBLAS's workspaces, made once per process, are not the job's either.
        x = torch.ones(64, 64, device=dev, requires_grad=True)
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                (x @ x).sum().backward()
        torch.cuda.synchronize()
    return _NCCL[key]


def _status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def _every_block_its_own_mapping() -> None:
    """glibc: every allocation of 64 KiB or more in its own mapping, returned to the system
    when freed (whichever thread frees it), so the resident set follows live bytes."""
    import ctypes

    M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024)


def measure(
    rank: int,
    world: int,
    spec: str,
    batch: int,
    accumulation: int,
    layout: dict,
    steps: int,
    device: str,
):
    """One configuration on this rank: its peak per step after a warm-up step, and the
    runtime tracker's. CUDA: the allocator's peak above what the kept rank held before.
    CPU: what the session holds at the step's start (counted) plus the step's high-water mark
    of the resident set above its start (``/proc/self/clear_refs``, every block its own
    mapping): what the OS saw, gloo's threads included, the median over the steps; beside it
    the least of the tracker's per-step peaks (each an upper bound: see
    tunekit.observe.memory)."""
    import gc

    import torch.distributed as dist

    from tunekit.runtime.session import Session

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    before = 0
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        group = _nccl_group(dev)
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(dev)
    else:
        _every_block_its_own_mapping()
    w = job(spec, batch, accumulation, layout)
    s = Session(
        w,
        rank=rank,
        world_size=world,
        group=group,
        device=dev,
        track_memory=True,
        layout=w.layout(),
    )
    tracker, seen = [], []
    for i in range(steps + 1):
        if dev.type == "cpu":
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts here
            start, held = _status_bytes("VmRSS"), s.resident_bytes() or 0
        peak = s.train_step().metrics["peak_bytes"]
        if i:
            tracker.append(peak - before)
            if dev.type == "cpu":
                seen.append(held + _status_bytes("VmHWM") - start)
    s.close()
    del s
    gc.collect()  # a session and its strategy refer to each other: free them now
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        return min(tracker), min(tracker)
    return statistics.median(seen), min(tracker)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="ranks (with CUDA: GPUs; one GPU runs FSDP on one rank)",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "memory_model")
    args = ap.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    torch.set_num_threads(1)
    started = time.time()

    from tunekit.observe.memory_facts import measure_memory_facts

    facts, own = {}, {}
    for name in list(names):
        try:
            w = load_workload(MODELS[name])
            facts[name] = measure_memory_facts(w, torch.device(args.device))
        except Exception as exc:  # e.g. another transformers: say so, measure the rest
            print(f"{name}: left out ({type(exc).__name__}: {exc})", flush=True)
            names.remove(name)
            continue
        own[name] = w
        print(f"{name}: facts measured ({len(facts[name].blocks)} blocks)", flush=True)

    rows: list[dict[str, Any]] = []
    runs = [(i, name) for i in range(len(CONFIGS) + 1) for name in names]  # interleaved
    for i, name in runs:
        w = own[name]
        if i == 0:  # the workload's own layout: the calibration point
            layout, half = w.layout().to_dict(), False
        else:
            layout, half = CONFIGS[i - 1]
        acc = 2 if half else 1
        batch = max(1, w.batch_size // acc)
        got = run_ranks(
            measure,
            args.nproc,
            args=(MODELS[name], batch, acc, layout, args.steps, args.device),
            timeout_s=900,
        )
        peaks = [g[0] for g in got]
        rows.append(
            {
                "model": name,
                "calibration": i == 0,
                "layout": Layout().with_changes(layout).describe(),
                "layout_fields": layout,
                "batch": batch,
                "accumulation": acc,
                "measured": max(peaks),
                "tracker": max(g[1] for g in got),
            }
        )
        print(
            f"{name:10s} {rows[-1]['layout']}, batch {batch} x {acc}: {format_bytes(max(peaks))}",
            flush=True,
        )

    # Two measures of the same peaks: the OS's (the truth on the CPU, blind to untouched pages)
    # and the runtime's tracker (what --memory-cap is held against); each calibrates its own.
    for measure_key, suffix in (("measured", ""), ("tracker", "_tracker")):
        for name in names:
            base = next(r for r in rows if r["model"] == name and r["calibration"])
            w = own[name]
            cal = calibrate(
                facts[name],
                w.layout(),
                base[measure_key],
                batch=w.batch_size,
                world_size=args.nproc,
                device_type=args.device,
            )
            for r in rows:
                if r["model"] != name:
                    continue
                lay = Layout().with_changes(r["layout_fields"])
                kw = dict(
                    batch=r["batch"],
                    accumulation=r["accumulation"],
                    world_size=args.nproc,
                    device_type=args.device,
                )
                raw = predict(facts[name], lay, **kw)
                calibrated = predict(facts[name], lay, calibration=cal, **kw)
                truth = r[measure_key]
                r.update(
                    {
                        "raw": raw.peak_bytes,
                        "predicted" + suffix: calibrated.peak_bytes,
                        "error" + suffix: (calibrated.peak_bytes - truth) / truth,
                        "raw_error" + suffix: (raw.peak_bytes - truth) / truth,
                        "moment": calibrated.moment,
                        "parts": dict(calibrated.parts),
                    }
                )

    scored = [r for r in rows if not r["calibration"]]
    summary: dict[str, Any] = {"configurations": len(scored)}
    for suffix in ("", "_tracker"):
        errors = [r["error" + suffix] for r in scored]
        summary["median_abs_error" + suffix] = statistics.median(abs(e) for e in errors)
        summary["worst_under_prediction" + suffix] = min(errors)
        summary["worst_over_prediction" + suffix] = max(errors)
        summary["median_abs_error_raw" + suffix] = statistics.median(
            abs(r["raw_error" + suffix]) for r in rows
        )
    summary.update(device=args.device, nproc=args.nproc, wall_s=time.time() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_model.json").write_text(
        json.dumps({"summary": summary, "rows": rows}, indent=2)
    )
    lines = [
        "| model | layout | batch x acc | measured (OS) | tracker | predicted (raw) | "
        "predicted (calibrated) | error | error vs tracker |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mark = " (calibration)" if r["calibration"] else ""
        lines.append(
            f"| {r['model']} | {r['layout']}{mark} | {r['batch']} x {r['accumulation']} | "
            f"{format_bytes(r['measured'])} | {format_bytes(r['tracker'])} | {format_bytes(r['raw'])} | "
            f"{format_bytes(r['predicted'])} | {r['error']:+.1%} | {r['error_tracker']:+.1%} |"
        )
    lines += [""]
    for suffix, against in (("", "the OS's measure"), ("_tracker", "the runtime tracker's")):
        lines.append(
            f"against {against}: {summary['configurations']} configurations besides the "
            f"calibration ones, median |error| {summary['median_abs_error' + suffix]:.1%}, worst "
            f"under-prediction {summary['worst_under_prediction' + suffix]:+.1%}, worst "
            f"over-prediction {summary['worst_over_prediction' + suffix]:+.1%} (raw model, every "
            f"configuration: median {summary['median_abs_error_raw' + suffix]:.1%})."
        )
    lines.append(f"{args.nproc} rank(s) on {args.device}, {summary['wall_s']:.0f} s.")
    (args.out / "memory_model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
