"""What is known about a job before any trial: the model, its graph and layer times, the hardware.

:func:`observe_in_child` runs the workload's code in a child process (``tunekit auto``,
``tunekit plan``); :func:`observe_static` runs it in this process (the TUI, benchmarks).
Both cache the layer profile and this machine's collective fits in the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tunekit.effort import effort_repeats
from tunekit.errors import ConfigError, WorkloadError
from tunekit.hardware import CollectiveFit, Hardware, load_profile
from tunekit.memory import MemoryFacts
from tunekit.observe.first_step import try_first_step
from tunekit.observe.graph import ModelGraph, trace_model
from tunekit.observe.layer_profile import LayerProfile, profile_layers
from tunekit.observe.local import describe_local_machine
from tunekit.observe.memory_facts import measure_memory_facts
from tunekit.observe.observation import Measurement, ModelSummary, Observation, summarize_model
from tunekit.observe.probe import probe_hardware
from tunekit.observe.workload_process import (
    OBSERVE_LOG,
    WorkloadProcess,
    observe_call,
    stand_in_workload,
)
from tunekit.runtime.sharding import check_layout
from tunekit.store import Store, StudyCache
from tunekit.timings import Timings
from tunekit.trials.launcher import rank_threads
from tunekit.workload import Workload, load_workload, resolve_spec

PROBE_CACHE_PREFIX = "probe"


def probe_cache_key(hw: Hardware) -> str:
    """Where ``tunekit hardware probe`` caches measured fits for this machine's shape."""
    return f"{PROBE_CACHE_PREFIX}:{hw.fingerprint()}"


@dataclass
class StaticObservation:
    """What is known about a job before any trial: model, graph, layer times, hardware."""

    spec: str
    workload: Workload
    summary: ModelSummary
    graph: ModelGraph
    layer_profile: LayerProfile | None
    hardware: Hardware
    device_type: str
    notices: list[str] = field(default_factory=list)
    memory: MemoryFacts | None = None
    """What the memory model needs, measured in the workload's process (cached)."""
    blocks: list[str] = field(default_factory=list)
    """The model's blocks (what FSDP shards and checkpointing recomputes)."""

    @property
    def graph_hash(self) -> str:
        return self.graph.graph_hash()

    def observation(
        self,
        nproc: int,
        baseline: Measurement | None,
        store: Store | None,
        *,
        memory_cap_bytes: int | None = None,
        baseline_peak_bytes: float | None = None,
    ) -> Observation:
        hardware = self.hardware.with_memory_cap(memory_cap_bytes)
        return Observation(
            workload_spec=self.spec,
            workload=self.workload,
            nproc=nproc,
            backend="nccl" if self.device_type == "cuda" else "gloo",
            device_type=self.device_type,
            hardware=hardware,
            model=self.summary,
            baseline=baseline,
            graph=self.graph,
            layer_profile=self.layer_profile,
            cache=StudyCache(store, f"{self.graph_hash}:{self.hardware.fingerprint()}")
            if store
            else None,
            memory=self.memory,
            memory_cap_bytes=memory_cap_bytes,
            baseline_peak_bytes=baseline_peak_bytes,
            blocks=list(self.blocks),
        )


def resolve_device_type(device: str) -> str:
    """``auto``/``cuda``/``cpu`` as the device the job will run on here."""
    return "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"


def _memory_facts_key(graph: ModelGraph, spec: str, device_type: str) -> str:
    return f"memory_facts:v1:{graph.graph_hash()}:{spec}:{device_type}"


def _layer_profile_key(graph: ModelGraph, hw: Hardware, device_type: str) -> str:
    return f"layer_profile:{graph.graph_hash()}:{hw.fingerprint()}:{device_type}"


def describe_hardware(
    world_size: int, device_type: str, hardware: str | None, store: Store, probe: bool = False
) -> tuple[Hardware, list[str]]:
    """The hardware to plan for: a profile, or this machine with its collectives probed once (cached)."""
    if hardware:
        return load_profile(hardware), []
    notices: list[str] = []
    hw = describe_local_machine(world_size, device_type)
    fits = store.cache_get(probe_cache_key(hw))
    if not fits and probe and world_size >= 2:
        result = probe_hardware(world_size, device_type=device_type)
        fits = [asdict(f) for f in result.hardware.collectives]
        store.cache_put(probe_cache_key(hw), fits)
        notices.append(
            f"probed this machine's collectives once ({result.wall_s:.0f} s); "
            "cached for later studies (tunekit hardware probe re-measures)"
        )
    if fits:
        hw = describe_local_machine(
            world_size, device_type, tuple(CollectiveFit(**f) for f in fits)
        )
    return hw, notices


async def observe_in_child(
    workload: str,
    world_size: int,
    device: str,
    hardware: str | None,
    store: Store,
    seed: int = 0,
    threads_per_rank: int | None = None,
    time_layers: bool = True,
    probe: bool = False,
    timeout_s: float = 300.0,
    log_dir: Path = Path(".tunekit"),
    child: WorkloadProcess | None = None,
    timings: Timings | None = None,
) -> StaticObservation:
    """:func:`observe_static` with the workload's code in a child process (``WorkloadProcess``):
    a workload that crashes, hangs or exits while it is built, traced or timed fails with
    :class:`ObservationFailed` (one line, classified as a trial is), and tunekit lives on.

    ``child``: the caller's, left running but idle (the model dropped) for the tuners' hooks
    later; without it, a child of its own, ended before this returns. ``timings``: where the
    stages (building and tracing the model, the probe, timing the layers) are recorded.
    """
    timings = timings or Timings()
    spec = resolve_spec(workload)
    device_type = resolve_device_type(device)
    own = child is None
    child = child or WorkloadProcess(Path(log_dir) / OBSERVE_LOG, timeout_s)
    try:
        with timings.stage("observe: build and trace the model") as stage:
            seen = await observe_call(
                child, "observe", "building and tracing the model", workload=spec, seed=seed
            )
            stage.cpu_s = child.take_cpu_s()
        graph = ModelGraph.from_dict(seen["graph"])
        with timings.stage("observe: the hardware"):
            hw, notices = await asyncio.to_thread(
                describe_hardware, world_size, device_type, hardware, store, probe
            )
        if graph.notice:
            notices.append(graph.notice)
        profile = None
        if time_layers and not hardware:
            with timings.stage("observe: time the layers") as stage:
                profile = await _layer_profile(
                    child, graph, hw, device_type, store, world_size, threads_per_rank, notices
                )
                stage.cpu_s = child.take_cpu_s()
        memory = None
        if time_layers:
            with timings.stage("observe: the memory model's facts") as stage:
                memory = await _memory_facts(
                    child, spec, graph, device_type, store, world_size, threads_per_rank, notices
                )
                stage.cpu_s = child.take_cpu_s()
        if not own:
            await observe_call(child, "idle", "dropping the model")
    finally:
        if own:
            await child.close()
    return StaticObservation(
        spec,
        stand_in_workload(seen["workload"]),
        ModelSummary.from_dict(seen["summary"]),
        graph,
        profile,
        hw,
        device_type,
        notices,
        memory,
        list(seen.get("blocks") or []),
    )


async def _memory_facts(
    child: WorkloadProcess,
    spec: str,
    graph: ModelGraph,
    device_type: str,
    store: Store,
    world_size: int,
    threads_per_rank: int | None,
    notices: list[str],
) -> MemoryFacts | None:
    """The memory model's facts: cached in the store, or measured in the workload's process."""
    key = _memory_facts_key(graph, spec, device_type)
    if cached := store.cache_get(key):
        return MemoryFacts.from_dict(cached)
    found = await observe_call(
        child,
        "memory_facts",
        "measuring the model's memory",
        workload=spec,
        device=device_type,
        threads=rank_threads(world_size, threads_per_rank),
    )
    if not found["memory"]:
        notices.append(found["notice"])
        return None
    store.cache_put(key, found["memory"])
    return MemoryFacts.from_dict(found["memory"])


async def _layer_profile(
    child: WorkloadProcess,
    graph: ModelGraph,
    hw: Hardware,
    device_type: str,
    store: Store,
    world_size: int,
    threads_per_rank: int | None,
    notices: list[str],
) -> LayerProfile | None:
    """The model's layer times: cached in the store, or timed in the workload's process."""
    key = _layer_profile_key(graph, hw, device_type)
    if cached := store.cache_get(key):
        return LayerProfile.from_dict(cached)
    timed = await observe_call(
        child,
        "profile_layers",
        "timing the model's layers",
        device=device_type,
        repeats=effort_repeats(3, 1),
        threads=rank_threads(world_size, threads_per_rank),
        hardware_fingerprint=hw.fingerprint(),
    )
    if not timed["layer_profile"]:
        notices.append(timed["notice"])
        return None
    store.cache_put(key, timed["layer_profile"])
    return LayerProfile.from_dict(timed["layer_profile"])


def observe_static(
    workload: str,
    world_size: int,
    device: str,
    hardware: str | None,
    store: Store,
    seed: int = 0,
    threads_per_rank: int | None = None,
    time_layers: bool = True,
    probe: bool = False,
    on_stage: Callable[[str], None] | None = None,
) -> StaticObservation:
    """Load the workload here (to fail early and clearly), trace it, time its layers, describe the hardware.

    Runs the workload's code in this process (the TUI); ``tunekit auto`` and ``tunekit plan``
    use :func:`observe_in_child`. Layers are timed with the thread count each rank gets,
    so that their times add up to a rank's compute; the profile is cached in the store.
    ``on_stage`` hears what it does now, in words ("timing 11 layers standalone").
    """
    stage = on_stage or (lambda _: None)
    spec = resolve_spec(workload)
    stage(f"loading {spec}")
    wl = load_workload(spec)
    device_type = resolve_device_type(device)
    stage("describing the hardware")
    hw, notices = describe_hardware(world_size, device_type, hardware, store, probe)
    stage("tracing the model graph")
    model = wl.model()
    try:
        blocks = check_layout(model, wl.layout())
    except ConfigError as exc:
        raise WorkloadError(f"workload {wl.name!r}: {exc}") from None
    batch = wl.example_batch(wl.batch_size, seed=seed)
    example = batch[0]
    graph = trace_model(
        model, example
    )  # first: a forward pass that fails is one WorkloadError line
    try_first_step(wl, model, batch)  # a loss that cannot train fails here, not in a trial
    summary = summarize_model(model, example)
    if graph.notice:
        notices.append(graph.notice)
    profile = None
    if time_layers and not hardware:
        key = _layer_profile_key(graph, hw, device_type)
        cached = store.cache_get(key)
        if cached:
            stage("the layer times, from the study store's cache")
            profile = LayerProfile.from_dict(cached)
        else:
            stage(f"timing {len(graph.layers)} layers standalone (forward and backward)")
            threads = rank_threads(world_size, threads_per_rank)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                profile = profile_layers(
                    model,
                    example,
                    graph,
                    device=device_type,
                    warmup=1,
                    repeats=effort_repeats(3, 1),
                    hardware_fingerprint=hw.fingerprint(),
                )
            except (
                Exception
            ) as exc:  # the workload's own code failed; the baseline trial reports it
                notices.append(
                    f"could not time the model's layers ({type(exc).__name__}: {exc}); "
                    "tuners fall back to the whole-step measurements"
                )
            finally:
                torch.set_num_threads(before)
            if profile is not None:
                store.cache_put(key, profile.to_dict())
    memory = None
    if time_layers:
        key = _memory_facts_key(graph, spec, device_type)
        if cached := store.cache_get(key):
            memory = MemoryFacts.from_dict(cached)
        else:
            del model  # the measurement builds its own copy
            try:
                memory = measure_memory_facts(wl, torch.device(device_type))
                store.cache_put(key, memory.to_dict())
            except Exception as exc:  # the workload's own code failed; its trials report it
                notices.append(
                    f"could not measure the model's memory ({type(exc).__name__}: {exc})"
                )
    return StaticObservation(
        spec, wl, summary, graph, profile, hw, device_type, notices, memory, blocks
    )
