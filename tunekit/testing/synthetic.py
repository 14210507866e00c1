"""Synthetic observations: a step breakdown, telemetry and a whole Observation.

The numbers are the caller's; the shapes, and the summarisers that read them,
are the real ones, so ``diagnose`` and ``plan`` see what the orchestrator hands them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any, cast

from tunekit.hardware import Hardware
from tunekit.observe.breakdown import PARTS, Breakdown, CollectiveTiming, RankBreakdown, StepParts
from tunekit.observe.observation import (
    Measurement,
    Observation,
    TelemetrySummary,
    summarize_model,
)
from tunekit.testing.fixtures import MemoryCache, tiny_hardware, tiny_workload
from tunekit.workload import Workload, load_workload

DEFAULT_FRACTIONS = {
    "compute": 0.8,
    "comm_exposed": 0.1,
    "data": 0.05,
    "optimizer": 0.05,
    "idle": 0.0,
}


def synthetic_breakdown(
    step_s: float,
    fractions: Mapping[str, float] | None = None,
    *,
    nproc: int = 2,
    steps: int = 3,
    comm_total_s: float | None = None,
) -> Breakdown:
    """A step breakdown whose parts are ``fractions`` of ``step_s`` on every rank.

    ``fractions`` maps parts of :data:`~tunekit.observe.breakdown.PARTS` to
    shares of the step (missing parts are 0; they must sum to 1). Exposed
    communication becomes one all-reduce per step that took ``comm_total_s``
    (default: twice the exposed time) and blocked the rank for the exposed part.
    """
    shares = {p: 0.0 for p in PARTS}
    shares.update(DEFAULT_FRACTIONS if fractions is None else fractions)
    unknown = set(shares) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown breakdown parts {sorted(unknown)}; parts are {', '.join(PARTS)}")
    if not math.isclose(sum(shares.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"breakdown fractions must sum to 1, not {sum(shares.values()):.4f}")
    parts = {p: shares[p] * step_s for p in PARTS}
    comm_total = parts["comm_exposed"] * 2 if comm_total_s is None else comm_total_s
    ranks = []
    for rank in range(nproc):
        steps_ = []
        for i in range(steps):
            colls = []
            if comm_total > 0:
                start = parts["data"] + parts["compute"] * 0.5
                colls = [CollectiveTiming("allreduce", start, comm_total, parts["comm_exposed"])]
            steps_.append(
                StepParts(
                    step=i,
                    total_s=step_s,
                    compute_s=parts["compute"],
                    comm_exposed_s=parts["comm_exposed"],
                    data_s=parts["data"],
                    optimizer_s=parts["optimizer"],
                    idle_s=parts["idle"],
                    comm_total_s=comm_total,
                    collectives=colls,
                )
            )
        ranks.append(RankBreakdown(rank, "cpu", "markers", steps_, [step_s] * steps))
    return Breakdown(ranks)


# A frame that marks a py-spy sample as inside the training loop, and what each
# category's innermost frames look like (as tunekit's classifier reads them).
_LOOP_FRAME = {"name": "train_step", "file": "tunekit/runtime/session.py", "line": 1}
_CATEGORY_SAMPLES: dict[str, tuple[list[dict[str, Any]], bool, bool]] = {
    # category: (frames above the loop frame, active, owns_gil)
    "data_loading": (
        [
            {"name": "__getitem__", "file": "dataset.py", "line": 1},
            {"name": "batch", "file": "tunekit/runtime/data.py", "line": 1},
        ],
        True,
        True,
    ),
    "optimizer_step": ([{"name": "step", "file": "torch/optim/sgd.py", "line": 1}], True, True),
    "python": ([{"name": "loss_fn", "file": "train.py", "line": 1}], True, True),
    "native": ([{"name": "forward", "file": "torch/nn/modules/linear.py", "line": 1}], True, False),
    "idle": (
        [{"name": "wait", "file": "torch/distributed/distributed_c10d.py", "line": 1}],
        False,
        False,
    ),
}


def synthetic_telemetry(
    pyspy: Mapping[str, float] | None = None,
    *,
    nproc: int = 2,
    samples: int = 40,
    cpu_pct: float = 95.0,
    rss_bytes: int = 500 * 2**20,
) -> dict[str, Any]:
    """A telemetry summary shaped exactly like the sampler's, from synthetic samples.

    ``pyspy`` maps py-spy categories (``data_loading``, ``optimizer_step``,
    ``python``, ``native``, ``idle``) to shares of the stack samples; the
    samples are summarised by the real :func:`~tunekit.observe.telemetry.summarize_pyspy`
    (so flags such as ``data loading: 40% of stack samples`` appear as in a
    real run). Without ``pyspy`` the summary has host metrics only, as when
    py-spy is unavailable.
    """
    from tunekit.observe.telemetry import summarize_host, summarize_pyspy

    host_samples = [
        {
            "t": float(i),
            "data": {
                "ranks": {
                    str(r): {
                        "pid": 1000 + r,
                        "cpu_pct": cpu_pct,
                        "rss_bytes": rss_bytes,
                        "threads": 4,
                    }
                    for r in range(nproc)
                },
                "system": {
                    "cpu_pct": cpu_pct,
                    "mem_used_bytes": rss_bytes * nproc,
                    "mem_total_bytes": 64 * 2**30,
                    "mem_pct": 1.0,
                },
            },
        }
        for i in range(samples)
    ]
    out: dict[str, Any] = {
        "interval_s": 0.5,
        "duration_s": samples * 0.5,
        "notices": [],
        "errors": {},
        "samples": {"host": samples},
        "host": summarize_host(host_samples),
    }
    if pyspy:
        unknown = set(pyspy) - set(_CATEGORY_SAMPLES)
        if unknown:
            raise ValueError(
                f"unknown py-spy categories {sorted(unknown)}; known: {', '.join(_CATEGORY_SAMPLES)}"
            )
        cats = [c for c, share in pyspy.items() for _ in range(round(share * samples))]
        spy_samples = []
        for i, cat in enumerate(cats):
            frames, active, gil = _CATEGORY_SAMPLES[cat]
            thread = {
                "main": True,
                "name": "MainThread",
                "active": active,
                "owns_gil": gil,
                "frames": [*frames, _LOOP_FRAME],
            }
            spy_samples.append(
                {
                    "t": float(i),
                    "data": {
                        "ranks": {
                            str(r): {"pid": 1000 + r, "threads": [thread]} for r in range(nproc)
                        }
                    },
                }
            )
        out["samples"]["pyspy"] = len(spy_samples)
        out["pyspy"] = summarize_pyspy(spy_samples)
    return out


def synthetic_observation(
    workload: Workload | str | None = None,
    *,
    nproc: int = 2,
    hardware: Hardware | None = None,
    device_type: str = "cpu",
    step_s: float = 0.05,
    spread: float = 0.02,
    steps: int = 8,
    breakdown: Breakdown | Mapping[str, float] | bool = True,
    telemetry: Mapping[str, Any] | None = None,
    pyspy: Mapping[str, float] | None = None,
    graph: bool = True,
    layer_profile: bool = False,
    cache: bool = True,
) -> Observation:
    """An Observation as the orchestrator hands it to ``diagnose`` and ``plan``.

    The model summary and graph are real (traced from the workload); the
    baseline measurement, step breakdown and telemetry are made up from the
    arguments:

    * ``workload`` — a Workload, a workload name (``example:cnn``), or None
      for :func:`tiny_workload`;
    * ``step_s``, ``spread`` — the baseline's median step time and its
      relative step-to-step variation (``steps`` measured steps);
    * ``breakdown`` — a :class:`Breakdown`, fractions of the step per part
      (see :func:`synthetic_breakdown`), True for the defaults
      (80% compute, 10% exposed communication, 5% data, 5% optimizer on
      several ranks), or False for none (not profiled);
    * ``telemetry`` or ``pyspy`` — a ready summary, or py-spy category shares
      for :func:`synthetic_telemetry`;
    * ``layer_profile`` — True to time every layer for real (slower);
    * ``cache`` — give the observation a :class:`MemoryCache` (as in a study).
    """
    spec = "tunekit.testing:tiny_workload"
    if isinstance(workload, str):
        spec, workload = workload, load_workload(workload)
    elif workload is None:
        workload = tiny_workload()
    else:
        spec = f"<{workload.name}>"
    hardware = hardware or tiny_hardware(nproc, device_type)
    model = workload.model()
    example = workload.example_batch(workload.batch_size)[0]
    summary = summarize_model(model, example)
    traced = None
    if graph or layer_profile:
        from tunekit.observe.graph import trace_model

        traced = trace_model(model, example)
    profile = None
    if layer_profile:
        from tunekit.observe.layer_profile import profile_layers

        profile = profile_layers(
            model,
            example,
            traced,
            device="cpu",
            warmup=1,
            repeats=3,
            hardware_fingerprint=hardware.fingerprint(),
        )
    # Deterministic step-to-step variation around the median: +-spread, evenly spaced.
    offsets = [spread * (2 * i / max(steps - 1, 1) - 1) for i in range(steps)]
    times = sorted(step_s * (1 + o) for o in offsets)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    baseline = Measurement(
        step_s=times,
        median_s=statistics.median(times),
        spread_s=q[2] - q[0],
        samples_per_s=workload.batch_size * nproc / statistics.median(times),
    )
    measured: Breakdown | None = None
    if breakdown is True:
        fractions = dict(DEFAULT_FRACTIONS)
        if nproc < 2:  # one rank: no communication, that share is compute
            fractions["compute"] += fractions.pop("comm_exposed")
        measured = synthetic_breakdown(step_s, fractions, nproc=nproc)
    elif isinstance(breakdown, Mapping):
        measured = synthetic_breakdown(step_s, breakdown, nproc=nproc)
    elif isinstance(breakdown, Breakdown):
        measured = breakdown
    if telemetry is None and pyspy is not None:
        telemetry = synthetic_telemetry(pyspy, nproc=nproc)
    return Observation(
        workload_spec=spec,
        workload=workload,
        nproc=nproc,
        backend="nccl" if device_type == "cuda" else "gloo",
        device_type=device_type,
        hardware=hardware,
        model=summary,
        baseline=baseline,
        graph=traced,
        layer_profile=profile,
        breakdown=measured,
        telemetry=cast(TelemetrySummary, dict(telemetry)) if telemetry is not None else None,
        cache=MemoryCache() if cache else None,
    )
