"""Layers as Lee et al. count them, and the gradient chunks a (k, f) setting makes.

The paper counts VGG-A as 16 layers: 8 convolutions, 5 pooling layers and 3
fully-connected layers. Activations, dropout and flattening are not layers of
their own. So a layer here is a module with parameters of its own, or a pooling
layer that changes the shape of what it pools (torchvision's VGG ends its
features with an ``AdaptiveAvgPool2d`` that is the identity at 224x224; the
paper's VGG-A has no such layer, and counting it would shift every k by one).

``k`` counts layers from the output end: the gradients of the last k layers
(reached first in backprop) form chunk 1; the rest form chunk 2. ``f`` is the
number of leading fully-connected layers (``nn.Linear``, in forward order)
whose gradients are computed from gathered activations and errors instead of
all-reduced; their parameters are in neither chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.api import LayerInfo, ModelSummary, block_units, unit_starts
from tunekit.errors import ConfigError

FC_TYPE = "Linear"


def is_pool(type_name: str) -> bool:
    """Pooling layers: MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, LPPool1d, ..."""
    return "Pool" in type_name


@dataclass(frozen=True)
class PaperLayer:
    """One layer in the paper's sense."""

    name: str
    """Module path (``features.3``)."""
    type: str
    param_names: tuple[str, ...]
    param_numel: int
    output_shape: tuple[int, ...] | None

    @property
    def is_fc(self) -> bool:
        return self.type == FC_TYPE


def _contains(outer: str, inner: str) -> bool:
    """Whether module path ``inner`` lies inside module ``outer`` ('' is the model itself)."""
    return inner != outer and (outer == "" or inner.startswith(outer + "."))


def _in_forward_order(summary: ModelSummary) -> list[LayerInfo]:
    """The summary's modules with each container moved to where its forward starts.

    The summary lists a module when its forward *ends*, so a container that
    owns parameters of its own (a transformer's position embedding on the
    model itself) comes after everything it contains: at the output end, as if
    its gradients were ready first. Its forward starts before its first
    contained module's, and backprop passes it after all of them.
    """
    names = [info.name for info in summary.layers]
    ordered = [info for info in summary.layers if not any(_contains(info.name, n) for n in names)]
    for info in summary.layers:
        if info in ordered:
            continue
        first = next(i for i, other in enumerate(ordered) if _contains(info.name, other.name))
        ordered.insert(first, info)
    return ordered


def paper_layers(summary: ModelSummary) -> list[PaperLayer]:
    """The model's layers as Lee et al. count them, in forward order (output end last).

    A container owning parameters of its own counts as a layer where its
    forward starts (see :func:`_in_forward_order`); its output shape is not a
    layer's and does not decide whether a pooling layer changes a shape.
    """
    names = {info.name for info in summary.layers}
    out: list[PaperLayer] = []
    prev_shape = None
    for info in _in_forward_order(summary):
        container = any(_contains(info.name, n) for n in names)
        shape = tuple(info.output_shape) if info.output_shape is not None else None
        shape_changed = shape is None or prev_shape is None or shape != prev_shape
        if info.param_numel > 0 or (is_pool(info.type) and shape_changed):
            out.append(
                PaperLayer(info.name, info.type, tuple(info.param_names), info.param_numel, shape)
            )
        if shape is not None and not container:
            prev_shape = shape
    return out


def fc_layers(layers: list[PaperLayer]) -> list[PaperLayer]:
    """The fully-connected layers, in forward order (the first f of them may be replicated)."""
    return [layer for layer in layers if layer.is_fc]


@dataclass(frozen=True)
class ChunkPlan:
    """What a (k, f) setting does to one model."""

    k: int
    f: int
    chunk1: tuple[str, ...]
    """Parameter names reduced first: the last k layers, output end first."""
    chunk2: tuple[str, ...]
    """Parameter names reduced after backprop: the other layers, output end first."""
    replicated: tuple[str, ...]
    """Module names of the f fully-connected layers whose gradient is replicated."""
    boundary: str
    """Name of the last layer of chunk 1 (the k-th from the output end)."""

    def numel(self, layers: list[PaperLayer]) -> tuple[int, int]:
        """Parameter counts of chunk 1 and chunk 2."""
        c1, c2 = set(self.chunk1), set(self.chunk2)
        return (
            sum(layer.param_numel for layer in layers if c1.intersection(layer.param_names)),
            sum(layer.param_numel for layer in layers if c2.intersection(layer.param_names)),
        )


def chunk_plan(layers: list[PaperLayer], k: int, f: int) -> ChunkPlan:
    """Chunks and replicated layers for ``k`` and ``f`` (ConfigError when out of range).

    Erratum (NOTES.md, Lee et al. Algorithm 2): the algorithm posts chunk 1 "if l
    is equal to k", with l counting down from L-1; chunk 1 = layers [L-k, L-1] is
    only complete at l = L-k, as Section III-C.3's prose says. We follow the prose.
    Likewise Algorithm 2's range {s, ..., s+f} names f+1 layers; the prose (and
    its 2f+2 communications) has f of them, {s, ..., s+f-1}.
    """
    n = len(layers)
    fcs = fc_layers(layers)
    if not 1 <= k <= n:
        raise ConfigError(
            f"overlap_chunking.k: {k} is out of range; this model has {n} layers as "
            "Lee et al. count them (layers with parameters, and pooling layers), so k is 1.."
            f"{n}"
        )
    if not 0 <= f <= len(fcs):
        raise ConfigError(
            f"overlap_chunking.f: {f} is out of range; this model has {len(fcs)} "
            f"fully-connected layers, so f is 0..{len(fcs)}"
        )
    replicated = {layer.name for layer in fcs[:f]}

    def params(part: list[PaperLayer]) -> tuple[str, ...]:
        return tuple(
            p for layer in reversed(part) if layer.name not in replicated for p in layer.param_names
        )

    return ChunkPlan(
        k=k,
        f=f,
        chunk1=params(layers[n - k :]),
        chunk2=params(layers[: n - k]),
        replicated=tuple(layer.name for layer in fcs[:f]),
        boundary=layers[n - k].name,
    )


def block_boundaries(layers: list[PaperLayer]) -> tuple[bool, ...] | None:
    """Per layer: whether a chunk may start there -- chunk 1 = ``layers[i:]`` ends at a
    transformer block's border (the layer is outside any block, or starts one) -- or None
    when the model has no transformer blocks (any ``k`` is a boundary: CNNs as Lee et al.
    chunk them). See :mod:`tunekit.observe.blocks`."""
    units = block_units([(layer.name, layer.type) for layer in layers])
    return None if units is None else unit_starts(units)
