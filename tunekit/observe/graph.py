"""The model as a graph of layers: what ``layer_split`` and ``hybrid_mp`` plan over.

:func:`trace_model` traces a module with ``torch.fx`` and runs shape
propagation on an example batch, recording per node the normalised op kind,
the output shape and bytes, the parameters the node's module owns, and its
forward FLOPs (``torch.utils.flop_counter.FlopCounterMode``, counted per node
while the traced graph runs). Nodes are then grouped into :class:`Layer` s,
the unit the papers reason about: a conv/linear/pool/concat/add... with the
elementwise ops that follow it (relu, batch norm, dropout, flatten, views)
folded in. Branches stay branches: Inception's towers come out as parallel
layers feeding a ``concat`` layer.

Models ``torch.fx`` cannot trace (data-dependent control flow, unsupported
Python; every Hugging Face ``transformers`` model) are captured with
``torch.export`` next (:mod:`tunekit.observe.graph_export`): ATen-level nodes
named after their modules, attention written out as its matmuls, branches
kept. Only when that fails too does capture fall back to forward hooks on leaf
modules: a chain of layers in the order the forward pass first calls them.
:attr:`ModelGraph.method` says which was used and :attr:`ModelGraph.notice` why.

Capture runs the model in training mode, as it trains (dropout in the graph,
no inference fast path such as native multi-head attention hiding FLOPs);
buffers (batch-norm statistics) and the global RNG are restored afterwards. A model that cannot even run on the example batch raises
:class:`~tunekit.errors.WorkloadError`.

:meth:`ModelGraph.graph_hash` is stable across processes and runs (op kinds,
shapes, parameter counts, edges; no object ids), so the study store can key
cached profiles by it.

One module, though long: tracing (fx, export, the hooks fallback), the grouping
of nodes into layers and the per-node facts (shapes, bytes, FLOPs) build one
``ModelGraph`` together, and each step reads what the one before recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.operator_schemas import normalize_function
from torch.utils.flop_counter import FlopCounterMode

from tunekit.errors import WorkloadError

__all__ = ["GraphNode", "Layer", "ModelGraph", "trace_model", "layer_kind", "normalise_op"]


@dataclass
class GraphNode:
    """One operation of the traced forward pass."""

    name: str
    """Unique: the fx node name, or the module path in the hook fallback."""
    op: str
    """Normalised op kind, lower case: ``conv2d``, ``linear``, ``max_pool2d``, ``relu``,
    ``batch_norm``, ``add``, ``cat``, ``flatten``, ``getitem``, ``input``, ``output`` ..."""
    target: str
    """Module path for module calls, function or method name otherwise."""
    module_type: str | None
    """Class name of the called module (``Conv2d``), None for functions and methods."""
    inputs: list[str]
    """Producer node names, data (tensor) edges only, in argument order."""
    output_shape: list[int] | None
    """At the trace batch size; the first tensor if the node returns several."""
    output_dtype: str | None
    param_numel: int
    """Parameters owned by this node's module, counted once per model (0 for functions)."""
    param_bytes: int
    activation_bytes: int
    """Bytes of every tensor this node outputs, at the trace batch size."""
    flops: int
    """Forward FLOPs at the trace batch size, as ``FlopCounterMode`` counts them
    (matmuls, convolutions, attention; LayerNorm by :func:`flop_counter`; other
    elementwise ops count 0)."""
    layer: str | None = None
    """The :class:`Layer` this node belongs to (None for non-tensor shape arithmetic)."""
    attrs: dict[str, Any] = field(default_factory=dict)
    """conv: in/out_channels, kernel_size, stride, padding, dilation, groups;
    linear: in/out_features; pool: kernel_size, stride, padding (or output_size)."""


@dataclass
class Layer:
    """The unit the papers reason about: a conv/linear/pool/concat/add ... with the
    elementwise ops (relu, batch_norm, dropout, flatten) that follow it folded in."""

    name: str
    """The anchor node's name."""
    kind: str
    """``conv``, ``linear``, ``pool``, ``concat``, ``add``, ``norm``, ``embedding``,
    ``rnn``, ``input``, ``output`` or ``other``."""
    nodes: list[str]
    """Member node names in topological order; the first is the anchor op."""
    inputs: list[str]
    """Producer layer names (data edges; duplicates removed, order kept)."""
    output_shape: list[int] | None
    param_numel: int
    param_bytes: int
    activation_bytes: int
    """Bytes of the layer's output at the trace batch size."""
    flops: int
    """Forward FLOPs summed over member nodes."""
    attrs: dict[str, Any] = field(default_factory=dict)
    """The anchor node's attrs."""


@dataclass
class ModelGraph:
    """Nodes and layers of one model, in topological order."""

    nodes: dict[str, GraphNode]
    layers: dict[str, Layer]
    batch_size: int
    """Batch the shapes, bytes and FLOPs were recorded at."""
    method: str
    """``fx``; ``export`` (``torch.export``, ATen-level nodes) where fx fails; or ``hooks``
    for the last fallback (a chain of leaf modules)."""
    notice: str = ""
    """Empty, or why ``torch.fx`` could not be used."""
    module: Any = field(default=None, repr=False, compare=False)
    """``export`` only: the captured GraphModule whose nodes these are (for running layers
    one at a time); not serialised, so a graph read back from the store has None."""

    def layer_edges(self) -> list[tuple[str, str]]:
        """Every (producer layer, consumer layer) pair, in consumer order."""
        return [(src, layer.name) for layer in self.layers.values() for src in layer.inputs]

    def successors(self, layer: str) -> list[str]:
        return [name for name, lay in self.layers.items() if layer in lay.inputs]

    def predecessors(self, layer: str) -> list[str]:
        return list(self.layers[layer].inputs)

    def total_params(self) -> int:
        return sum(n.param_numel for n in self.nodes.values())

    def total_flops(self) -> int:
        return sum(n.flops for n in self.nodes.values())

    def graph_hash(self) -> str:
        """Stable id of the model's structure at this batch size (keys the study store)."""
        index = {name: i for i, name in enumerate(self.nodes)}
        shape = {
            "batch": self.batch_size,
            "nodes": [
                [
                    n.op,
                    n.module_type,
                    n.output_shape,
                    n.output_dtype,
                    n.param_numel,
                    [index[i] for i in n.inputs],
                ]
                for n in self.nodes.values()
            ],
        }
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def batched_nodes(self) -> set[str]:
        """Tensor nodes whose first dim is the batch (one row per sample).

        A node is batched when its first dim equals the trace batch and it is a
        model input or reads a tensor: ``torch.arange(seq)``, a position
        embedding of it or an attention mask built from ``scores[0, 0]`` are not
        (they are per-model constants every sample shares). The test is by
        shape, so a per-model constant whose first dim happens to equal the
        trace batch reads as batched; trace at a batch no other dim equals.
        """
        out: set[str] = set()
        for n in self.nodes.values():
            shape = n.output_shape
            if not shape or shape[0] != self.batch_size:
                continue
            if n.op == "input" or n.inputs:
                out.add(n.name)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "method": self.method,
            "notice": self.notice,
            "nodes": [asdict(n) for n in self.nodes.values()],
            "layers": [asdict(lay) for lay in self.layers.values()],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelGraph:
        return cls(
            nodes={n["name"]: GraphNode(**n) for n in d["nodes"]},
            layers={lay["name"]: Layer(**lay) for lay in d["layers"]},
            batch_size=int(d["batch_size"]),
            method=d["method"],
            notice=d.get("notice", ""),
        )

    def layer_label(self, name: str) -> str:
        """The layer as the model names it: its module's path and class (``features.3 Conv2d``,
        ``3 Conv2d`` in a bare Sequential) for a module call, the traced op's name otherwise
        (``add_1``). The layer's own name is the traced node's (``_3`` for ``model[3]``)."""
        layer = self.layers.get(name)
        anchor = self.nodes.get(layer.nodes[0]) if layer is not None and layer.nodes else None
        if anchor is None or anchor.module_type is None:
            return name
        return f"{anchor.target} {anchor.module_type}" if anchor.target else anchor.module_type

    def layer_labels(self) -> dict[str, str]:
        """:meth:`layer_label` of every layer, by layer name."""
        return {name: self.layer_label(name) for name in self.layers}

    def summary(self) -> dict[str, Any]:
        """A few numbers for reports: counts, parameters, FLOPs, method."""
        kinds: dict[str, int] = {}
        for lay in self.layers.values():
            kinds[lay.kind] = kinds.get(lay.kind, 0) + 1
        return {
            "method": self.method,
            "notice": self.notice,
            "batch_size": self.batch_size,
            "nodes": len(self.nodes),
            "layers": len(self.layers),
            "layer_kinds": kinds,
            "params": self.total_params(),
            "forward_flops": self.total_flops(),
            "graph_hash": self.graph_hash(),
        }


# -- op kinds ------------------------------------------------------------------------

# fmt: off
_MODULE_OPS = {
    "ReLU": "relu", "ReLU6": "relu6", "LeakyReLU": "leaky_relu", "GELU": "gelu", "SiLU": "silu",
    "Sigmoid": "sigmoid", "Tanh": "tanh", "Hardtanh": "hardtanh", "Hardswish": "hardswish",
    "Softmax": "softmax", "LogSoftmax": "log_softmax",
    "BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "BatchNorm3d": "batch_norm",
    "LayerNorm": "layer_norm", "GroupNorm": "group_norm", "LocalResponseNorm": "local_response_norm",
    "Dropout": "dropout", "Dropout2d": "dropout", "Dropout3d": "dropout", "AlphaDropout": "dropout",
    "Flatten": "flatten", "Identity": "identity",
    "Conv1d": "conv1d", "Conv2d": "conv2d", "Conv3d": "conv3d",
    "ConvTranspose1d": "conv_transpose1d", "ConvTranspose2d": "conv_transpose2d",
    "ConvTranspose3d": "conv_transpose3d",
    "Linear": "linear", "Bilinear": "bilinear", "Embedding": "embedding", "EmbeddingBag": "embedding",
    "LSTM": "lstm", "GRU": "gru", "RNN": "rnn",
    "MaxPool1d": "max_pool1d", "MaxPool2d": "max_pool2d", "MaxPool3d": "max_pool3d",
    "AvgPool1d": "avg_pool1d", "AvgPool2d": "avg_pool2d", "AvgPool3d": "avg_pool3d",
    "AdaptiveAvgPool1d": "adaptive_avg_pool1d", "AdaptiveAvgPool2d": "adaptive_avg_pool2d",
    "AdaptiveAvgPool3d": "adaptive_avg_pool3d", "AdaptiveMaxPool2d": "adaptive_max_pool2d",
    "MultiheadAttention": "multihead_attention",
}
_FUNCTION_OPS = {
    operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.mul: "mul",
    operator.imul: "mul", operator.truediv: "div", operator.getitem: "getitem",
    operator.matmul: "matmul", torch.cat: "cat", torch.concat: "cat", torch.stack: "stack",
}
# Ops that fold into the layer of their (only) producer.
_ELEMENTWISE = {
    "relu", "relu6", "leaky_relu", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "hardswish",
    "elu", "selu", "batch_norm", "dropout", "identity", "local_response_norm",
}
_RESHAPE = {"flatten", "view", "reshape", "contiguous", "squeeze", "unsqueeze", "permute",
            "transpose", "getitem"}
# fmt: on


def normalise_op(name: str) -> str:
    """``relu_`` -> ``relu``, ``_foo`` -> ``foo``, ``concat`` -> ``cat``; lower case."""
    name = name.strip("_").lower()
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return {"concat": "cat", "iadd": "add", "imul": "mul", "size": "size", "dim": "dim"}.get(
        name, name
    )


def layer_kind(op: str) -> str:
    """The :class:`Layer` kind whose anchor is an ``op`` node."""
    if op in ("input", "output"):
        return op
    if op.startswith("conv"):
        return "conv"
    if op in ("linear", "bilinear", "addmm", "matmul", "mm", "bmm"):
        return "linear"
    if "pool" in op:
        return "pool"
    if op in ("cat", "stack"):
        return "concat"
    if op == "add":
        return "add"
    if op.endswith("norm"):
        return "norm"
    if op == "embedding":
        return "embedding"
    if op in ("lstm", "gru", "rnn"):
        return "rnn"
    return "other"


def _module_op(module: nn.Module) -> str:
    cls = type(module).__name__
    return _MODULE_OPS.get(cls, cls.lower())


def _function_op(fn: Callable) -> str:
    if fn in _FUNCTION_OPS:
        return _FUNCTION_OPS[fn]
    return normalise_op(getattr(fn, "__name__", str(fn)))


def _as_list(v) -> list[int] | int | None:
    if isinstance(v, tuple | list):
        return [int(x) for x in v]
    return v


def _module_attrs(module: nn.Module) -> dict[str, Any]:
    keys = (
        "in_channels",
        "out_channels",
        "kernel_size",
        "stride",
        "padding",
        "dilation",
        "groups",
        "in_features",
        "out_features",
        "output_size",
        "num_embeddings",
        "embedding_dim",
        "input_size",
        "hidden_size",
        "num_layers",
        "ceil_mode",
    )
    out = {}
    for k in keys:
        if hasattr(module, k):
            v = getattr(module, k)
            if isinstance(v, int | bool | str | tuple | list) or v is None:
                out[k] = _as_list(v)
    return out


def _function_attrs(node: torch.fx.Node, op: str) -> dict[str, Any]:
    if not (op.startswith("conv") or "pool" in op):
        return {}
    try:
        pair = normalize_function(
            node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
        )
    except Exception:  # builtins without a schema: keep what was passed by keyword
        pair = None
    kwargs = pair.kwargs if pair is not None else dict(node.kwargs)
    return {
        k: _as_list(v)
        for k, v in kwargs.items()
        if k
        in ("kernel_size", "stride", "padding", "dilation", "groups", "output_size", "ceil_mode")
        and not isinstance(v, torch.fx.Node)
    }


# -- tensors ---------------------------------------------------------------------------


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _describe_output(value) -> tuple[list[int] | None, str | None, int]:
    ts = _tensors(value)
    if not ts:
        return None, None, 0
    first = ts[0]
    return (
        list(first.shape),
        str(first.dtype).removeprefix("torch."),
        sum(t.numel() * t.element_size() for t in ts),
    )


def _resize_batch(value, batch: int):
    """The same inputs with ``batch`` rows along dim 0 (rows repeated or dropped)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] == batch:
            return value
        idx = torch.arange(batch) % value.shape[0]
        return value[idx]
    if isinstance(value, tuple | list):
        return type(value)(_resize_batch(v, batch) for v in value)
    if isinstance(value, dict):
        return {k: _resize_batch(v, batch) for k, v in value.items()}
    return value


def model_args(inputs: Any) -> tuple:
    """The positional arguments the model is called with: the batch's inputs as ONE argument,
    whatever they are (a tuple of tensors is not spread), as the training step calls it."""
    return (inputs,)


def _batch_of(args: tuple) -> int:
    for t in _tensors(args):
        if t.dim() > 0:
            return int(t.shape[0])
    return 1


class _ParamLedger:
    """Counts each parameter once, for the first node that uses it (weight sharing)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def take(self, params: Iterable[torch.Tensor]) -> tuple[int, int]:
        numel = nbytes = 0
        for p in params:
            if id(p) in self.seen:
                continue
            self.seen.add(id(p))
            numel += p.numel()
            nbytes += p.numel() * p.element_size()
        return numel, nbytes


# -- fx path ---------------------------------------------------------------------------


class _CountingShapeProp(torch.fx.Interpreter):
    """Shape propagation that also records each node's output and its FLOPs.

    An Interpreter rather than torch.fx's ShapeProp, which prints a whole
    traceback to stderr when a node fails: a workload whose forward pass fails
    is reported in one line (the caller's WorkloadError), nothing more.
    """

    def __init__(self, gm: torch.fx.GraphModule, counter: FlopCounterMode):
        super().__init__(gm)
        self.counter = counter
        self.outputs: dict[str, Any] = {}
        self.flops: dict[str, int] = {}

    def run_node(self, n: torch.fx.Node):
        before = self.counter.get_total_flops()
        result = super().run_node(n)
        self.flops[n.name] = self.counter.get_total_flops() - before
        self.outputs[n.name] = _describe_output(result)
        return result


def _layer_norm_flops(
    x_shape, normalized_shape, weight=None, *args, out_shape=None, **kwargs
) -> int:
    """LayerNorm: 5 FLOPs per element with its affine scale and shift (mean, subtract,
    variance, normalise, scale-and-shift), 4 without (fvcore's convention)."""
    return math.prod(x_shape) * (5 if weight is not None else 4)


def flop_counter() -> FlopCounterMode:
    """``FlopCounterMode`` counting matmuls, convolutions and attention as torch does, and
    LayerNorm too (torch counts it 0, which left a transformer's norms at 0 GFLOP)."""
    return FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten.native_layer_norm: _layer_norm_flops}
    )


def _trace_fx(model: nn.Module, args: tuple) -> dict[str, GraphNode]:
    gm = torch.fx.symbolic_trace(model)
    with flop_counter() as counter:
        prop = _CountingShapeProp(gm, counter)
        prop.run(*args)
    modules = dict(gm.named_modules())
    ledger = _ParamLedger()
    nodes: dict[str, GraphNode] = {}
    for n in gm.graph.nodes:
        shape, dtype, act = prop.outputs.get(n.name, (None, None, 0))
        module_type = None
        attrs: dict[str, Any] = {}
        numel = nbytes = 0
        if n.op == "placeholder":
            op, target = "input", str(n.target)
        elif n.op == "output":
            op, target = "output", "output"
            shape, dtype, act = None, None, 0
        elif n.op == "call_module":
            mod = modules[n.target]
            op, target, module_type = _module_op(mod), str(n.target), type(mod).__name__
            attrs = _module_attrs(mod)
            numel, nbytes = ledger.take(mod.parameters())
        elif n.op == "call_function":
            op, target = _function_op(n.target), getattr(n.target, "__name__", str(n.target))
            attrs = _function_attrs(n, op)
        elif n.op == "call_method":
            op, target = normalise_op(str(n.target)), str(n.target)
        else:  # get_attr: a parameter or buffer used directly
            op, target = "get_attr", str(n.target)
            attr = _resolve_attr(gm, str(n.target))
            if isinstance(attr, nn.Parameter):
                numel, nbytes = ledger.take([attr])
        inputs = [
            p.name
            for p in n.all_input_nodes
            if p.op == "placeholder" or prop.outputs.get(p.name, (None,))[0] is not None
        ]
        nodes[n.name] = GraphNode(
            name=n.name,
            op=op,
            target=target,
            module_type=module_type,
            inputs=inputs,
            output_shape=shape,
            output_dtype=dtype,
            param_numel=numel,
            param_bytes=nbytes,
            activation_bytes=act,
            flops=int(prop.flops.get(n.name, 0)),
            attrs=attrs,
        )
    return nodes


# -- torch.export path -------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Silence ``name`` for the block: torch.export logs a whole traceback when the model's
    own forward fails, which tunekit reports in one line (the WorkloadError) instead."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


# ATen views and copies that only re-lay out their producer's tensor: they fold like reshapes.
_EXPORT_VIEWS = {
    "expand",
    "slice",
    "select",
    "to",
    "clone",
    "alias",
    "unsafe_view",
    "t",
    "to_copy",
    "split",
    "chunk",
    "unflatten",
    "expand_as",
    "lift_fresh_copy",
    "native_dropout",
}


def _trace_export(model: nn.Module, args: tuple) -> tuple[dict[str, GraphNode], Any]:
    from tunekit.observe.graph_export import export_module, flat_inputs, module_of, op_name

    gm = export_module(model, args)
    with torch.no_grad(), flop_counter() as counter:
        prop = _CountingShapeProp(gm, counter)
        prop.run(*flat_inputs(args))
    ledger = _ParamLedger()
    nodes: dict[str, GraphNode] = {}
    skipped: set[str] = set()
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module"):  # weights (owned by their readers); export guards
            skipped.add(n.name)
            continue
        shape, dtype, act = prop.outputs.get(n.name, (None, None, 0))
        module_type, attrs, numel, nbytes = None, {}, 0, 0
        if n.op == "placeholder":
            op, target = "input", str(n.target)
        elif n.op == "output":
            op, target = "output", "output"
            shape, dtype, act = None, None, 0
        else:
            op, target = normalise_op(op_name(n.target)), op_name(n.target)
            owner = module_of(n)
            if owner is not None:
                target, module_type = owner
                attrs = _module_attrs(model.get_submodule(owner[0])) if owner[0] else {}
            weights = [
                _resolve_attr(gm, str(p.target)) for p in n.all_input_nodes if p.op == "get_attr"
            ]
            numel, nbytes = ledger.take(w for w in weights if isinstance(w, nn.Parameter))
        inputs = [
            p.name
            for p in n.all_input_nodes
            if p.name not in skipped
            and (p.op == "placeholder" or prop.outputs.get(p.name, (None,))[0] is not None)
        ]
        nodes[n.name] = GraphNode(
            name=n.name,
            op=op,
            target=target,
            module_type=module_type,
            inputs=inputs,
            output_shape=shape,
            output_dtype=dtype,
            param_numel=numel,
            param_bytes=nbytes,
            activation_bytes=act,
            flops=int(prop.flops.get(n.name, 0)),
            attrs=attrs,
        )
    # Parameters no op reads (unused heads) still belong to the model: keep the total exact.
    numel, nbytes = ledger.take(model.parameters())
    out = next(n for n in nodes.values() if n.op == "output")
    out.param_numel, out.param_bytes = out.param_numel + numel, out.param_bytes + nbytes
    return nodes, gm


def _resolve_attr(root: nn.Module, path: str):
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# -- hooks fallback --------------------------------------------------------------------


def _trace_hooks(model: nn.Module, args: tuple) -> dict[str, GraphNode]:
    """A chain of leaf modules in the order the forward pass first calls them."""
    ledger = _ParamLedger()
    order: list[GraphNode] = []
    seen: set[str] = set()
    handles = []
    counter = flop_counter()
    start: dict[str, int] = {}

    def pre(name):
        def hook(_mod, _inp):
            start[name] = counter.get_total_flops()

        return hook

    def post(name, mod):
        def hook(_mod, _inp, out):
            flops = counter.get_total_flops() - start.get(name, counter.get_total_flops())
            if name in seen:  # a module called again (weight sharing, loops): add its work
                node = next(n for n in order if n.name == name)
                node.flops += flops
                return
            seen.add(name)
            shape, dtype, act = _describe_output(out)
            numel, nbytes = ledger.take(mod.parameters())
            order.append(
                GraphNode(
                    name=name,
                    op=_module_op(mod),
                    target=name,
                    module_type=type(mod).__name__,
                    inputs=[],
                    output_shape=shape,
                    output_dtype=dtype,
                    param_numel=numel,
                    param_bytes=nbytes,
                    activation_bytes=act,
                    flops=flops,
                    attrs=_module_attrs(mod),
                )
            )

        return hook

    for name, mod in model.named_modules():
        if name and not any(True for _ in mod.children()):
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post(name, mod)))
    try:
        with counter:
            model(*args)
    finally:
        for h in handles:
            h.remove()
    nodes: dict[str, GraphNode] = {}
    taken = {n.name for n in order}
    src, sink = _free_name("input", taken), _free_name("output", taken)
    shape, dtype, act = _describe_output(args)
    nodes[src] = GraphNode(src, "input", "input", None, [], shape, dtype, 0, 0, act, 0)
    prev = src
    for node in order:
        node.inputs = [prev]
        nodes[node.name] = node
        prev = node.name
    # Parameters owned by non-leaf modules directly (rare) belong to no leaf: keep the total right.
    numel, nbytes = ledger.take(model.parameters())
    nodes[sink] = GraphNode(sink, "output", "output", None, [prev], None, None, numel, nbytes, 0, 0)
    return nodes


def _free_name(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name


# -- layers ----------------------------------------------------------------------------


def group_layers(nodes: dict[str, GraphNode], views: Iterable[str] = ()) -> dict[str, Layer]:
    """Assign every tensor node to a layer; fold elementwise/reshape ops into their producer's.

    An elementwise op folds only when it is its producer's sole consumer, so a
    layer's output is always what its consumers read (a ReLU on a branch that
    another branch reads before the ReLU stays its own layer). ``getitem`` on a
    multi-output op (an LSTM's ``(out, (h, c))``) always folds: it is a view of
    its producer. ``views`` names further ops that fold like reshapes (ATen's views).
    """
    reshape = _RESHAPE | set(views)
    consumers: dict[str, int] = {name: 0 for name in nodes}
    for n in nodes.values():
        for i in n.inputs:
            consumers[i] += 1
    members: dict[str, list[str]] = {}
    for n in nodes.values():
        if n.op != "output" and n.output_shape is None and n.op != "input":
            n.layer = None  # shape arithmetic (size(), getattr on ints): not data flow
            continue
        producer = nodes[n.inputs[0]] if len(n.inputs) == 1 else None
        fold = (
            producer is not None
            and producer.layer is not None
            and producer.op != "input"
            and (
                n.op == "getitem"
                or (n.op in _ELEMENTWISE | reshape and consumers[producer.name] == 1)
            )
        )
        if fold:
            assert producer is not None and producer.layer is not None  # as fold checked
            n.layer = producer.layer
            members[n.layer].append(n.name)
        else:
            n.layer = n.name
            members[n.name] = [n.name]
    layers: dict[str, Layer] = {}
    for name, names in members.items():
        member_nodes = [nodes[m] for m in names]
        anchor = member_nodes[0]
        inputs: list[str] = []
        for m in member_nodes:
            for i in m.inputs:
                src = nodes[i].layer
                if src is not None and src != name and src not in inputs:
                    inputs.append(src)
        out = layer_output(member_nodes, name, nodes)
        layers[name] = Layer(
            name=name,
            kind=layer_kind(anchor.op),
            nodes=names,
            inputs=inputs,
            output_shape=out.output_shape,
            param_numel=sum(m.param_numel for m in member_nodes),
            param_bytes=sum(m.param_bytes for m in member_nodes),
            activation_bytes=out.activation_bytes,
            flops=sum(m.flops for m in member_nodes),
            attrs=dict(anchor.attrs),
        )
    return layers


def layer_output(members: list[GraphNode], layer: str, nodes: dict[str, GraphNode]) -> GraphNode:
    """The last member another layer reads (else the last member with a tensor output)."""
    read_outside = {i for n in nodes.values() if n.layer != layer for i in n.inputs}
    for m in reversed(members):
        if m.name in read_outside and m.output_shape is not None:
            return m
    for m in reversed(members):
        if m.output_shape is not None:
            return m
    return members[-1]


# -- entry point -------------------------------------------------------------------------


def trace_model(
    model: nn.Module, example_inputs: Any, *, batch_size: int | None = None
) -> ModelGraph:
    """Trace ``model`` on ``example_inputs`` into a :class:`ModelGraph`.

    ``example_inputs`` is the batch's inputs, passed to the model as ONE argument,
    as the training ranks pass them (``model(inputs)``): a tensor, or a tuple, list
    or dict of tensors the model unpacks itself. With ``batch_size`` the inputs are
    resized along dim 0 (rows repeated or dropped) so shapes, bytes and FLOPs are
    recorded at that batch.
    The model runs in training mode, as it trains (batch norms in eval: the same
    ops, statistics untouched, and a batch of 1 works), without gradients; its modes, parameters, buffers and the global RNG state are
    as they were afterwards.
    Tries ``torch.fx``, then ``torch.export``, then leaf-module hooks.
    """
    if batch_size is not None:
        example_inputs = _resize_batch(example_inputs, batch_size)
    args = model_args(example_inputs)
    batch = _batch_of(args)
    modes = [(m, m.training) for m in model.modules()]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    views: Iterable[str]  # op names that fold like reshapes: ATen's views under torch.export
    module, views = None, ()
    model.train()  # as it trains: eval-only fast paths (native MHA) would hide FLOPs
    for m in model.modules():
        # Batch norms run the same ops either way; in eval they keep their statistics and
        # take a batch of 1 (a trace at batch 1 would fail in training mode).
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    try:
        with torch.random.fork_rng(devices=[]):  # dropout draws must not move the job's RNG
            try:
                with torch.no_grad():
                    nodes, method, notice = _trace_fx(model, args), "fx", ""
            except Exception as exc:
                why = f"torch.fx could not trace {type(model).__name__} ({_reason(exc)})"
                try:
                    with _quiet_logger("torch._subclasses.fake_tensor"):
                        (nodes, module), method, views = (
                            _trace_export(model, args),
                            "export",
                            _EXPORT_VIEWS,
                        )
                    notice = f"{why}; captured with torch.export instead (ATen-level graph)"
                except Exception as exc2:
                    notice = (
                        f"{why}, nor torch.export ({_reason(exc2)}); fell back to leaf-module "
                        "hooks, so the graph is a chain of layers and branches are not seen"
                    )
                    try:
                        with torch.no_grad():
                            nodes, method = _trace_hooks(model, args), "hooks"
                    except Exception as exc3:
                        raise WorkloadError(
                            f"cannot trace {type(model).__name__}: its forward pass fails on the "
                            f"example batch ({type(exc3).__name__}: {str(exc3).strip()[:200]})"
                        ) from exc3
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        for m, training in modes:
            m.training = training
    layers = group_layers(nodes, views)
    return ModelGraph(
        nodes=nodes, layers=layers, batch_size=batch, method=method, notice=notice, module=module
    )


def _reason(exc: Exception) -> str:
    """``TypeName: first sentence`` of an exception, for a one-line notice."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    first = first.split(". ")[0]
    return f"{type(exc).__name__}{': ' + first[:200] if first else ''}"
