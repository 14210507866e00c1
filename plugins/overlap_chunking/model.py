"""Cost model: how much gradient communication a bucketing leaves exposed.

Gradients become ready during backward from the output end; a bucket's
all-reduce starts when its last gradient is ready and after the previous
bucket's all-reduce finished (one communication stream); whatever runs past
the end of backward is exposed and adds to the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class GradientTimeline:
    """Per parameter tensor, in the order backward produces their gradients."""

    nbytes: list[int]
    ready_s: list[float]
    """Time after backward starts at which each gradient is ready."""
    backward_s: float


def buckets_in_ready_order(nbytes: Sequence[int], first_cap: float, cap: float) -> list[list[int]]:
    """Indices grouped as DDP fills buckets: in ready order, first bucket capped at ``first_cap``."""
    buckets: list[list[int]] = [[]]
    size = 0
    limit = first_cap
    for i, b in enumerate(nbytes):
        if buckets[-1] and size + b > limit:
            buckets.append([])
            size = 0
            limit = cap
        buckets[-1].append(i)
        size += b
    return buckets


def exposed_communication(
    timeline: GradientTimeline,
    buckets: list[list[int]],
    allreduce_s: Callable[[float], float],
) -> tuple[float, list[tuple[float, float]]]:
    """Exposed time after backward, and each bucket's (start, end) of communication."""
    t_free = 0.0
    spans = []
    for bucket in buckets:
        ready = max(timeline.ready_s[i] for i in bucket)
        start = max(ready, t_free)
        end = start + allreduce_s(sum(timeline.nbytes[i] for i in bucket))
        spans.append((start, end))
        t_free = end
    return max(0.0, t_free - timeline.backward_s), spans
