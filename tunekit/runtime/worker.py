"""The trial worker: what each rank runs under torchrun.

    python -m torch.distributed.run ... -m tunekit.runtime.worker TRIAL_DIR/spec.json

It rebuilds the workload by name, joins the process group (gloo on CPU, NCCL
on GPU), applies the config through the tuners' runtime hooks, optionally
runs a tuner's in-job search, then runs warm-up and measured steps. Files it
writes into the trial directory (the spec's folder):

* ``pids/rank<R>``     its pid, as soon as it starts (telemetry samples it);
* ``progress.jsonl``   rank 0, one line per step (the launcher's progress bars);
* ``rank<R>.json``     its result: status, per-step times and losses, metrics;
* ``faults/rank<R>.txt``  its Python stack if it dies of a fatal signal (SIGSEGV ...);
* ``traces/rank<R>.json``  a torch.profiler Chrome trace of ``profile_steps`` extra steps.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunekit.config import TuningConfig, config_layout, resolve
from tunekit.plugin_loading import load_named, select
from tunekit.runtime.dist import ensure_group, init_from_env
from tunekit.runtime.session import Session, StepRecord
from tunekit.trials.exits import enable_fault_report, is_oom
from tunekit.workload import load_workload


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak resident memory (CPU) or the device allocator's peak (CUDA)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class _Progress:
    """Rank 0's step log, read by the launcher while the trial runs."""

    def __init__(self, path: Path, enabled: bool):
        self.file = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115

    def write(
        self, phase: str, index: int, total: int, rec: StepRecord | None = None, **extra
    ) -> None:
        if self.file is None:
            return
        line: dict[str, Any] = {"phase": phase, "index": index, "total": total, "t": time.time()}
        if rec is not None:
            line.update(step=rec.step, step_s=rec.step_s, loss=rec.loss)
        line.update(extra)
        self.file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def run(spec: dict[str, Any], trial_dir: Path) -> int:
    # A rank that dies of a signal writes no result file; this says where it died.
    enable_fault_report(trial_dir / "faults" / f"rank{os.environ.get('RANK', '0')}.txt")
    ctx = init_from_env(
        spec.get("device", "auto"), timeout_s=float(spec.get("collective_timeout_s", 300))
    )
    (trial_dir / "pids").mkdir(exist_ok=True)
    (trial_dir / "pids" / f"rank{ctx.rank}").write_text(str(os.getpid()))
    progress = _Progress(trial_dir / "progress.jsonl", enabled=ctx.rank == 0)
    result: dict[str, Any] = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "pid": os.getpid(),
        "device": str(ctx.device),
        "backend": ctx.backend,
        "status": "error",
        "error": "",
        "step_s": [],
        "data_s": [],
        "loss": [],
        "metrics": [],
        "search": None,
        "config": None,
    }
    session = None
    try:
        workload = load_workload(spec["workload"])
        config = TuningConfig.from_dict(spec.get("config") or {})
        names = sorted(config.plugins)
        tuners = select(load_named(names), names) if names else {}
        # The config's layout is built in from the start: sharding precedes the optimizer.
        layout = config_layout(resolve(config, tuners), workload.layout())
        if layout.sharded:
            ctx = ensure_group(ctx)
        cap = spec.get("memory_cap_bytes")
        session = Session(
            workload,
            rank=ctx.rank,
            world_size=ctx.world_size,
            local_rank=ctx.local_rank,
            device=ctx.device,
            group=ctx.group,
            backend=ctx.backend,
            seed=spec.get("seed"),
            layout=layout,
            memory_cap_bytes=int(cap) if cap is not None else None,
            track_memory=bool(spec.get("measure_memory", True)),
        )
        session.apply_config(config, tuners)
        search = spec.get("search")
        if search:
            result["search"] = _run_search(session, config, tuners, search, progress)
        result["config"] = session.config.to_dict()
        _train(session, spec, progress, result, trial_dir)
        if probe := spec.get("probe"):  # after every timed step: it measures nothing of them
            result["probe"] = _probe(ctx, probe)
        result["status"] = "ok"
    except BaseException as exc:  # report every failure in the result file, then exit non-zero
        result["status"] = "oom" if is_oom(exc) else "error"
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if session is not None:
            result["peak_memory_bytes"] = peak_memory_bytes(session.device)
            result["peak_bytes"] = session.memory.max
            result["memory_method"] = session.memory.method or None
            result["layout"] = session.layout.to_dict()
            result["batch_size"] = session.batch_size
            result["global_batch"] = session.global_batch
        progress.close()
        tmp = trial_dir / f"rank{ctx.rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(trial_dir / f"rank{ctx.rank}.json")
    if result["status"] == "ok" and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if result["status"] == "ok" else 1


def _probe(ctx, probe: dict[str, Any]) -> dict[str, Any]:
    """This machine's collectives timed in the trial's group (``TrialSpec.probe``); a probe
    that fails is said in the result, and the trial's measurement stands."""
    from tunekit.observe.probe import sweep_rank

    start = time.monotonic()
    try:
        out = sweep_rank(
            ctx.rank, ctx.world_size, probe["sizes"], probe["repeats"], ctx.device.type == "cuda"
        )
    except Exception as exc:  # noqa: BLE001 - the study probes again on its own
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {**out, "wall_s": time.monotonic() - start}


def _run_search(session: Session, config: TuningConfig, tuners, search: dict, progress: _Progress):
    name = search["plugin"]
    tuner = tuners[name]  # the orchestrator puts the searching tuner in the config
    knobs = {t.name: k for t, k in resolve(config, tuners)}[name]
    progress.write("search", 0, int(search.get("max_steps", 0)))
    found = tuner.search(session, knobs, int(search.get("max_steps", 200)))
    if found is None:
        return None
    chosen = TuningConfig({**config.plugins, name: tuner.validate(found.knobs)})
    session.apply_config(chosen, tuners)
    return {
        "knobs": found.knobs,
        "trace": found.trace,
        "summary": found.summary,
        "details": found.details,
    }


def _train(
    session: Session, spec: dict, progress: _Progress, result: dict, trial_dir: Path
) -> None:
    warmup, steps = int(spec.get("warmup", 3)), int(spec.get("steps", 10))
    for i in range(warmup):
        progress.write("warmup", i + 1, warmup, session.train_step())
    if session.memory.cap_bytes is None and session.device.type == "cpu":
        # The warm-up showed this configuration's peak; measured steps run unwatched unless
        # a cap must hold on every step.
        session.memory.stop()
    for i in range(steps):
        rec = session.train_step()
        result["step_s"].append(rec.step_s)
        result["data_s"].append(rec.data_s)
        result["loss"].append(rec.loss)
        result["metrics"].append(rec.metrics)
        progress.write("measure", i + 1, steps, rec)
    profiled = int(spec.get("profile_steps", 0))
    if profiled:
        session.memory.stop()  # one profiler at a time
        # After the measured steps, so profiler overhead never touches the measurement.
        result["profiled"] = _profile(session, profiled, progress, trial_dir)
    session.flush()


def _profile(
    session: Session, steps: int, progress: _Progress, trial_dir: Path
) -> dict[str, list[float]]:
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU]
    if session.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out: dict[str, list[float]] = {"step_s": [], "data_s": []}
    # active=steps+1 keeps recording through the last step() so each step gets a ProfilerStep#N.
    with profile(
        activities=activities,
        record_shapes=False,
        with_stack=False,
        schedule=schedule(wait=0, warmup=0, active=steps + 1),
    ) as prof:
        for i in range(steps):
            rec = session.train_step()
            prof.step()
            out["step_s"].append(rec.step_s)
            out["data_s"].append(rec.data_s)
            progress.write("profile", i + 1, steps, rec)
    (trial_dir / "traces").mkdir(exist_ok=True)
    prof.export_chrome_trace(str(trial_dir / "traces" / f"rank{session.rank}.json"))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tunekit.runtime.worker TRIAL_DIR/spec.json", file=sys.stderr)
        return 2
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    return run(spec, spec_path.parent)


if __name__ == "__main__":
    sys.exit(main())
