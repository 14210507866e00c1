"""Per-rank entry points for multi-process checks and benchmarks.

Each is a module-level function ``fn(rank, world, *args)`` for
:func:`tunekit.testing.run_ranks`, so that spawned workers can import it by
name. Workloads travel as ``load_workload`` names.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tunekit.plugins.cgdp.runtime import CgdpSync
from tunekit.runtime.session import Session
from tunekit.workload import load_workload


def _session(spec: str, rank: int, world: int, device: str = "cpu") -> Session:
    return Session(
        load_workload(spec),
        rank=rank,
        world_size=world,
        group=dist.group.WORLD,
        device=torch.device(device),
    )


def _params(session: Session) -> list[torch.Tensor]:
    return [p.detach().clone() for p in session.model.parameters()]


def train_params(
    rank: int,
    world: int,
    spec: str,
    configs: list[dict[str, Any]],
    steps: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Parameters after ``steps`` steps under DDP and under each CGDP config.

    ``configs`` are keyword arguments of :class:`CgdpSync`. Also returns the
    communication records and overlap ratio of each CGDP run's last step, and
    its memory report. ``device`` may be ``"cuda"`` (every rank on one GPU
    with gloo, for the stream path on a one-GPU machine).
    """
    out: dict[str, Any] = {}
    session = _session(spec, rank, world, device)  # the default sync: DDP
    for _ in range(steps):
        session.train_step()
    out["ddp"] = [p.cpu() for p in _params(session)]
    session.close()
    for cfg in configs:
        session = _session(spec, rank, world, device)
        session.set_grad_sync(CgdpSync(**cfg))
        last = None
        for _ in range(steps):
            last = session.train_step()
        label = "cgdp" + "".join(f"_{k}={v}" for k, v in sorted(cfg.items()))
        out[label] = [p.cpu() for p in _params(session)]
        out[label + ":comm"] = last.metrics.get("comm", [])
        out[label + ":overlap_R"] = last.metrics.get("overlap_R")
        out[label + ":memory"] = session.grad_sync.memory_report()
        session.close()
    return out


def train_params_many(
    rank: int, world: int, jobs: list[tuple], device: str = "cpu"
) -> list[dict[str, Any]]:
    """:func:`train_params` for several ``(spec, configs, steps)`` jobs in one set of processes."""
    return [
        train_params(rank, world, spec, configs, steps, device) for spec, configs, steps in jobs
    ]


def live_switch(rank: int, world: int, spec: str, steps: int) -> dict[str, Any]:
    """DDP, then CGDP (offload on), then DDP again in one job: state carries over each switch."""
    from tunekit.config import TuningConfig
    from tunekit.plugins.cgdp.plugin import Cgdp

    tuner = Cgdp()
    reference = _session(spec, rank, world)
    for _ in range(3 * steps):
        reference.train_step()
    session = _session(spec, rank, world)
    losses = []
    for cfg in (None, {"chunk_size": 2, "offload_optimizer": True}, None):
        config = TuningConfig({"cgdp": cfg} if cfg else {})
        session.apply_config(config, {"cgdp": tuner})
        losses += [session.train_step().loss for _ in range(steps)]
    return {"switched": _params(session), "reference": _params(reference), "losses": losses}


def run_search(
    rank: int, world: int, spec: str, knobs: dict[str, Any], max_steps: int
) -> dict[str, Any]:
    """Run the tuner's in-job search; return what it found and the parameters after it."""
    from tunekit.plugins.cgdp.plugin import Cgdp

    tuner = Cgdp()
    session = _session(spec, rank, world)
    full = tuner.validate(knobs)
    tuner.apply(session, full)
    found = tuner.search(session, full, max_steps)
    result = {
        "knobs": found.knobs,
        "trace": found.trace,
        "summary": found.summary,
        "installed": session.grad_sync.chunk_size,
        "steps": session.step,
        "params": _params(session),
    }
    session.close()
    return result


# -- benchmark ------------------------------------------------------------------------------------


def _timed(session: Session, steps: int) -> list[float]:
    return [session.train_step().step_s for _ in range(steps)]


def _slowest(times: list[float], group) -> list[float]:
    """Per step, the slowest rank's time (the job's pace)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def sweep(
    rank: int,
    world: int,
    spec: str,
    chunk_sizes: list[int],
    rounds: int,
    steps: int,
    warmup: int,
    offload_chunks: list[int],
) -> dict[str, Any]:
    """Median step time of DDP and of CGDP at each chunk size, interleaved round-robin.

    One session per config is kept alive, so each round runs every config
    for ``steps`` steps after ``warmup`` unmeasured ones; drift hits all.
    """
    group = dist.group.WORLD
    configs: dict[str, Session] = {}
    configs["ddp"] = _session(spec, rank, world)
    for k in chunk_sizes:
        s = _session(spec, rank, world)
        s.set_grad_sync(CgdpSync(chunk_size=k))
        configs[f"k={k}"] = s
    for k in offload_chunks:
        s = _session(spec, rank, world)
        s.set_grad_sync(CgdpSync(chunk_size=k, offload_optimizer=True))
        configs[f"k={k}+offload"] = s
    model = _model_prediction(configs["ddp"], group, chunk_sizes)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    overlap: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, s in configs.items():
            _timed(s, warmup)
            times = []
            for _ in range(steps):
                rec = s.train_step()
                times.append(rec.step_s)
                if rec.metrics.get("overlap_R") is not None:
                    overlap[name].append(rec.metrics["overlap_R"])
            samples[name] += _slowest(times, group)
    out: dict[str, Any] = {
        "median_s": {},
        "iqr_s": {},
        "overlap_R": {},
        "memory": {},
        "layers": None,
        "model": model,
    }
    for name, s in configs.items():
        xs = sorted(samples[name])
        out["median_s"][name] = statistics.median(xs)
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        out["iqr_s"][name] = q[2] - q[0]
        out["overlap_R"][name] = statistics.median(overlap[name]) if overlap[name] else None
        if isinstance(s.grad_sync, CgdpSync):
            out["memory"][name] = s.grad_sync.memory_report()
            out["layers"] = s.grad_sync.num_layers
        s.close()
    return out


def _model_prediction(session: Session, group, chunk_sizes: list[int]) -> dict[str, Any]:
    """The cost model fed with this job's measured layer times and this machine's rates."""
    from tunekit.plugins.cgdp.measure import measure_host_rates, time_layer_backward
    from tunekit.plugins.cgdp.model import predict

    inputs, targets = session.data.batch(0)
    model = session.workload.model().to(session.device)  # a bare copy: no DDP hooks on it
    times = time_layer_backward(model, inputs, targets, session.workload.loss, repeats=5)
    rates = measure_host_rates(session.device, session.world_size, group)

    def peer(nbytes: float) -> float:  # CPU ranks: DDP reduces through the same gloo
        return rates.reduce_latency + nbytes / rates.reduce_bw

    pred = predict(times.t_bp, times.nbytes, rates, peer, chunk_sizes)
    return {
        "backprop_s": pred.backprop_s,
        "ddp_s": pred.ddp_s,
        "typical_s": pred.typical_s,
        "cgdp_s": pred.cgdp_s,
        "cgdp_paper_s": pred.cgdp_paper_s,
        "best_chunk": pred.best_chunk,
        "rates": {
            "copy_gbs": rates.d2h_bw / 1e9,
            "gloo_gbs": rates.reduce_bw / 1e9,
            "gloo_latency_us": rates.reduce_latency * 1e6,
            "sync_us": rates.sync_s * 1e6,
        },
    }


def live_searches(
    rank: int, world: int, spec: str, searches: list[dict[str, Any]], max_steps: int
) -> list[dict[str, Any]]:
    """Each search (``{"search": "paper"|"noise_aware", ...knobs}``) in a fresh job; wall time too."""
    from tunekit.plugins.cgdp.plugin import Cgdp

    tuner = Cgdp()
    results = []
    for knobs in searches:
        session = _session(spec, rank, world)
        full = tuner.validate(knobs)
        tuner.apply(session, full)
        t0 = time.perf_counter()
        found = tuner.search(session, full, max_steps)
        results.append(
            {
                "knobs": knobs,
                "chunk": found.knobs["chunk_size"],
                "intervals": len(found.trace),
                "steps": sum(t["steps"] for t in found.trace),
                "wall_s": time.perf_counter() - t0,
                "summary": found.summary,
                "trace": found.trace,
            }
        )
        session.close()
    return results


def peak_memory(
    rank: int, world: int, spec: str, configs: list[dict[str, Any] | None], steps: int, device: str
) -> dict[str, int]:
    """Peak device bytes of DDP (``None``) and of each CGDP config, run one after another (CUDA)."""
    out: dict[str, int] = {}
    for cfg in configs:
        session = _session(spec, rank, world, device)
        if cfg is not None:
            session.set_grad_sync(CgdpSync(**cfg))
        session.train_step()  # optimizer state exists from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            session.train_step()
        torch.cuda.synchronize()
        label = (
            "ddp" if cfg is None else "cgdp" + "".join(f"_{k}={v}" for k, v in sorted(cfg.items()))
        )
        out[label] = torch.cuda.max_memory_allocated()
        session.close()
        del session
        torch.cuda.empty_cache()
    return out
