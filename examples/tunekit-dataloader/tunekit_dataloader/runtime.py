"""The runtime hook: the loader options of every worker's batch source.

tunekit's batch source builds a ``torch.utils.data.DataLoader`` over the
workload's dataset with a sampler that makes each batch a pure function of the
step, so worker processes change where batches are made, never which.
Setting options drops the current loader (its workers exit); the next batch
starts one with the new options. Only dataset workloads have a loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.api import LoaderOptions, Session


def loader_options(knobs: Mapping[str, Any]) -> LoaderOptions:
    workers = int(knobs["num_workers"])
    return LoaderOptions(
        num_workers=workers,
        pin_memory=bool(knobs["pin_memory"]),
        prefetch_factor=int(knobs["prefetch_factor"]) if workers > 0 else None,
    )


def apply_loader_options(session: Session, knobs: Mapping[str, Any]) -> None:
    """Set the loader options; the session's reset puts the previous ones back."""
    if session.workload.dataset is None:
        return  # batches come from make_batch: there is no loader
    previous = session.data.options
    session.data.set_options(loader_options(knobs))
    session.on_reset(lambda: session.data.set_options(previous))
