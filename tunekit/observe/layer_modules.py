"""From the names in a layer profile (and a traced graph) to the model's modules.

A layer profile and a :class:`~tunekit.observe.graph.ModelGraph` name layers by
their anchor node (``blocks_0_attn_qkv`` under ``torch.fx``,
``transformer_h_0_attn_c_attn_linear`` under ``torch.export``, the module path
itself in the hooks fallback). A plugin that acts on modules (wraps a block, hooks
a layer) needs the module behind each name: :func:`layer_modules` gives it, for
every model and every capture method, with the repeated block the layer runs in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tunekit.observe.blocks import block_of


@dataclass(frozen=True)
class LayerModule:
    """The module behind one layer of a graph or a layer profile."""

    layer: str
    """The layer's name, as the graph and the layer profile key it."""
    path: str | None
    """The module's path in the model (``blocks.0.attn.qkv``, for ``model.get_submodule``);
    None for a layer that is a function, not a module call (a matmul, a residual add)."""
    type: str
    """The module's class name (``Linear``, ``LayerNorm``), as ``GraphNode.module_type``
    gives it; empty for a function."""
    block: str | None
    """The repeated block the layer runs in (``blocks.0``: its path up to the first numeric
    part; a function runs in the block of the layer before it), None outside any."""
    module: nn.Module | None = field(default=None, compare=False, repr=False)
    """The module itself, when :func:`layer_modules` was given the model."""


def layer_modules(graph: Any, model: nn.Module | None = None) -> dict[str, LayerModule]:
    """Every layer of ``graph`` (a :class:`~tunekit.observe.graph.ModelGraph`), in model order,
    by name -> the module it calls (resolved in ``model`` when given) and its block.

    ``obs.layer_profile.layers`` uses the same names, so
    ``layer_modules(obs.graph, model)[timing.name]`` is the module a timing measured.
    """
    out: dict[str, LayerModule] = {}
    block: str | None = None
    for name, layer in graph.layers.items():
        anchor = graph.nodes.get(layer.nodes[0]) if layer.nodes else None
        if anchor is not None and anchor.module_type is not None:  # a module call
            path, kind = anchor.target, anchor.module_type
            block = block_of(path)
        else:
            path, kind = None, ""
        module = model.get_submodule(path) if model is not None and path else None
        out[name] = LayerModule(name, path, kind, block, module)
    return out
