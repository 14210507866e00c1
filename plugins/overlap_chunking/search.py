"""Every setting the cost model can price, ranked by predicted step time.

The paper tunes k by hand ("cannot be known in advance"); with a per-layer
profile and a fitted communication model every k (and every f) can be priced,
and so can a range of DDP bucket sizes. Settings that come out identical (a
larger bucket cap than the whole gradient, a k that only adds a parameter-free
layer to chunk 1 and so only posts it later) are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tunekit.plugins.overlap_chunking.model import (
    Prediction,
    StepCosts,
    ddp_buckets,
    predict_ddp,
    predict_two_chunk,
)

MB = 1024 * 1024
BUCKET_SIZES_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100, 200, 400)
DEFAULT_CAP_MB = 25.0
DEFAULT_FIRST_MB = 1.0


@dataclass
class Setting:
    """One priced setting."""

    knobs: dict[str, Any]
    prediction: Prediction
    label: str

    @property
    def mode(self) -> str:
        return self.knobs["mode"]


def ddp_settings(costs: StepCosts, first_bucket_settable: bool = True) -> list[Setting]:
    """Bucket caps from 256 KiB up to one bucket for everything, each with two first-bucket sizes.

    Where this torch cannot size the first bucket apart (no ``bucket_cap_mb_list``),
    an explicit cap sizes the first bucket too.
    """
    sizes = [b for layer in reversed(costs.layers) for b in layer.param_bytes]
    total = sum(sizes)
    seen: set[tuple] = set()
    out = []
    for cap_mb in BUCKET_SIZES_MB:
        for first_mb in (DEFAULT_FIRST_MB, cap_mb) if first_bucket_settable else (cap_mb,):
            if first_mb > cap_mb:
                continue
            layout = tuple(map(tuple, ddp_buckets(sizes, first_mb * MB, cap_mb * MB)))
            if layout in seen:
                continue
            seen.add(layout)
            knobs = {
                "mode": "ddp_buckets",
                "bucket_cap_mb": float(cap_mb),
                "first_bucket_mb": float(first_mb),
            }
            pred = predict_ddp(costs, first_mb * MB, cap_mb * MB)
            out.append(Setting(knobs, pred, f"DDP {cap_mb:g} MiB buckets, first {first_mb:g} MiB"))
        if cap_mb * MB >= total:
            break  # larger caps give the same single bucket
    return out


def two_chunk_settings(costs: StepCosts, boundaries: Sequence[bool] | None = None) -> list[Setting]:
    """Every k from the output end and every f the profile prices; with ``boundaries``
    (:func:`~tunekit.plugins.overlap_chunking.layers.block_boundaries`), only the k whose
    chunk 1 starts where ``boundaries`` allows: at a transformer block's border."""
    layers = costs.layers
    n = len(layers)
    if boundaries is not None and len(boundaries) != n:
        raise ValueError(f"{len(boundaries)} block boundaries for {n} layers")
    fcs = [i for i, c in enumerate(layers) if c.fc is not None]
    out = []
    for f in range(len(fcs) + 1):
        replicated = set(fcs[:f])
        seen: set[int] = set()
        for k in range(1, n + 1):
            if boundaries is not None and not boundaries[n - k]:
                continue  # chunk 1 would cut a transformer block
            chunk1 = sum(layers[i].nbytes for i in range(n - k, n) if i not in replicated)
            if chunk1 == 0 or chunk1 in seen:
                continue  # empty chunk 1, or the same chunk as a smaller k, posted later
            seen.add(chunk1)
            knobs = {"mode": "two_chunk", "k": k, "f": f}
            out.append(Setting(knobs, predict_two_chunk(costs, k, f), f"two chunks, k={k}, f={f}"))
    return out


TIE_TOLERANCE = 0.005
"""Predicted steps this close (relative) are a tie for the model."""


def rank_settings(
    costs: StepCosts,
    first_bucket_settable: bool = True,
    boundaries: Sequence[bool] | None = None,
) -> list[Setting]:
    """All settings, best predicted first.

    Settings within :data:`TIE_TOLERANCE` of each other are a tie for the
    model; a tie goes to the one that hides more of its communication (higher
    predicted R: it depends less on the link being as fast as fitted), then to
    fewer communications.
    """

    def key(s: Setting) -> tuple[float, int]:
        r = s.prediction.overlap_R or 0.0
        return s.prediction.step_s * (1 - TIE_TOLERANCE * r / 100), len(s.prediction.comms)

    return sorted(
        ddp_settings(costs, first_bucket_settable) + two_chunk_settings(costs, boundaries),
        key=key,
    )


def is_default_ddp(knobs: dict[str, Any]) -> bool:
    return (
        knobs["mode"] == "ddp_buckets"
        and knobs["bucket_cap_mb"] == DEFAULT_CAP_MB
        and knobs["first_bucket_mb"] == DEFAULT_FIRST_MB
    )


def shortlist(ranked: list[Setting], limit: int) -> list[Setting]:
    """The best ``limit`` settings, keeping the best of each mode in the list.

    The model is one model; when the best settings all share one mode, the best
    of the other mode still earns a trial (it replaces the last one).
    """
    if limit <= 0:
        return []
    top = ranked[:limit]
    if limit >= 2:
        for mode in ("ddp_buckets", "two_chunk"):
            if not any(s.mode == mode for s in top):
                best = next((s for s in ranked if s.mode == mode), None)
                if best is not None:
                    top[-1] = best
    return [s for s in ranked if s in top]
