"""Observations of the small GPT for the tuner's tests, with injected measurements.

The model and its graph are real (traced here); its memory facts were measured once with
``tunekit.observe.memory_facts`` and recorded in ``data/gpt_small_memory_facts.json``
(re-record with :func:`record_memory_facts` when the model changes; a test checks they
still match it). What depends on timing is injected: the layer profile (each layer's time proportional to its FLOPs), the step line of
:mod:`~tunekit.plugins.sharding.measure`, the collectives, the measured baseline and its
breakdown.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

from tunekit.api import (
    Measurement,
    MemoryFacts,
    Observation,
    model_blocks,
    summarize_model,
    trace_model,
)
from tunekit.hardware import CollectiveFit
from tunekit.observe.layer_profile import LayerProfile, LayerTiming
from tunekit.plugins.sharding.measure import PassLine, fsdp_overhead_key, pass_line_key
from tunekit.plugins.sharding.tests.workloads_sharding import gpt_ddp, gpt_sharded
from tunekit.testing import MemoryCache, synthetic_breakdown, tiny_hardware

SPECS = {
    "ddp": "tunekit.plugins.sharding.tests.workloads_sharding:gpt_ddp",
    "sharded": "tunekit.plugins.sharding.tests.workloads_sharding:gpt_sharded",
}
MiB = 2**20
FACTS = Path(__file__).parent / "data" / "gpt_small_memory_facts.json"


def recorded_memory_facts() -> MemoryFacts:
    return MemoryFacts.from_dict(json.loads(FACTS.read_text()))


def record_memory_facts() -> MemoryFacts:
    """Measure the small GPT's memory facts here and record them (tens of seconds)."""
    from tunekit.observe.memory_facts import measure_memory_facts

    facts = measure_memory_facts(gpt_ddp())
    FACTS.write_text(json.dumps(facts.to_dict(), indent=1) + "\n")
    return facts


@functools.cache
def _static(kind: str):
    workload = {"ddp": gpt_ddp, "sharded": gpt_sharded}[kind]()
    model = workload.model()
    example = workload.example_batch(workload.batch_size)[0]
    graph = trace_model(model, example)
    summary = summarize_model(model, example)
    facts = recorded_memory_facts()  # the layout does not change them: measured unsharded
    return workload, graph, summary, facts, model_blocks(model)


def layer_profile(graph, batch: int, seconds_per_flop: float = 2e-11) -> LayerProfile:
    """Each layer's forward time proportional to its FLOPs (plus 20 us), backward twice it."""
    timings = {
        name: LayerTiming(name, layer.kind, 2e-5 + layer.flops * seconds_per_flop, 0.0)
        for name, layer in graph.layers.items()
    }
    timings = {n: replace(t, backward_s=2 * t.forward_s) for n, t in timings.items()}
    return LayerProfile(graph.graph_hash(), "cpu", batch, 1, 3, timings)


def observation(
    kind: str = "sharded",
    *,
    step_s: float = 0.3,
    fractions: dict[str, float] | None = None,
    cap_mib: float | None = None,
    measured_peak: bool = True,
    bandwidth: float = 1e9,
    per_pass_s: float = 0.01,
    per_sample_s: float = 0.01,
    optimizer_s: float = 0.02,
    nproc: int = 2,
    fsdp_pass_s: float = 0.004,
    batch_range: tuple[int, int] | None = None,
) -> Observation:
    workload, graph, summary, facts, blocks = _static(kind)
    if batch_range is not None:
        workload = replace(workload, batch_range=batch_range)
    fit = CollectiveFit("gloo", "all_reduce", nproc, latency=1e-4, bandwidth=bandwidth)
    hardware = replace(tiny_hardware(nproc), collectives=(fit,))
    cap = int(cap_mib * MiB) if cap_mib else None
    obs = Observation(
        workload_spec=SPECS[kind],
        workload=workload,
        nproc=nproc,
        backend="gloo",
        device_type="cpu",
        hardware=hardware.with_memory_cap(cap),
        model=summary,
        baseline=Measurement(
            [step_s] * 8, step_s, 0.02 * step_s, workload.batch_size * nproc / step_s
        ),
        graph=graph,
        layer_profile=layer_profile(graph, workload.batch_size),
        breakdown=synthetic_breakdown(
            step_s,
            fractions or {"compute": 0.7, "comm_exposed": 0.2, "optimizer": 0.1},
            nproc=nproc,
        ),
        cache=MemoryCache(),
        memory=facts,
        memory_cap_bytes=cap,
        blocks=list(blocks),
    )
    if measured_peak:  # the model's own peak of the job as written, as if measured
        obs.baseline_peak_bytes = obs.predict_memory().peak_bytes
        obs._memo.clear()
    line = PassLine(per_pass_s, per_sample_s, optimizer_s, (4, 8, 16), 1)
    samples = workload.batch_size * workload.accumulation
    obs.cache.put(pass_line_key(obs, samples), line.to_dict())
    obs.cache.put(fsdp_overhead_key(obs), {"reshard": fsdp_pass_s, "keep": fsdp_pass_s / 2})
    return obs
