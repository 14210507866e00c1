"""overlap_chunking: gradient communication in tuned chunks, overlapped with backprop.

After Lee et al., "Parallel Deep Convolutional Neural Network Training by
Exploiting the Overlapping of Computation and Communication". In this first
form the chunks are DDP's gradient buckets: their sizes decide how early the
first all-reduce starts and how much communication is left after backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.observe.observation import Observation
from tunekit.runtime.session import Session
from tunekit.runtime.sync import ddp_supports_bucket_list

from tunekit.plugins.overlap_chunking.model import GradientTimeline
from tunekit.plugins.overlap_chunking.runtime import apply_ddp_buckets
from tunekit.plugins.overlap_chunking.search import (
    DEFAULT_CAP_MB,
    DEFAULT_FIRST_MB,
    MB,
    default_exposed,
    rank_bucket_sizes,
)


def gradient_timeline(obs: Observation, backward_s: float) -> GradientTimeline:
    """Gradients in the order backward produces them, with estimated ready times.

    Without a per-layer profile, backward time is spread over layers in
    proportion to their parameter count.
    """
    layers = [layer for layer in reversed(obs.model.layers) if layer.param_numel]
    total = sum(layer.param_numel for layer in layers) or 1
    nbytes, ready, t = [], [], 0.0
    for layer in layers:
        t += backward_s * layer.param_numel / total
        nbytes.append(layer.param_numel * 4)
        ready.append(t)
    return GradientTimeline(nbytes=nbytes, ready_s=ready, backward_s=backward_s)


class OverlapChunking(Tuner):
    name = "overlap_chunking"
    title = "Overlapped gradient chunks (Lee et al.)"
    aspect = Aspect.GRAD_SYNC

    def knobs(self) -> list[Knob]:
        return [
            Knob("bucket_cap_mb", "float", DEFAULT_CAP_MB, "DDP gradient bucket size (MiB)", 0.25, 1024),
            Knob(
                "first_bucket_mb", "float", DEFAULT_FIRST_MB,
                "size of the first bucket, reduced first (MiB)"
                + ("" if ddp_supports_bucket_list() else "; this torch ties it to bucket_cap_mb"),
                0.0625, 1024,
            ),
            Knob("gradient_as_bucket_view", "bool", False, "gradients alias bucket memory (saves a copy)"),
            Knob("static_graph", "bool", False, "DDP static_graph (the graph never changes)"),
        ]

    # -- diagnose / plan ---------------------------------------------------------------

    def _model(self, obs: Observation):
        def allreduce(nbytes: float) -> float:
            return obs.hardware.allreduce_time(nbytes, obs.nproc, obs.backend)

        step = obs.baseline.median_s
        # Split the measured step into compute and exposed communication:
        # iterate compute = step - exposed(compute), backward = 2/3 of compute.
        compute = step
        for _ in range(8):
            timeline = gradient_timeline(obs, backward_s=2 * compute / 3)
            compute = max(step - default_exposed(timeline, allreduce), 0.05 * step)
        return timeline, allreduce, compute

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2:
            return Diagnosis(False, "one rank: there is no gradient communication to overlap")
        if obs.baseline is None:
            return Diagnosis(False, "needs a measured baseline step time")
        timeline, allreduce, compute = self._model(obs)
        exposed = obs.baseline.median_s - compute
        best = rank_bucket_sizes(timeline, allreduce, compute)[0]
        gain = max(0.0, (obs.baseline.median_s - best[1]) / obs.baseline.median_s)
        share = exposed / obs.baseline.median_s
        return Diagnosis(
            applies=True,
            summary=(
                f"exposed communication ~{share:.0%} of the step "
                f"({sum(timeline.nbytes) / MB:.1f} MiB of gradients); "
                f"{best[0]:g} MiB buckets should recover ~{gain:.0%}"
            ),
            expected_gain=gain,
            details={"exposed_s": exposed, "compute_s": compute, "gradient_mib": sum(timeline.nbytes) / MB},
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2 or obs.baseline is None:
            return []
        timeline, allreduce, compute = self._model(obs)
        rows = rank_bucket_sizes(timeline, allreduce, compute)
        out = []
        for cap_mb, step_s, exposed in rows:
            if cap_mb == DEFAULT_CAP_MB:
                continue  # the baseline already measures PyTorch's default
            out.append(
                Candidate(
                    knobs={"bucket_cap_mb": float(cap_mb), "first_bucket_mb": min(float(cap_mb), DEFAULT_FIRST_MB)},
                    predicted_step_s=step_s,
                    rationale=f"{cap_mb:g} MiB buckets leave ~{exposed * 1e3:.1f} ms exposed",
                    details={"exposed_s": exposed},
                )
            )
        return out[:limit]

    # -- runtime ------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        apply_ddp_buckets(session, knobs)
