"""Attention split by heads: which fused attention cores can be, and a worker's share of them.

A fused attention core (:mod:`~tunekit.plugins.layer_split.units`) reads the QKV
projection's output, ``(N, T, 3C)`` packed as q | k | v, and gives ``(N, T, C)``
with the heads side by side along C. Its heads are independent: a worker can
compute heads ``[h0, h1)`` for every sample, and its output slice is then the
channel range ``[h0 D, h1 D)`` of the core's output (D = C / heads). That is the
core's channel dimension (canonical dim 2 of a ``(N, T, C)`` tensor: the ``h``
of a config); a worker reads its samples' whole q | k | v.

The user's attention code cannot simply run on fewer heads (its head count is a
constant in the traced graph), so a worker computes its heads here, the way
multi-head attention is defined: ``softmax(q kᵀ / √D [+ causal mask]) v`` per
head. :func:`heads_of` reads the head count and the mask from the traced core;
the executor then checks, numerically and once, that the core computes exactly
this on every head before it runs a head split (a core that differs -- another
scale, a bias, dropout -- keeps its sample splits only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_VIEWS = frozenset({"view", "reshape"})


@dataclass(frozen=True)
class Heads:
    """How a fused attention core lays out its heads."""

    count: int
    causal: bool
    seq: int
    """Tokens per sample at the trace (T)."""
    width: int
    """Channels of the core's output (C = count x head dim)."""

    @property
    def head_dim(self) -> int:
        return self.width // self.count

    def span(self, c0: int, c1: int) -> tuple[int, int]:
        """Heads ``[h0, h1)`` of the output channels ``[c0, c1)`` (whole heads only)."""
        d = self.head_dim
        if c0 % d or c1 % d:
            raise ValueError(f"channels [{c0}, {c1}) do not cover whole heads of {d}")
        return c0 // d, c1 // d


def heads_of(graph, layer) -> Heads | None:
    """The head layout of fused attention ``layer`` of ``graph``, or None when it does not
    read one packed ``(N, T, 3C)`` tensor into a ``(N, T, C)`` output through a 4-D view
    ``(N, T, heads, C / heads)``."""
    if layer.kind != "attention" or len(layer.inputs) != 1:
        return None
    src = graph.layers[layer.inputs[0]].output_shape
    out = layer.output_shape
    if not src or not out or len(src) != 3 or len(out) != 3 or src[2] != 3 * out[2]:
        return None
    n, t, c = out
    count = None
    causal = False
    for name in layer.nodes:
        node = graph.nodes[name]
        shape = node.output_shape or []
        if (
            node.op in _VIEWS
            and len(shape) == 4
            and shape[:2] == [n, t]
            and shape[2] * shape[3] == c
        ):
            if count not in (None, shape[2]):
                return None  # two head counts: not one attention
            count = shape[2]
        causal = causal or node.op in ("masked_fill", "triu")
    if not count or count < 2:
        return None
    return Heads(count, causal, t, c)


def attend(qkv: torch.Tensor, heads: Heads, h0: int, h1: int) -> torch.Tensor:
    """Heads ``[h0, h1)`` of multi-head attention over packed ``qkv`` ``(n, T, 3C)``:
    ``(n, T, (h1 - h0) D)``, the channels ``[h0 D, h1 D)`` of the whole core's output."""
    n, t, _ = qkv.shape
    c, d, k = heads.width, heads.head_dim, h1 - h0
    q, k_, v = qkv.split(c, dim=2)
    q, k_, v = (z[..., h0 * d : h1 * d].reshape(n, t, k, d).transpose(1, 2) for z in (q, k_, v))
    scores = (q @ k_.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    if heads.causal:
        mask = torch.ones(t, t, dtype=torch.bool, device=qkv.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(n, t, k * d)
