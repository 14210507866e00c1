"""Regenerate the committed traces: real 2-rank gloo runs of example:cnn on this machine.

    .venv/bin/python tests/data/traces/make_traces.py

* ``cnn_gloo_2rank/``: a trial from the real launcher (``profile_steps=3``, 3 profiled
  steps): ``traces/rank<R>.json.gz`` and ``rank<R>.json`` (per-step times). Its
  traces carry no step markers; the breakdown finds steps from the forward
  markers and the measured data time.
* ``cnn_gloo_2rank_marked/``: the same job through ``Session`` with a scheduled
  profiler (``ProfilerStep#N`` ranges) and ``tunekit.data`` / ``tunekit.forward``
  annotations around the loop's phases.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def _write(dest: Path, rank: int, trace_path: Path, result: dict) -> None:
    (dest / "traces").mkdir(parents=True, exist_ok=True)
    with (
        open(trace_path, "rb") as src,
        gzip.open(dest / "traces" / f"rank{rank}.json.gz", "wb") as out,
    ):
        shutil.copyfileobj(src, out)
    keep = {k: result[k] for k in ("rank", "world_size", "backend", "step_s", "data_s", "loss")}
    (dest / f"rank{rank}.json").write_text(json.dumps(keep, indent=1) + "\n")


def from_launcher(dest: Path) -> None:
    from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync

    with tempfile.TemporaryDirectory() as tmp:
        spec = TrialSpec(workload="example:cnn", warmup=2, steps=3, profile_steps=3)
        out = run_trial_sync(spec, LaunchOptions(nproc=2, timeout_s=180), Path(tmp))
        if not out.ok:
            sys.exit(f"trial failed: {out.status}: {out.error}")
        for r in range(2):
            _write(
                dest,
                r,
                Path(tmp) / "traces" / f"rank{r}.json",
                json.loads((Path(tmp) / f"rank{r}.json").read_text()),
            )


def marked_rank(rank: int, world: int, out_dir: str, warmup: int, steps: int) -> dict:
    """One rank: Session steps with phase annotations under a scheduled profiler."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    from tunekit.runtime.session import Session
    from tunekit.workload import load_workload

    session = Session(
        load_workload("example:cnn"), rank=rank, world_size=world, group=dist.group.WORLD
    )
    result = {
        "rank": rank,
        "world_size": world,
        "backend": "gloo",
        "step_s": [],
        "data_s": [],
        "loss": [],
    }

    def step():
        start = time.perf_counter()
        with record_function("tunekit.data"):
            inputs, targets = session.data.batch(session.step)
        data_s = time.perf_counter() - start
        sync = session.grad_sync
        with record_function("tunekit.forward"):
            sync.before_forward()
            loss = session.workload.loss(sync.module(inputs), targets)
        with record_function("tunekit.backward"):
            loss.backward()
        sync.step(session.optimizer)
        session.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        session.step += 1
        return time.perf_counter() - start, data_s, value

    for _ in range(warmup):
        step()
    sched = schedule(wait=0, warmup=0, active=steps + 1, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, record_shapes=False) as prof:
        for _ in range(steps):
            s, d, loss = step()
            prof.step()
            result["step_s"].append(s)
            result["data_s"].append(d)
            result["loss"].append(loss)
    path = Path(out_dir) / f"rank{rank}.trace.json"
    prof.export_chrome_trace(str(path))
    session.close()
    return result


def marked(dest: Path) -> None:
    from tunekit.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(marked_rank, 2, (tmp, 2, 3))
        for r, res in enumerate(results):
            _write(dest, r, Path(tmp) / f"rank{r}.trace.json", res)


if __name__ == "__main__":
    from_launcher(HERE / "cnn_gloo_2rank")
    # run_ranks needs an importable function: import this file as a module by path.
    sys.path.insert(0, str(HERE))
    import make_traces

    make_traces.marked(HERE / "cnn_gloo_2rank_marked")
    for p in sorted(HERE.rglob("*")):
        if p.is_file():
            print(f"{p.stat().st_size:>8}  {p.relative_to(HERE)}")
