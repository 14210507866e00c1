"""The layers layer_split plans: the traced graph's, with each attention core fused.

:func:`~tunekit.observe.graph.group_layers` cuts hand-written attention into
many small parameter-free layers (the q/k/v split and head reshapes, the score
matmul, its scaling, the causal mask, softmax, the value matmul). None of them
has a channel dimension of its own and their outputs are ``(N, heads, T, T)``
tensors: planning them one by one only adds redistributions. Here each
connected set of them -- grown from a matmul, softmax or masked_fill with no
parameters -- becomes one ``attention`` layer from the QKV projection's output
to the output projection's input, which the executor runs as its fx subgraph
on a worker's samples (:class:`~tunekit.plugins.layer_split.slices.SliceOps`).

Layers whose output has no batch dimension (``torch.arange(seq)``, a position
embedding of it: :meth:`~tunekit.observe.graph.ModelGraph.batched_nodes`) stay
as they are; :func:`~tunekit.plugins.layer_split.model.specs_from_graph`
marks them replicated: every rank computes them whole.
"""

from __future__ import annotations

import copy
import os

from tunekit.api import Layer, ModelGraph, layer_output

ATTENTION_SEEDS = frozenset(
    {"matmul", "bmm", "baddbmm", "softmax", "masked_fill", "scaled_dot_product_attention"}
)
"""Parameter-free ops an attention core is grown from."""

_MATMULS = frozenset({"matmul", "bmm", "baddbmm", "scaled_dot_product_attention"})
_SOFTMAXES = frozenset({"softmax", "scaled_dot_product_attention"})

_ABSORB_KINDS = frozenset({"other", "linear"})
"""Kinds of parameter-free neighbours an attention core absorbs (``linear``: a bare matmul)."""


def split_graph(graph: ModelGraph) -> ModelGraph:
    """A copy of ``graph`` with each attention core one ``attention`` layer (idempotent)."""
    if getattr(graph, "layer_split_units", False) or graph.method != "fx":
        return graph
    layers = graph.layers
    successors: dict[str, list[str]] = {v: [] for v in layers}
    for lay in layers.values():
        for src in lay.inputs:
            successors[src].append(lay.name)

    def absorbable(name: str) -> bool:
        lay = layers[name]
        return lay.param_bytes == 0 and lay.kind in _ABSORB_KINDS

    region_of: dict[str, int] = {}
    regions: list[list[str]] = []
    for lay in layers.values():
        anchor = graph.nodes[lay.nodes[0]]
        if lay.name in region_of or anchor.op not in ATTENTION_SEEDS or not absorbable(lay.name):
            continue
        members, todo = [], [lay.name]
        region_of[lay.name] = len(regions)
        while todo:
            v = todo.pop()
            members.append(v)
            for u in [*layers[v].inputs, *successors[v]]:
                if u not in region_of and absorbable(u):
                    region_of[u] = len(regions)
                    todo.append(u)
        ops = {graph.nodes[layers[v].nodes[0]].op for v in members}
        if ops & _MATMULS and ops & _SOFTMAXES:  # scores and their weights: attention
            regions.append(members)
        else:  # a lone softmax or matmul: left as the layers it was
            for v in members:
                region_of.pop(v)
    out = copy.deepcopy(graph)
    out.layer_split_units = True  # type: ignore[attr-defined]
    if not regions:
        return out
    order = {name: i for i, name in enumerate(graph.nodes)}
    layer_order = {name: i for i, name in enumerate(layers)}
    rename: dict[str, str] = {}
    fused: dict[str, Layer] = {}
    taken = set(layers)
    for members in regions:
        members.sort(key=layer_order.__getitem__)
        inside = set(members)
        boundary = sorted(
            {u for v in members for u in (*layers[v].inputs, *successors[v]) if u not in inside}
        )
        name = _attention_name(
            [b for b in boundary if layers[b].param_bytes], members[0], taken - inside
        )
        taken.add(name)
        for v in members:
            rename[v] = name
        nodes = sorted((n for v in members for n in layers[v].nodes), key=order.__getitem__)
        for n in nodes:
            out.nodes[n].layer = name
        inputs: list[str] = []
        for v in members:
            for u in layers[v].inputs:
                if u not in inside and u not in inputs:
                    inputs.append(u)
        member_nodes = [out.nodes[n] for n in nodes]
        last = layer_output(member_nodes, name, out.nodes)
        fused[members[0]] = Layer(
            name=name,
            kind="attention",
            nodes=nodes,
            inputs=inputs,
            output_shape=last.output_shape,
            param_numel=0,
            param_bytes=0,
            activation_bytes=last.activation_bytes,
            flops=sum(layers[v].flops for v in members),
            attrs={"fused": members},
        )
    new_layers: dict[str, Layer] = {}
    for v, lay in out.layers.items():
        if v in fused:
            new_layers[fused[v].name] = fused[v]
            continue
        if v in rename:
            continue
        ins: list[str] = []
        for u in lay.inputs:
            u = rename.get(u, u)
            if u not in ins:
                ins.append(u)
        lay.inputs = ins
        new_layers[v] = lay
    out.layers = new_layers
    return out


def _attention_name(neighbours: list[str], first: str, taken: set[str]) -> str:
    """``blocks_0_attn`` from ``blocks_0_attn_qkv`` and ``blocks_0_attn_proj``; else ``first``."""
    name = first
    if len(neighbours) >= 2:
        prefix = os.path.commonprefix(neighbours).rstrip("_")
        if prefix:
            name = f"{prefix}_core" if prefix in taken else prefix
    while name in taken:
        name += "_"
    return name


_REORDERS = frozenset({"transpose", "permute", "movedim", "swapaxes"})
_RESHAPE_OPS = frozenset({"flatten", "view", "reshape", "contiguous", "squeeze", "unsqueeze"})
_BROADCASTS = frozenset({"expand", "expand_as", "repeat"})
_FOLDABLE = frozenset(
    {
        "relu",
        "relu6",
        "leaky_relu",
        "gelu",
        "silu",
        "sigmoid",
        "tanh",
        "hardtanh",
        "hardswish",
        "elu",
        "selu",
        "dropout",
        "identity",
        "batch_norm",
    }
)


def runs_as_subgraph(graph: ModelGraph, layer: Layer, batched: set[str]) -> bool:
    """Whether the executor runs ``layer`` as its fx subgraph on a worker's samples (and so
    plans it with sample splits only, but for an attention core's head splits,
    :mod:`~tunekit.plugins.layer_split.heads`): a fused attention core; a layer without a batch
    dimension; a layer whose folded ops reorder its dims after a reshape (a ViT's patch
    embedding: conv, ``flatten(2)``, ``transpose(1, 2)``); a broadcast of per-model constants
    to the batch (``cls.expand(n, -1, -1)``); and a norm or embedding with folded ops beyond
    the elementwise (``ln(x)[:, 0]``)."""
    from tunekit.api import layer_output

    if layer.kind in ("input", "output"):
        return False
    nodes = graph.nodes
    if layer.kind == "attention":
        return True
    if layer_output([nodes[m] for m in layer.nodes], layer.name, nodes).name not in batched:
        return True
    ops = [nodes[m].op for m in layer.nodes[1:]]
    reshaped = False
    for op in ops:
        if op in _RESHAPE_OPS:
            reshaped = True
        elif op in _REORDERS and reshaped:
            return True
    anchor = nodes[layer.nodes[0]]
    if anchor.op in _BROADCASTS and anchor.inputs and not any(i in batched for i in anchor.inputs):
        return True
    if layer.kind in ("norm", "embedding"):
        return any(op not in _FOLDABLE | _RESHAPE_OPS for op in ops)
    return False
