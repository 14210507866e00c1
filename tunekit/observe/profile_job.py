"""``tunekit profile``: observe one workload end to end and write what was seen.

:func:`profile_job` runs, in order:

1. the model graph (:func:`~tunekit.observe.graph.trace_model`) at the
   workload's per-rank batch;
2. the layer profile (:func:`~tunekit.observe.layer_profile.profile_layers`) on
   the CPU or GPU 0;

   both in a child process (:mod:`tunekit.observe.workload_process`), never in
   tunekit's own: a workload that segfaults, hangs or exits while it is built
   fails in one line (:class:`ObservationFailed`, under ``timeout_s``), its
   output kept in ``observe.log``;
3. a profiled multi-rank trial (the trial launcher, ``profile_steps``) while the
   telemetry sampler watches the ranks (pids from the trial's ``pids/`` folder);
4. the step breakdown of that trial's traces
   (:func:`~tunekit.observe.breakdown.analyze_trial`).

It returns a JSON-able report and writes into ``out_dir``: ``profile.json``
(the report), ``telemetry.json`` (the full time series), and the trial folder
``trial/`` whose ``traces/rank<R>.json`` open in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from tunekit.errors import WorkloadError
from tunekit.observe.blocks import profile_blocks
from tunekit.observe.breakdown import analyze_trial
from tunekit.observe.graph import ModelGraph
from tunekit.observe.layer_profile import LayerProfile
from tunekit.observe.telemetry import TelemetrySampler
from tunekit.observe.workload_process import (
    OBSERVE_LOG,
    ObservationFailed,
    WorkloadProcess,
    observe_call,
)
from tunekit.workload import resolve_spec

StageFn = Callable[[str], None]


@dataclass
class ProfileOptions:
    """What ``tunekit profile`` runs."""

    nproc: int = 2
    """Ranks of the profiled trial."""
    steps: int = 3
    """Measured (profiled) steps; traces grow with each, keep it small."""
    warmup: int = 5
    """Unprofiled steps before them (py-spy samples them too)."""
    out_dir: Path = Path("tunekit-profile")
    device: str = "auto"
    """``auto``, ``cpu`` or ``cuda`` for the trial's ranks."""
    layer_repeats: int = 3
    """Timed runs per layer in the layer profile (after one warm-up)."""
    top_layers: int = 10
    telemetry_interval_s: float = 0.25
    pyspy_interval_s: float = 0.5
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError("nproc and steps must be at least 1, warmup at least 0")
        self.out_dir = Path(self.out_dir)


def profile_job(
    workload: str, options: ProfileOptions, on_stage: StageFn | None = None
) -> dict[str, Any]:
    """Profile ``workload``; see the module docstring. Bad input raises a TunekitError."""
    from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync

    stage = on_stage or (lambda _msg: None)
    spec = resolve_spec(workload)
    out = options.out_dir
    out.mkdir(parents=True, exist_ok=True)
    notices: list[str] = []
    device = "cuda" if options.device != "cpu" and torch.cuda.is_available() else "cpu"
    try:
        graph, layers = asyncio.run(_observe(spec, device, options, stage, notices))
    except ObservationFailed as exc:
        raise ObservationFailed(
            exc.status, f"could not observe {spec} ({exc.status}): {exc}"
        ) from None

    stage(f"profiled run on {options.nproc} rank(s)")
    trial_dir = out / "trial"
    shutil.rmtree(trial_dir / "pids", ignore_errors=True)  # stale pids of an earlier run
    trial = TrialSpec(
        workload=spec,
        warmup=options.warmup,
        steps=options.steps,
        profile_steps=options.steps,
        device=options.device,
    )
    launch = LaunchOptions(nproc=options.nproc, timeout_s=options.timeout_s)
    sampler = TelemetrySampler(
        trial_dir / "pids",
        interval_s=options.telemetry_interval_s,
        pyspy_interval_s=options.pyspy_interval_s,
    )
    started = time.perf_counter()
    with sampler:
        outcome = run_trial_sync(trial, launch, trial_dir)
    wall_s = time.perf_counter() - started
    notices.extend(sampler.notices)
    if not outcome.ok:
        raise WorkloadError(
            f"the profiled run of {spec} failed ({outcome.status}): {outcome.error}"
        )

    stage("analysing the traces")
    breakdown = analyze_trial(trial_dir)
    telemetry = sampler.to_dict()
    (out / "telemetry.json").write_text(json.dumps(telemetry))
    traces = sorted(str(p) for p in (trial_dir / "traces").glob("rank*.json*"))
    report = {
        "workload": spec,
        "nproc": options.nproc,
        "device": device,
        "steps": options.steps,
        "wall_s": wall_s,
        "graph": graph.summary(),
        "top_layers": [
            {
                **vars(t),
                "flops": graph.layers[t.name].flops,
                "output_shape": graph.layers[t.name].output_shape,
            }
            for t in (layers.top(options.top_layers) if layers is not None else [])
        ],
        "blocks": profile_blocks(graph, layers),
        "layer_profile": layers.to_dict() if layers is not None else None,
        "layer_labels": graph.layer_labels(),
        "measurement": outcome.measurement.to_dict() if outcome.measurement else None,
        "breakdown": breakdown.to_dict(),
        "telemetry": telemetry["summary"],
        "notices": notices,
        "files": {
            "report": str(out / "profile.json"),
            "telemetry": str(out / "telemetry.json"),
            "traces": traces,
        },
    }
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    return report


async def _observe(
    spec: str, device: str, options: ProfileOptions, stage: StageFn, notices: list[str]
) -> tuple[ModelGraph, LayerProfile | None]:
    """The graph and layer times, from the workload's own process (ended before this returns)."""
    async with WorkloadProcess(options.out_dir / OBSERVE_LOG, options.timeout_s) as child:
        stage("tracing the model graph")
        seen = await observe_call(child, "observe", "building and tracing the model", workload=spec)
        graph = ModelGraph.from_dict(seen["graph"])
        if graph.notice:
            notices.append(graph.notice)
        stage("timing each layer")
        timed = await observe_call(
            child,
            "profile_layers",
            "timing the model's layers",
            device=device,
            # At the threads each rank of the trial gets (the launcher's rule), so that the
            # layers add up to a rank's step: all cores' threads per layer overstate it.
            threads=max(1, (psutil.cpu_count(logical=False) or 1) // options.nproc)
            if device == "cpu"
            else None,
            repeats=options.layer_repeats,
        )
    if not timed["layer_profile"]:
        notices.append(timed["notice"])
        return graph, None
    return graph, LayerProfile.from_dict(timed["layer_profile"])
