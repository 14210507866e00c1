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
measured here) and the hardware's fitted collective times, calibrated so that
it reproduces the measured baseline's step, exposed and hidden communication
(:mod:`.calibration`). The diagnosis starts from the measured truth
(:mod:`.explain`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psutil
import torch
import torch.fx

from tunekit.api import (
    BACKWARD_FLOPS_RATIO,
    DDPSync,
    Observation,
    Session,
    ddp_supports_bucket_list,
    effort_repeats,
)
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.plugins.overlap_chunking import calibrated as calibration
from tunekit.plugins.overlap_chunking.explain import (
    candidate_rationale,
    diagnosis_text,
    expected_gain,
    exposure_is_measured,
    headline,
    measured_exposed,
)
from tunekit.plugins.overlap_chunking.layers import (
    PaperLayer,
    block_boundaries,
    fc_layers,
    paper_layers,
)
from tunekit.plugins.overlap_chunking.measure import (
    StepProfile,
    fc_shape,
    layer_times_from_profile,
    measure_layer_times,
    measure_update_and_batch,
)
from tunekit.plugins.overlap_chunking.model import (
    FcCost,
    LayerCost,
    Prediction,
    StepCosts,
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

PROFILE_VERSION = 3
MAX_F = 4
"""Fully-connected layers priced for replication (the paper tries f = 0..3)."""


def threads_per_rank(nproc: int) -> int:
    """The thread count a trial rank gets on this machine (as the trial launcher sets it)."""
    return max(1, (psutil.cpu_count(logical=False) or 1) // max(nproc, 1))


def comm_cpu_share(obs: Observation) -> float:
    """How much of a hidden communication's CPU work it takes from compute on this job.

    On a GPU, NCCL has its own engine: 0. On CPU ranks the trial launcher gives
    each rank ``cores // ranks`` threads, so the cores are saturated and a
    collective's progress thread takes one thread's share: ``1 / threads``
    (less where the calibrated collectives show more competition than this
    rank's own threads: ``StepCosts.displaced_share``).
    """
    if obs.device_type == "cuda":
        return 0.0
    return 1.0 / threads_per_rank(obs.nproc)


def fc_cost(layer: PaperLayer, backward_s: float, batch: int, world: int, first: bool) -> FcCost:
    """What replicating a fully-connected layer's gradient saves and costs, from its backward time.

    A Linear layer's backward is two matmuls of its forward's FLOPs each
    (``BACKWARD_FLOPS_RATIO``): the input's gradient and the weight's. So the
    local weight gradient is ``1 / BACKWARD_FLOPS_RATIO`` of the layer's
    measured backward (all of it for the model's first layer, whose input
    needs no gradient), and the full-batch one, over ``world`` times the rows,
    ``world`` times that. Timing the two matmuls apart was tried: on a loaded
    2-core host their medians swung 10x between runs.
    """
    in_features, out_features, rows = fc_shape(layer)
    local = backward_s if first else backward_s / BACKWARD_FLOPS_RATIO
    return FcCost(in_features, out_features, rows * batch, local, world * local)


def default_prediction(costs: StepCosts) -> Prediction:
    return predict_ddp(costs, DEFAULT_FIRST_MB * MB, DEFAULT_CAP_MB * MB)


class OverlapChunking(Tuner):
    name = "overlap_chunking"
    title = "Overlapped gradient chunks (Lee et al.)"
    aspect = Aspect.GRAD_SYNC

    def __init__(self) -> None:
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
        """Per-layer times: from this observation, the study store, or measured now."""
        device = torch.device(
            "cuda" if obs.device_type == "cuda" and torch.cuda.is_available() else "cpu"
        )
        batch, world, threads = obs.workload.batch_size, obs.nproc, threads_per_rank(obs.nproc)

        def measure() -> StepProfile:
            times = None
            if obs.layer_profile is not None:
                times = layer_times_from_profile(obs.layer_profile, layers, obs.graph, batch)
            if times is not None:
                update, data = measure_update_and_batch(
                    obs.workload, batch=batch, device=device, threads=threads,
                    repeats=effort_repeats(3),
                )  # fmt: skip
                source = "observation"
            else:
                times, update, data = measure_layer_times(
                    obs.workload, layers, batch=batch, device=device, threads=threads,
                    warmup=effort_repeats(2, 1), repeats=effort_repeats(5),
                )  # fmt: skip
                source = "measured"
            return StepProfile(batch, world, times, update, data, source, {"threads": threads})

        return obs.cached(
            f"overlap_chunking:profile:v{PROFILE_VERSION}:{batch}:{world}:{device.type}:{threads}",
            measure,
            encode=StepProfile.to_dict,
            decode=StepProfile.from_dict,
        )

    def step_costs(self, obs: Observation) -> tuple[StepCosts, StepProfile, list[PaperLayer]]:
        """The uncalibrated cost inputs for this job: per-layer times and collective times."""
        layers = paper_layers(obs.model)
        profile = self._profile(obs, layers)
        meta = _meta_model(obs)
        self._static_graph = static_graph_safe(meta)
        tensor_bytes = _param_tensor_bytes(meta, layers)
        replicable = {layer.name for layer in fc_layers(layers)[:MAX_F]}
        hw, world, backend = obs.hardware, obs.nproc, obs.backend

        def allreduce(nbytes: float) -> float:
            return hw.allreduce_time(nbytes, world, backend)

        def allgather(nbytes: float) -> float:
            fit = hw.fit("all_gather", world, backend)
            # A ring all-gather is half a ring all-reduce (its second phase).
            return fit.time(nbytes) if fit is not None else allreduce(nbytes) / 2

        costs = []
        for index, (layer, times) in enumerate(zip(layers, profile.layers, strict=True)):
            fc = None
            if layer.name in replicable:
                fc = fc_cost(layer, times.backward_s, profile.batch, world, first=index == 0)
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
        """The calibrated costs and ranked settings (once per observation)."""
        return obs.memo(f"{self.name}:priced", lambda: self._price(obs))

    def _price(self, obs: Observation) -> dict[str, Any]:
        costs, profile, layers = self.step_costs(obs)
        fitted = calibration.fit(costs, obs.truth, default_prediction)
        return {
            "fit": fitted,
            "costs": fitted.costs,
            "profile": profile,
            "layers": layers,
            "baseline": fitted.baseline,
            # Chunk 1 starts at a transformer block's border (any layer on a CNN).
            "ranked": rank_settings(
                fitted.costs, ddp_supports_bucket_list(), block_boundaries(layers)
            ),
        }

    # -- diagnose / plan ---------------------------------------------------------------

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2:
            return Diagnosis(False, "one rank: there is no gradient communication to overlap")
        if "sharded" in obs.workload.features():
            from tunekit.plugins.overlap_chunking.runtime import SHARDED_WHY

            return Diagnosis(False, SHARDED_WHY)
        priced = self._priced(obs)
        fitted: calibration.Fit = priced["fit"]
        # -- training features (issue 17): configs that cannot honour them are left out --
        from tunekit.plugins.overlap_chunking.runtime import declines

        features = obs.workload.features()
        declined = [d for s in priced["ranked"] if (d := declines(s.knobs, features))]
        priced["ranked"] = [s for s in priced["ranked"] if not declines(s.knobs, features)]
        # --
        base: Prediction = priced["baseline"]
        best = next(s for s in priced["ranked"] if not is_default_ddp(s.knobs))
        grad_mib = sum(c.nbytes for c in priced["costs"].layers) / MB
        gain, bound = expected_gain(fitted, best.prediction)
        spread = obs.baseline.spread_s if obs.baseline is not None else None
        return Diagnosis(
            applies=True,
            summary=diagnosis_text(fitted, best, gain, bound, grad_mib)
            + (f"; two_chunk with f > 0 {declined[0]}" if declined else ""),
            expected_gain=gain,
            headline=headline(fitted, best, gain, bound, spread),
            details={
                "exposed_s": measured_exposed(fitted),
                "exposed_source": "measured" if exposure_is_measured(fitted) else "model",
                "model_exposed_s": base.blocked_s,
                "raw_model_exposed_s": fitted.raw.blocked_s,
                "gain_bound": bound,
                "predicted_default": base.to_dict(),
                "best": {"knobs": best.knobs, **best.prediction.to_dict()},
                "gradient_mib": grad_mib,
                "layers": len(priced["layers"]),
                "fc_layers": len(fc_layers(priced["layers"])),
                "calibration": fitted.to_dict(),
                "compute_scale": fitted.compute_scale,
                "profile_source": priced["profile"].source,
            },
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2 or "sharded" in obs.workload.features():
            return []
        priced = self._priced(obs)
        # The baseline trial already measures PyTorch's defaults.
        ranked = [s for s in priced["ranked"] if not is_default_ddp(s.knobs)]
        # -- training features (issue 17): no config that cannot honour them --
        from tunekit.plugins.overlap_chunking.runtime import declines

        ranked = [s for s in ranked if not declines(s.knobs, obs.workload.features())]
        # --
        chosen = shortlist(ranked, limit)
        spread = obs.baseline.spread_s if obs.baseline is not None else None
        return [self._candidate(s, priced, spread) for s in chosen]

    def _candidate(
        self, setting: Setting, priced: dict[str, Any], spread_s: float | None
    ) -> Candidate:
        knobs = dict(setting.knobs)
        if knobs["mode"] == "ddp_buckets":
            # Gradients as views of the buckets save a copy per step; the model
            # does not count that copy, so it only helps. static_graph only
            # where the graph provably never changes.
            knobs["gradient_as_bucket_view"] = True
            knobs["static_graph"] = self._static_graph
        fitted: calibration.Fit = priced["fit"]
        pred = setting.prediction
        return Candidate(
            knobs=knobs,
            predicted_step_s=pred.step_s,
            predicted_range_s=fitted.predicted_range(pred, spread_s),
            rationale=candidate_rationale(setting, fitted),
            details={
                **pred.to_dict(),
                "calibration": fitted.to_dict(),
                "compute_scale": fitted.compute_scale,
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
