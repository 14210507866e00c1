"""Transformer blocks among a model's layers: the units that gradient chunks keep whole.

A chunk of gradients that ends inside a transformer block splits the block's
attention from its MLP (or a LayerNorm from the projection it feeds): the
block's gradients then travel in two messages for no gain, and the chunk no
longer matches what the profile and the report show per block. Tuners that
group layers (overlap_chunking's two chunks, cgdp's chunks of k) group whole
blocks on a model that has them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

NORM_TYPES = ("LayerNorm", "RMSNorm")
"""A repeated block holding one of these (or a class named ``…LayerNorm``/``…RMSNorm``:
Llama's ``LlamaRMSNorm``, T5's ``T5LayerNorm``) is a transformer block."""


def is_norm(kind: str) -> bool:
    return kind.endswith(NORM_TYPES)


def block_of(name: str) -> str | None:
    """The repeated block a module path lies in: ``blocks.3`` for ``blocks.3.attn.qkv`` (the
    path up to its first numeric part), None for a module outside any (``ln``, ``head``)."""
    parts = name.split(".")
    for j, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: j + 1])
    return None


def block_units(layers: Sequence[tuple[str, str]]) -> list[str] | None:
    """Per layer ``(name, type)``, in model order: the unit it belongs to -- its repeated
    block (``blocks.3``), or its own name outside any -- or None when the model has no
    transformer blocks (a repeated block of two or more layers with a LayerNorm or
    RMSNorm among them). Consecutive layers of one unit stay together.

    ``name`` is the module's path (``blocks.3.attn.qkv``: the block is read from it) and
    ``type`` its class name (``Linear``, ``LayerNorm``: ``type(module).__name__``, as
    ``GraphNode.module_type`` holds it), e.g. ``[(n, type(m).__name__) for n, m in
    model.named_modules() if not list(m.children())]``. For a traced graph use
    :func:`graph_units`, and :func:`~tunekit.observe.layer_modules.layer_modules` for the
    module behind each layer name."""
    return path_units([(name, name, kind) for name, kind in layers])


def path_units(layers: Sequence[tuple[str, str | None, str]]) -> list[str] | None:
    """:func:`block_units` for layers ``(name, module path or None, module type)`` of a traced
    graph: a function (no module path: attention's matmuls, a residual add) belongs to the
    block of the layer before it, the block it runs in. Under ``torch.export`` every op has
    the path of the module that ran it: the block's own path (``h.0``, GPT-2's residual
    adds in ``GPT2Block.forward``) is that block."""
    known = {b for _, path, _ in layers if path and (b := block_of(path))}
    blocks: list[str | None] = []
    for _, path, _ in layers:
        if path:
            blocks.append(block_of(path) or (path if path in known else None))
        else:
            blocks.append(blocks[-1] if blocks else None)
    members: dict[str, list[str]] = {}
    for block, (_, path, kind) in zip(blocks, layers, strict=True):
        if block is not None and path:
            members.setdefault(block, []).append(kind)
    if not any(len(kinds) >= 2 and any(is_norm(k) for k in kinds) for kinds in members.values()):
        return None
    return [b if b is not None else name for b, (name, _, _) in zip(blocks, layers, strict=True)]


def graph_units(graph: Any) -> dict[str, str] | None:
    """Layer name -> unit for a traced :class:`~tunekit.observe.graph.ModelGraph` (its layers'
    anchor modules), or None without transformer blocks."""
    rows = []
    for name, layer in graph.layers.items():
        anchor = graph.nodes.get(layer.nodes[0]) if layer.nodes else None
        if anchor is not None and anchor.module_type is not None:  # a module call
            rows.append((name, anchor.target, anchor.module_type))
        else:
            rows.append((name, None, ""))
    units = path_units(rows)
    return None if units is None else dict(zip(graph.layers, units, strict=True))


def unit_starts(units: Sequence[str]) -> tuple[bool, ...]:
    """Per layer: whether it starts a unit (a chunk may begin there)."""
    return tuple(i == 0 or u != units[i - 1] for i, u in enumerate(units))


def block_table(
    layers: Sequence[Mapping[str, Any]], units: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Per-layer rows (``name``, ``forward_s``, ``backward_s``, ``flops``; model order) summed
    per unit (``units``: layer name -> unit, as :func:`graph_units` gives them; a layer
    without one is its own): one row per unit, where it first appears, with every layer of
    it, wherever they run."""
    out: dict[str, dict[str, Any]] = {}
    for row in layers:
        unit = units.get(row["name"], row["name"])
        entry = out.setdefault(
            unit, {"unit": unit, "layers": 0, "forward_s": 0.0, "backward_s": 0.0, "flops": 0}
        )
        entry["layers"] += 1
        entry["forward_s"] += row["forward_s"]
        entry["backward_s"] += row["backward_s"]
        entry["flops"] += row.get("flops") or 0
    return list(out.values())


def report_units(graph: Any) -> dict[str, str] | None:
    """:func:`graph_units` for the per-block table: outside the blocks, a ``torch.export``
    graph's layers are grouped by the module that ran them, so the ops a model runs itself
    (positions, the attention mask a Hugging Face model builds: twenty-odd small layers) make
    one row under its path instead of a row each."""
    units = graph_units(graph)
    if units is None or getattr(graph, "method", "") != "export":
        return units
    out = dict(units)
    for name, unit in units.items():
        layer = graph.layers[name]
        anchor = graph.nodes.get(layer.nodes[0]) if layer.nodes else None
        if unit == name and anchor is not None and anchor.module_type is not None:
            out[name] = anchor.target or name
    return out


def profile_blocks(
    graph: Any, profile: Any, batch_size: int | None = None
) -> list[dict[str, Any]] | None:
    """A layer profile's layers summed per transformer block (their forward FLOPs from
    ``graph``, at ``batch_size`` samples, default the graph's), or None when the model
    has no blocks or nothing was profiled."""
    units = report_units(graph) if graph is not None else None
    if units is None or profile is None:
        return None
    scale = (batch_size or graph.batch_size) / graph.batch_size if graph.batch_size else 1.0
    rows = [
        {"name": t.name, "forward_s": t.forward_s, "backward_s": t.backward_s,
         "flops": graph.layers[t.name].flops * scale if t.name in graph.layers else 0}
        for t in profile.layers.values()
    ]  # fmt: skip
    return block_table(rows, units)
