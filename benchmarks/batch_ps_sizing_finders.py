"""Batch-size finders side by side: tunekit's batch_ps_sizing against what users reach for today.

    .venv/bin/python benchmarks/batch_ps_sizing_finders.py [--budget-mib 160] [--only NAME ...]

Finders, all on the same workload (tunekit's example CNN, 3x32x32 images,
SGD with momentum, per-rank batch 32 allowed in [8, 8192], linear lr scaling):

* ``lightning power``      ``lightning.pytorch.tuner.Tuner.scale_batch_size(mode="power")``:
  double from 8 until an out-of-memory error, keep the last batch that ran;
* ``lightning binsearch``  the same, then binary search between the last success and the failure
  (Lightning's default 5 % margin taken off the result);
* ``accelerate``           ``accelerate.utils.find_executable_batch_size``: start at 8192, multiply
  by 0.9 after every out-of-memory error until the training function runs;
* ``tunekit memory model`` no trial at all: the memory line measured at batches 8 and 32
  (allocator peaks via ``torch.profiler``) extrapolated to the largest batch that leaves
  10 % of the bound free;
* ``tunekit sweep``        the tuner's in-job search (``coordinated_sweep``, the one the
  ``search`` hook runs): probe each batch of the ladder 8, 16, ... 8192 without collectives,
  back off at the first out-of-memory error, time the rest, keep the throughput knee (5 %).

THE MEMORY BOUND. A CPU has no device memory to run out of, so every finder runs in a
fresh process whose address space is capped with ``setrlimit(RLIMIT_AS)`` at what it uses
after a warm-up step plus ``--budget-mib``: allocations past the cap fail for real with
the CPU allocator's ``DefaultCPUAllocator: can't allocate memory``, which Lightning and
accelerate both recognise as out of memory. So that the cap measures live tensors, glibc
gets a fixed mmap threshold (every buffer >= 64 KiB is its own mapping, unmapped when
freed) and one arena, and oneDNN and NNPACK are off (they reserve scratch memory outside
torch's allocator and fail with other errors than the allocator's). Each process uses one thread.

THROUGHPUT is measured the same way for every chosen batch, after the finder, in the same
process and under the same cap: a plain training loop on synthetic batches, 5 timed steps,
median; per second of wall time and per CPU-second of the process (one thread, so on an
idle machine the two agree; on a shared one the CPU figure is the one not distorted by
other processes; the sweep itself times wall clock, as a real job must). "trials" counts distinct batch sizes tried (out-of-memory failures in brackets);
"steps" the training steps (or probes) run; "search s" the finder's wall time.

Benchmark-only dependencies: benchmarks/requirements.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

FINDERS = ("lightning-power", "lightning-binsearch", "accelerate", "tunekit-model", "tunekit-sweep")
RANGE = (8, 8192)
START = 32
MARGIN = 0.1
TOLERANCE = 0.05


# -- inside one finder's process ----------------------------------------------------------


def _workload():
    from tunekit.examples.cnn import build_model, make_batch
    from tunekit.workload import Workload

    return Workload(
        name="cnn-wide",
        model=build_model,
        make_batch=make_batch,
        batch_size=START,
        lr=0.02,
        lr_scaling="linear",
        batch_range=RANGE,
    )


def _vm_size() -> int:
    return (
        int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    )


def _cap_memory(budget: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + budget, resource.RLIM_INFINITY))


def _train_step(workload, model, optimizer, batch: int) -> None:
    x, y = workload.make_batch(batch, __import__("torch").Generator().manual_seed(batch))
    loss = workload.loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _throughput(workload, model, optimizer, batch: int, steps: int = 5) -> dict:
    """Median samples per second of wall time and per CPU-second of this (one-thread) process."""
    _train_step(workload, model, optimizer, batch)  # warm-up
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        _train_step(workload, model, optimizer, batch)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {"wall": batch / statistics.median(wall), "cpu": batch / statistics.median(cpu)}


def _lightning(workload, budget: int, mode: str) -> dict:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader, Dataset

    class Synthetic(Dataset):
        def __len__(self):
            return 65536

        def __getitem__(self, i):
            x, y = workload.make_batch(1, torch.Generator().manual_seed(i))
            return x[0], y[0]

    tries: list[int] = []
    done: list[int] = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = workload.model()
            self.batch_size = RANGE[0]

        def train_dataloader(self):
            return DataLoader(Synthetic(), batch_size=self.batch_size)

        def training_step(self, batch, _idx):
            x, y = batch
            tries.append(x.shape[0])
            return workload.loss(self.net(x), y)

        def on_train_batch_end(self, _out, batch, _idx):
            done.append(batch[0].shape[0])

        def configure_optimizers(self):
            return workload.optimizer(self.net.parameters(), workload.lr)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir="/tmp/tunekit-bench-lightning",
    )
    _cap_memory(budget)
    start = time.perf_counter()
    chosen = Tuner(trainer).scale_batch_size(
        module, mode=mode, init_val=RANGE[0], steps_per_trial=3, max_val=RANGE[1]
    )
    elapsed = time.perf_counter() - start
    sizes = _runs(tries)
    failed = [b for b in sizes if done.count(b) < tries.count(b)]
    opt = workload.optimizer(module.net.parameters(), workload.lr)
    return {
        "batch": chosen,
        "trials": len(sizes),
        "ooms": len(failed),
        "steps": len(tries),
        "search_s": elapsed,
        "throughput": _throughput(workload, module.net, opt, chosen),
    }


def _runs(seq: list[int]) -> list[int]:
    """Distinct consecutive values: the batch sizes tried, in order."""
    return [b for i, b in enumerate(seq) if i == 0 or seq[i - 1] != b]


def _accelerate(workload, budget: int) -> dict:
    from accelerate.utils import find_executable_batch_size

    model = workload.model()
    opt = workload.optimizer(model.parameters(), workload.lr)
    _train_step(workload, model, opt, RANGE[0])
    tries: list[int] = []
    steps = [0]

    @find_executable_batch_size(starting_batch_size=RANGE[1])
    def train(batch_size):
        tries.append(batch_size)
        for _ in range(3):
            _train_step(workload, model, opt, batch_size)
            steps[0] += 1
        return batch_size

    _cap_memory(budget)
    start = time.perf_counter()
    chosen = train()
    elapsed = time.perf_counter() - start
    return {
        "batch": chosen,
        "trials": len(tries),
        "ooms": len(tries) - 1,
        "steps": steps[0] + len(tries) - 1,
        "search_s": elapsed,
        "throughput": _throughput(workload, model, opt, chosen),
    }


def _tunekit_model(workload, budget: int) -> dict:
    from tunekit.plugins.batch_ps_sizing.measure import measure_locally
    from tunekit.plugins.batch_ps_sizing.model import MemoryProfile

    model = workload.model()
    opt = workload.optimizer(model.parameters(), workload.lr)
    _train_step(workload, model, opt, RANGE[0])
    _cap_memory(budget)
    start = time.perf_counter()
    local = measure_locally(workload, (8, 32), timed_steps=1)
    # The cap already holds this process's parameters and optimizer state: the step's
    # extra peak is what must fit in the budget.
    extra = MemoryProfile(
        0.0, local.memory.transient_bytes, local.memory.per_sample_bytes, local.memory.method
    )
    chosen = min(RANGE[1], max(RANGE[0], extra.largest_batch(budget, MARGIN)))
    elapsed = time.perf_counter() - start
    del local
    try:
        thr = _throughput(workload, model, opt, chosen)
    except RuntimeError as exc:
        if "can't allocate memory" not in str(exc):
            raise
        thr = None  # the prediction did not fit after all
    return {
        "batch": chosen,
        "trials": 2,
        "ooms": 0,
        "steps": 2 * 2 + 1 + 2,
        "search_s": elapsed,
        "throughput": thr,
    }


def _tunekit_sweep(workload, budget: int) -> dict:
    from tunekit.plugins.batch_ps_sizing.runtime import probe_batch
    from tunekit.plugins.batch_ps_sizing.search import (
        SweepSettings,
        batch_ladder,
        coordinated_sweep,
    )
    from tunekit.runtime.session import Session

    session = Session(workload)
    session.train_step()
    _cap_memory(budget)
    settings = SweepSettings(
        knee_tolerance=TOLERANCE, warmup_steps=1, measure_steps=3, noise_scale_batches=0
    )
    start = time.perf_counter()
    outcome = coordinated_sweep(session, batch_ladder(START, RANGE), settings, 400, probe_batch)
    elapsed = time.perf_counter() - start
    tried = [p for p in outcome.points if p.status != "budget"]
    return {
        "batch": outcome.batch,
        "trials": len(tried),
        "ooms": sum(p.status == "oom" for p in tried),
        "steps": outcome.steps_used,
        "search_s": elapsed,
        "throughput": _throughput(workload, session.model, session.optimizer, outcome.batch),
        "curve": {p.batch: round(p.samples_per_s) for p in tried if p.status == "ok"},
        "lr": session.lr,
    }


def run_one(name: str, budget: int) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)
    workload = _workload()
    if name == "lightning-power":
        return _lightning(workload, budget, "power")
    if name == "lightning-binsearch":
        return _lightning(workload, budget, "binsearch")
    if name == "accelerate":
        return _accelerate(workload, budget)
    if name == "tunekit-model":
        return _tunekit_model(workload, budget)
    return _tunekit_sweep(workload, budget)


# -- the driver -----------------------------------------------------------------------------


def _child(name: str, budget_mib: int) -> dict:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MALLOC_ARENA_MAX": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--child", name, "--budget-mib", str(budget_mib)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:160]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--budget-mib", type=int, default=160, help="memory cap above the warmed-up process"
    )
    ap.add_argument("--only", nargs="*", choices=FINDERS, help="run only these finders")
    ap.add_argument("--child", choices=FINDERS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.budget_mib * 2**20)))
        return
    names = args.only or FINDERS
    print(
        f"workload: example CNN, batch {START} allowed in {list(RANGE)}; memory cap {args.budget_mib} MiB "
        "(RLIMIT_AS above a warmed-up process); 1 thread per process\n"
    )
    header = (
        f"{'finder':22} {'batch':>6} {'trials (OOM)':>13} {'steps':>6} {'search s':>9} "
        f"{'samples/s':>10} {'samples/CPU-s':>14}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for name in names:
        r = _child(name, args.budget_mib)
        results[name] = r
        if "error" in r:
            print(f"{name:22} failed: {r['error']}")
            continue
        thr = r["throughput"]
        rates = f"{thr['wall']:10.0f} {thr['cpu']:14.0f}" if thr else f"{'OOM':>10} {'OOM':>14}"
        trials = f"{r['trials']} ({r['ooms']})"
        print(
            f"{name:22} {r['batch']:>6} {trials:>13} {r['steps']:>6} {r['search_s']:>9.1f} {rates}"
        )
    sweep = results.get("tunekit-sweep", {})
    if "curve" in sweep:
        print(
            "\ntunekit sweep, samples/s per batch:",
            sweep["curve"],
            f"-> knee {sweep['batch']} (lr scaled to {sweep['lr']:.4g})",
        )


if __name__ == "__main__":
    main()
