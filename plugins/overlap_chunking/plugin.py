"""overlap_chunking: gradient communication in tuned chunks, overlapped with backprop.

After Lee et al., "Parallel Deep Convolutional Neural Network Training by
Exploiting the Overlapping of Computation and Communication" (see
``docs/tuners/overlap_chunking.md``). Two modes of one ``grad_sync`` aspect:

* ``ddp_buckets``: DDP's gradient buckets are the chunks; their sizes decide
  how early the first all-reduce starts and how much is left after backward;
* ``two_chunk``: the paper's own scheme, two chunks split k layers from the
  output end, and the first f fully-connected layers computing their weight
  gradient from gathered activations and errors instead of all-reducing it.

The planner prices every setting with a simulation of one rank's step
(:mod:`.model`) fed by per-layer times (the observation's layer profile, or
measured here) and the hardware's fitted collective times, calibrated to the
measured baseline.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psutil
import torch
import torch.fx

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.observe.observation import Observation
from tunekit.plugins.overlap_chunking.layers import PaperLayer, fc_layers, paper_layers
from tunekit.plugins.overlap_chunking.model import (
    FcCost,
    LayerCost,
    Prediction,
    StepCosts,
    calibrate,
    predict_ddp,
)
from tunekit.plugins.overlap_chunking.runtime import apply_overlap_chunking
from tunekit.plugins.overlap_chunking.search import (
    DEFAULT_CAP_MB,
    DEFAULT_FIRST_MB,
    MB,
    Setting,
    is_default_ddp,
    rank_settings,
    shortlist,
)
from tunekit.plugins.overlap_chunking.timing import (
    StepProfile,
    layer_times_from_profile,
    measure_fc_costs,
    measure_layer_times,
    measure_update_and_batch,
)
from tunekit.runtime.session import Session
from tunekit.runtime.sync import DDPSync, ddp_supports_bucket_list

PROFILE_VERSION = 1
MAX_F = 4
"""Fully-connected layers priced for replication (the paper tries f = 0..3)."""


def threads_per_rank(nproc: int) -> int:
    """The thread count a trial rank gets on this machine (as the trial launcher sets it)."""
    return max(1, (psutil.cpu_count(logical=False) or 1) // max(nproc, 1))


def comm_cpu_share(obs: Observation) -> float:
    """How much of a hidden communication's time it takes from compute on this job.

    On a GPU, NCCL has its own engine: 0. On CPU ranks the trial launcher gives
    each rank ``cores // ranks`` threads, so the cores are saturated and a
    collective's progress thread takes one thread's share: ``1 / threads``.
    """
    if obs.device_type == "cuda":
        return 0.0
    return 1.0 / threads_per_rank(obs.nproc)


def default_prediction(costs: StepCosts) -> Prediction:
    return predict_ddp(costs, DEFAULT_FIRST_MB * MB, DEFAULT_CAP_MB * MB)


def two_chunk_refuses(obs: Observation) -> bool:
    """Two chunks update per chunk: a job with AMP, accumulation, a schedule or clipping
    cannot keep its arithmetic under them (the session refuses it at apply)."""
    from tunekit.plugins.overlap_chunking.two_chunk import TwoChunkSync

    return bool(obs.workload.features() - TwoChunkSync.handles)


class OverlapChunking(Tuner):
    name = "overlap_chunking"
    title = "Overlapped gradient chunks (Lee et al.)"
    aspect = Aspect.GRAD_SYNC

    def __init__(self) -> None:
        self._profiles: dict[tuple, StepProfile] = {}
        self._static_graph = False

    def knobs(self) -> list[Knob]:
        first_help = "size of the first bucket, reduced first (MiB)"
        if not ddp_supports_bucket_list():
            first_help += "; this torch ties it to bucket_cap_mb"
        return [
            Knob(
                "mode",
                "choice",
                "ddp_buckets",
                "DDP buckets, or Lee et al.'s two chunks",
                choices=("ddp_buckets", "two_chunk"),
            ),
            Knob(
                "bucket_cap_mb",
                "float",
                DEFAULT_CAP_MB,
                "ddp_buckets: gradient bucket size (MiB)",
                0.25,
                1024,
            ),
            Knob(
                "first_bucket_mb",
                "float",
                DEFAULT_FIRST_MB,
                "ddp_buckets: " + first_help,
                0.0625,
                1024,
            ),
            Knob(
                "gradient_as_bucket_view",
                "bool",
                False,
                "ddp_buckets: gradients alias bucket memory (saves a copy)",
            ),
            Knob(
                "static_graph",
                "bool",
                False,
                "ddp_buckets: DDP static_graph (the graph never changes)",
            ),
            Knob(
                "k",
                "int",
                1,
                "two_chunk: layers from the output end in chunk 1 (pooling layers count)",
                1,
                100_000,
            ),
            Knob(
                "f",
                "int",
                0,
                "two_chunk: leading FC layers that gather activations and errors "
                "instead of all-reducing their weight gradient",
                0,
                1000,
            ),
        ]

    # -- the model ---------------------------------------------------------------------

    def _profile(self, obs: Observation, layers: list[PaperLayer]) -> StepProfile:
        """Per-layer times: cached in this tuner, in the study store, or measured now."""
        device = torch.device(
            "cuda" if obs.device_type == "cuda" and torch.cuda.is_available() else "cpu"
        )
        batch, world, threads = obs.workload.batch_size, obs.nproc, threads_per_rank(obs.nproc)
        key = (obs.workload_spec, batch, world, device.type, threads)
        if key in self._profiles:
            return self._profiles[key]
        cache_key = (
            f"overlap_chunking:profile:v{PROFILE_VERSION}:{batch}:{world}:{device.type}:{threads}"
        )
        cached = obs.cache.get(cache_key) if obs.cache is not None else None
        if cached:
            profile = StepProfile.from_dict(cached)
        else:
            fcs = measure_fc_costs(
                layers, batch=batch, world=world, device=device, threads=threads, max_fc=MAX_F
            )
            times = None
            if obs.layer_profile is not None:
                times = layer_times_from_profile(obs.layer_profile, layers, obs.graph, batch)
            if times is not None:
                update, data = measure_update_and_batch(
                    obs.workload, batch=batch, device=device, threads=threads
                )
                source = "observation"
            else:
                times, update, data = measure_layer_times(
                    obs.workload, layers, batch=batch, device=device, threads=threads
                )
                source = "measured"
            profile = StepProfile(
                batch, world, times, fcs, update, data, source, {"threads": threads}
            )
            if obs.cache is not None:
                obs.cache.put(cache_key, profile.to_dict())
        self._profiles[key] = profile
        return profile

    def step_costs(self, obs: Observation) -> tuple[StepCosts, StepProfile, list[PaperLayer]]:
        """The uncalibrated cost inputs for this job: per-layer times and collective times."""
        layers = paper_layers(obs.model)
        profile = self._profile(obs, layers)
        meta = _meta_model(obs)
        self._static_graph = static_graph_safe(meta)
        tensor_bytes = _param_tensor_bytes(meta, layers)
        fc_timing = {t.name: t for t in profile.fcs}
        hw, world, backend = obs.hardware, obs.nproc, obs.backend

        def allreduce(nbytes: float) -> float:
            return hw.allreduce_time(nbytes, world, backend)

        def allgather(nbytes: float) -> float:
            fit = hw.fit("all_gather", world, backend)
            # A ring all-gather is half a ring all-reduce (its second phase).
            return fit.time(nbytes) if fit is not None else allreduce(nbytes) / 2

        costs = []
        for layer, times in zip(layers, profile.layers, strict=True):
            timing = fc_timing.get(layer.name)
            fc = None
            if timing is not None:
                fc = FcCost(
                    timing.in_features,
                    timing.out_features,
                    timing.rows_per_sample * profile.batch,
                    timing.local_wgrad_s,
                    timing.full_wgrad_s,
                )
            costs.append(
                LayerCost(
                    layer.name, times.forward_s, times.backward_s, tensor_bytes[layer.name], fc
                )
            )
        step = StepCosts(
            tuple(costs),
            profile.update_s_per_byte,
            profile.data_s,
            world,
            allreduce,
            allgather,
            comm_cpu_share=comm_cpu_share(obs),
        )
        return step, profile, layers

    def _priced(self, obs: Observation) -> dict[str, Any]:
        costs, profile, layers = self.step_costs(obs)
        scale = None
        if obs.baseline is not None:
            scale = calibrate(costs, obs.baseline.median_s, default_prediction)
        calibrated = costs.scaled(scale) if scale else costs
        return {
            "costs": calibrated,
            "scale": scale,
            "profile": profile,
            "layers": layers,
            "baseline": default_prediction(calibrated),
            "ranked": rank_settings(calibrated, ddp_supports_bucket_list()),
        }

    # -- diagnose / plan ---------------------------------------------------------------

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2:
            return Diagnosis(False, "one rank: there is no gradient communication to overlap")
        priced = self._priced(obs)
        base: Prediction = priced["baseline"]
        step = obs.baseline.median_s if priced["scale"] else base.step_s
        best = next(s for s in priced["ranked"] if not is_default_ddp(s.knobs))
        gain = max(0.0, (step - best.prediction.step_s) / step)
        grad_mib = sum(c.nbytes for c in priced["costs"].layers) / MB
        r = f"R~{base.overlap_R:.0f}" if base.overlap_R is not None else "no communication"
        if priced["scale"]:
            calibration = ""
        elif obs.baseline is None:
            calibration = " (uncalibrated: no baseline measured)"
        else:
            calibration = (
                " (uncalibrated: the measured baseline is shorter than the modelled "
                "communication alone; check the hardware's all-reduce fit)"
            )
        return Diagnosis(
            applies=True,
            summary=(
                f"exposed communication ~{base.blocked_s / step:.0%} of the step "
                f"({grad_mib:.1f} MiB of gradients, {r} under DDP defaults); "
                f"{best.label} should recover ~{gain:.0%}{calibration}"
            ),
            expected_gain=gain,
            details={
                "exposed_s": base.blocked_s,
                "predicted_default": base.to_dict(),
                "best": {"knobs": best.knobs, **best.prediction.to_dict()},
                "gradient_mib": grad_mib,
                "layers": len(priced["layers"]),
                "fc_layers": len(fc_layers(priced["layers"])),
                "compute_scale": priced["scale"],
                "profile_source": priced["profile"].source,
            },
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2:
            return []
        priced = self._priced(obs)
        # The baseline trial already measures PyTorch's defaults.
        ranked = [s for s in priced["ranked"] if not is_default_ddp(s.knobs)]
        if two_chunk_refuses(obs):  # its trial would only be refused at apply
            ranked = [s for s in ranked if s.knobs["mode"] != "two_chunk"]
        chosen = shortlist(ranked, limit)
        return [self._candidate(s, priced) for s in chosen]

    def _candidate(self, setting: Setting, priced: dict[str, Any]) -> Candidate:
        knobs = dict(setting.knobs)
        if knobs["mode"] == "ddp_buckets":
            # Gradients as views of the buckets save a copy per step; the model
            # does not count that copy, so it only helps. static_graph only
            # where the graph provably never changes.
            knobs["gradient_as_bucket_view"] = True
            knobs["static_graph"] = self._static_graph
        pred = setting.prediction
        return Candidate(
            knobs=knobs,
            predicted_step_s=pred.step_s,
            rationale=(
                f"{setting.label}: {pred.blocked_s * 1e3:.1f} ms exposed, "
                f"R~{pred.overlap_R:.0f}, {len(pred.comms)} communications per step"
                if pred.overlap_R is not None
                else setting.label
            ),
            details={
                **pred.to_dict(),
                "compute_scale": priced["scale"],
                "profile_source": priced["profile"].source,
            },
        )

    # -- runtime ------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        apply_overlap_chunking(session, knobs)

    def snippet(self, knobs: Mapping[str, Any]) -> str:
        if knobs.get("mode") == "two_chunk":
            return (
                "# Lee et al.'s two-chunk reducer has no stock PyTorch equivalent; in a tunekit Session:\n"
                "from tunekit.plugins.overlap_chunking.runtime import apply_two_chunk\n"
                f"apply_two_chunk(session, k={knobs['k']}, f={knobs['f']})"
            )
        kwargs = DDPSync(
            bucket_cap_mb=knobs["bucket_cap_mb"],
            first_bucket_mb=knobs["first_bucket_mb"],
            gradient_as_bucket_view=knobs["gradient_as_bucket_view"],
            static_graph=knobs["static_graph"],
        ).ddp_kwargs()
        if "bucket_cap_mb_list" in kwargs:
            first, cap = kwargs["bucket_cap_mb_list"][:2]
            kwargs["bucket_cap_mb_list"] = f"[{first:g}] + [{cap:g}] * 1024"
        args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        return f"model = torch.nn.parallel.DistributedDataParallel(model, {args})"


def _meta_model(obs: Observation) -> torch.nn.Module | None:
    """The workload's model built on the meta device (no memory, no init), or None if it cannot be."""
    try:
        with torch.device("meta"):
            return obs.workload.model()
    except Exception:
        return None


def _param_tensor_bytes(
    model: torch.nn.Module | None, layers: list[PaperLayer]
) -> dict[str, tuple[int, ...]]:
    """Bytes of each parameter tensor per layer, in the order backward produces them.

    Without a model (it cannot be built on the meta device) each layer counts
    as one fp32 tensor.
    """
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()} if model else {}
    out = {}
    for layer in layers:
        if sizes and all(n in sizes for n in layer.param_names):
            out[layer.name] = tuple(sizes[n] for n in reversed(layer.param_names))
        else:
            out[layer.name] = (layer.param_numel * 4,) if layer.param_numel else ()
    return out


def static_graph_safe(model: torch.nn.Module | None) -> bool:
    """Whether DDP's ``static_graph`` is safe: the forward traces with ``torch.fx``
    (no data-dependent control flow, so the same graph every step) and uses
    every parameter (none is unused in some steps)."""
    if model is None:
        return False
    try:
        traced = torch.fx.symbolic_trace(model)
    except Exception:
        return False
    modules = dict(model.named_modules())
    used: set[str] = set()
    for node in traced.graph.nodes:
        if node.op == "call_module":
            prefix = f"{node.target}." if node.target else ""
            used.update(prefix + n for n, _ in modules[node.target].named_parameters())
        elif node.op == "get_attr":
            used.add(str(node.target))
    return {n for n, _ in model.named_parameters()} <= used
