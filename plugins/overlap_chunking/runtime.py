"""Runtime hooks: what the knobs do inside each worker, at a step boundary."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tunekit.api import DDPSync, Session, ddp_supports_bucket_list, summarize_model
from tunekit.plugins.overlap_chunking.layers import PaperLayer, chunk_plan, paper_layers
from tunekit.plugins.overlap_chunking.model import PIECE_BYTES
from tunekit.plugins.overlap_chunking.search import DEFAULT_CAP_MB, DEFAULT_FIRST_MB
from tunekit.plugins.overlap_chunking.two_chunk import TwoChunkSync

_layers_of: weakref.WeakKeyDictionary[nn.Module, list[PaperLayer]] = weakref.WeakKeyDictionary()


def session_layers(session: Session) -> list[PaperLayer]:
    """The paper's layers of the session's model, summarised once per model.

    The summary runs one forward pass on a 2-sample example batch in eval mode
    under ``no_grad``, with the RNG state saved and restored, so that training
    state (BatchNorm statistics, dropout draws) is left exactly as it was.
    """
    model = session.model
    if model not in _layers_of:
        inputs = session.workload.example_batch(2)[0]
        inputs = inputs.to(session.device) if isinstance(inputs, torch.Tensor) else inputs
        modes = {m: m.training for m in model.modules()}
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        try:
            model.eval()
            summary = summarize_model(model, inputs)
        finally:
            for m, mode in modes.items():
                m.training = mode
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        _layers_of[model] = paper_layers(summary)
    return _layers_of[model]


def apply_ddp_buckets(session: Session, knobs: Mapping[str, Any]) -> None:
    """Rewrap the model in DDP with the chosen bucket sizes (state carries over).

    Communications are timed (``DDPSync(measure=True)``) so every trial and the
    live job report the overlap ratio R.
    """
    cap, first = float(knobs["bucket_cap_mb"]), float(knobs["first_bucket_mb"])
    if (cap, first) == (DEFAULT_CAP_MB, DEFAULT_FIRST_MB):
        cap = first = None  # exactly PyTorch's defaults
    elif not ddp_supports_bucket_list():
        first = None  # this torch cannot size the first bucket: it takes the cap
    session.set_grad_sync(
        DDPSync(
            bucket_cap_mb=cap,
            first_bucket_mb=first,
            gradient_as_bucket_view=bool(knobs["gradient_as_bucket_view"]),
            static_graph=bool(knobs["static_graph"]),
            measure=True,
        )
    )


def apply_two_chunk(session: Session, k: int, f: int, piece_bytes: int = PIECE_BYTES) -> None:
    """Install Lee et al.'s two-chunk reducer with chunk boundary ``k`` and ``f`` replicated FC layers."""
    plan = chunk_plan(session_layers(session), int(k), int(f))
    sync = TwoChunkSync(plan.chunk1, plan.replicated, label=f"k={k} f={f}", piece_bytes=piece_bytes)
    session.set_grad_sync(sync)


TWO_CHUNK_NEEDS = {
    "accumulation": "every micro-batch in a replicated layer's gradient (f > 0 gathers one "
    "micro-batch's activations and errors)",
    "amp": "a replicated layer's deferred gradient under autocast (f > 0 computes it from "
    "gathered activations outside the forward)",
    "grad_scaler": "the loss scale's inf check over the whole gradient before any update (f > 0 "
    "updates replicated layers at their next forward)",
    "scheduler": "the step's learning rate for every update (f > 0 updates replicated layers "
    "after the scheduler has stepped)",
    "clipping": "the whole gradient's norm before any update (f > 0 updates replicated layers "
    "from gathered data at their next forward)",
    "checkpointed": "a replicated layer's forward to run once per step (f > 0 gathers its "
    "activations in a forward hook, which a checkpointed block's recomputation runs again)",
}
"""What two_chunk with replicated layers (f > 0) would need to honour each feature;
f = 0 and the ddp_buckets mode honour them all."""


SHARDED_WHY = (
    "does not apply: the job is sharded (FSDP), which reduce-scatters each block's gradients "
    "itself; DDP's buckets and the two-chunk reducer have no gradients of their own to chunk "
    "there (a config of this tuner is refused on a sharded job)"
)


def declines(knobs: Mapping[str, Any], features: frozenset[str]) -> str | None:
    """Why a config cannot train a job using ``features`` ("does not apply: ..."), or None."""
    from tunekit.api import declined_features

    if knobs.get("mode") != "two_chunk" or not int(knobs.get("f", 0)):
        return None
    return declined_features(features, frozenset(), TWO_CHUNK_NEEDS)


def apply_overlap_chunking(session: Session, knobs: Mapping[str, Any]) -> None:
    """Install the grad-sync strategy ``knobs`` describe (nothing to do on one rank)."""
    if session.world_size == 1:
        return
    if knobs["mode"] == "two_chunk":
        apply_two_chunk(session, knobs["k"], knobs["f"])
    else:
        apply_ddp_buckets(session, knobs)
