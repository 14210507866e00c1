"""Runtime hooks: what the knobs do inside each worker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.runtime.session import Session
from tunekit.runtime.sync import DDPSync, ddp_supports_bucket_list

from tunekit.plugins.overlap_chunking.search import DEFAULT_CAP_MB, DEFAULT_FIRST_MB


def apply_ddp_buckets(session: Session, knobs: Mapping[str, Any]) -> None:
    """Rewrap the model in DDP with the chosen bucket sizes (state carries over)."""
    if session.world_size == 1:
        return  # nothing to reduce on one rank
    cap, first = knobs["bucket_cap_mb"], knobs["first_bucket_mb"]
    if (cap, first) == (DEFAULT_CAP_MB, DEFAULT_FIRST_MB):
        cap = first = None  # exactly PyTorch's defaults
    elif not ddp_supports_bucket_list():
        first = None  # this torch cannot size the first bucket: it takes the cap
    session.set_grad_sync(
        DDPSync(
            bucket_cap_mb=cap,
            first_bucket_mb=first,
            gradient_as_bucket_view=knobs["gradient_as_bucket_view"],
            static_graph=knobs["static_graph"],
        )
    )
