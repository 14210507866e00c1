"""What the knobs do inside each worker.

The layout (sharding, resharding, offload, checkpointing) is the core's to apply: the
tuner's ``layout`` hook returns it, a trial builds its session with it and a live job
relaunches from its sharded checkpoint when its build part changes. What is left here is
the split of each rank's samples per step into micro-batches, at the step boundary
(``Session.set_micro_batches``; the session's reset restores the workload's split).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.api import Session


def apply_micro_batches(session: Session, knobs: Mapping[str, Any]) -> None:
    micro = int(knobs.get("micro_batches", 0) or 0)
    if micro and micro != session.accumulation:
        session.set_micro_batches(micro)
