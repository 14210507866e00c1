"""Candidate bucket sizes, ranked by the cost model."""

from __future__ import annotations

from collections.abc import Callable

from tunekit.plugins.overlap_chunking.model import (
    GradientTimeline,
    buckets_in_ready_order,
    exposed_communication,
)

MB = 1024 * 1024
BUCKET_SIZES_MB = (0.5, 1, 2, 4, 8, 16, 25, 50, 100, 200)
DEFAULT_CAP_MB = 25.0
DEFAULT_FIRST_MB = 1.0


def rank_bucket_sizes(
    timeline: GradientTimeline, allreduce_s: Callable[[float], float], compute_s: float
) -> list[tuple[float, float, float]]:
    """(bucket_cap_mb, predicted step, exposed communication) for each size, best first.

    Sizes far beyond the whole gradient are the same as one bucket and are
    dropped, except the largest useful one.
    """
    total = sum(timeline.nbytes)
    rows = []
    for cap_mb in BUCKET_SIZES_MB:
        if cap_mb * MB > 2 * total and rows and rows[-1][0] * MB >= total:
            break
        cap = cap_mb * MB
        buckets = buckets_in_ready_order(timeline.nbytes, cap, cap)
        exposed, _ = exposed_communication(timeline, buckets, allreduce_s)
        rows.append((cap_mb, compute_s + exposed, exposed))
    return sorted(rows, key=lambda r: r[1])


def default_exposed(timeline: GradientTimeline, allreduce_s: Callable[[float], float]) -> float:
    """Exposed communication under PyTorch's defaults (1 MiB first bucket, then 25 MiB)."""
    buckets = buckets_in_ready_order(timeline.nbytes, DEFAULT_FIRST_MB * MB, DEFAULT_CAP_MB * MB)
    return exposed_communication(timeline, buckets, allreduce_s)[0]
