"""Running one layer on one worker's slice, with the live model's parameters.

A :class:`LayerProgram` is a layer of the traced model: its anchor op (conv,
linear, pool, concat, add ...) and the elementwise ops folded after it.
:class:`SliceOps` runs a program on the input regions a worker gathered:

* conv2d: weights sliced by output channel, all input channels (grouped convs:
  the groups covered); under a spatial split the region carries its halo and
  is zero-padded only where it crosses the image border, then convolved unpadded;
* linear: weights sliced by output feature, every input feature;
* max/avg pools (adaptive ones when the split is even): like conv without
  weights, channels split freely;
* concat, add and other elementwise ops on aligned regions;
* folded elementwise ops (ReLU, dropout, batch norm with its channels sliced)
  on the slice; trailing reshapes (flatten, view) are left to the consumer.

:meth:`SliceOps.check` refuses, in one line, what it cannot run exactly.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.operator_schemas import normalize_function

from tunekit.errors import PluginError
from tunekit.plugins.layer_split.heads import Heads, attend, heads_of
from tunekit.plugins.layer_split.model import OpSpec, SplitConfig, owned_boxes

_ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardswish,
    nn.ELU,
    nn.SELU,
    nn.Dropout,
    nn.Identity,
)
_ELEMENTWISE_FUNCTIONS = {
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
}
_PER_SAMPLE_MODULES = (nn.LayerNorm, nn.Embedding, nn.GroupNorm)
"""Modules exact on any subset of samples, with all features: a sample split runs them as is."""
_PER_SAMPLE_FUNCTIONS = {"layer_norm", "embedding", "group_norm"}
_SHAPE_ONLY = {"ones_like", "zeros_like", "empty_like", "full_like", "size", "getattr", "dim"}
"""Ops that read only their input's shape (a causal mask from ``scores[0, 0]``)."""
_RANDOM = {"dropout", "rand", "randn", "rand_like", "randn_like", "bernoulli", "normal"}
_REORDERS = {"transpose", "permute", "movedim", "swapaxes", "t"}
_RESHAPES = {"flatten", "view", "reshape", "contiguous", "squeeze", "unsqueeze"}
_BINARY = {
    operator.add: torch.add,
    operator.iadd: torch.add,
    torch.add: torch.add,
    operator.sub: torch.sub,
    torch.sub: torch.sub,
    operator.mul: torch.mul,
    operator.imul: torch.mul,
    torch.mul: torch.mul,
}


# torch.nn.functional's boolean-dispatch wrappers (max_pool2d ...) are all named "fn".
_FUNCTIONAL_NAMES = {id(getattr(F, n)): n for n in dir(F) if callable(getattr(F, n, None))}


def _op_name(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op == "call_function":
        name = _FUNCTIONAL_NAMES.get(id(node.target)) or getattr(
            node.target, "__name__", str(node.target)
        )
        return name.strip("_")
    return str(node.target).strip("_")


# -- one layer on a slice ---------------------------------------------------------------


@dataclass
class LayerProgram:
    """What one layer runs on a worker's slice."""

    spec: OpSpec
    anchor: torch.fx.Node
    members: list[torch.fx.Node]
    """Elementwise ops after the anchor (reshapes excluded: consumers apply them)."""
    use_nodes: list[torch.fx.Node] = field(default_factory=list)
    """The anchor's tensor arguments, in the order of ``spec.uses``."""
    problem: str = ""
    """Why the executor cannot run this layer at all (empty: it can)."""
    region: list[torch.fx.Node] = field(default_factory=list)
    """A subgraph run node by node on the worker's samples (a fused attention core, a layer
    without a batch dimension): its shape arithmetic and its members, in graph order.
    Empty: the layer runs as its anchor op and folded members."""
    shape_refs: dict[torch.fx.Node, tuple[list[int], str | None, bool]] = field(
        default_factory=dict
    )
    """Tensors of other layers the region reads only for their shape (``x.shape``): recorded
    shape, dtype, and whether its first dim is the batch."""
    region_out: torch.fx.Node | None = None
    """The region's output node (what its consumers read)."""
    heads: Heads | None = None
    """A fused attention core's head layout: it may run a share of its heads (``h`` splits)."""


class SliceOps:
    """Runs layers on slices with the live model's parameters."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule):
        self.model = model
        self.modules = dict(gm.named_modules())
        self.device = torch.device("cpu")
        """Where the step runs (set by the executor each step)."""
        self._heads_verdicts: dict[str, bool] = {}

    def module(self, node: torch.fx.Node) -> nn.Module:
        # The live model's module (the traced GraphModule shares it, but be explicit).
        return self.model.get_submodule(node.target)

    # -- checks ------------------------------------------------------------------------

    def check(self, prog: LayerProgram, cfg: SplitConfig) -> None:
        """Refuse, in one line, a config this executor cannot run exactly for this layer."""
        spec, node = prog.spec, prog.anchor
        where = f"layer_split: layer {spec.name!r}"
        spatial = cfg.h > 1 or cfg.w > 1
        if spec.kind in ("input", "output"):
            return
        if prog.problem:
            raise PluginError(f"{where}: {prog.problem}")
        if prog.region:
            if cfg.h > 1 and cfg.c == 1 and cfg.w == 1 and prog.heads is not None:
                self._check_heads(prog, cfg, where)
                return
            if cfg.c > 1 or spatial:
                raise PluginError(f"{where}: a {spec.kind} subgraph splits by samples only")
            return
        for member in prog.members:
            if not self._elementwise(member):
                name = _op_name(member, self.modules)
                if name in _REORDERS:  # a ViT's patch embedding: conv, flatten(2), transpose(1, 2)
                    raise PluginError(
                        f"{where}: folded op {name} reorders the layer's dims after the tensor "
                        "the executor splits; it cannot run it"
                    )
                raise PluginError(f"{where}: folded op {name} is not supported by the executor")
            if (
                cfg.c > 1
                and member.op == "call_module"
                and isinstance(self.module(member), nn.LocalResponseNorm)
            ):
                raise PluginError(f"{where}: local response norm mixes channels; no channel split")
        if node.op == "get_attr" or any(
            n.op == "get_attr" and n not in prog.use_nodes for n in node.all_input_nodes
        ):
            raise PluginError(
                f"{where}: ops on raw tensor attributes are not supported by the executor"
            )
        if node.op == "call_module":
            mod = self.module(node)
            if isinstance(mod, nn.Conv2d):
                if spatial and mod.padding_mode != "zeros":
                    raise PluginError(
                        f"{where}: spatial split needs zero padding, not {mod.padding_mode}"
                    )
                opg = mod.out_channels // mod.groups
                if (
                    mod.groups > 1
                    and cfg.c > 1
                    and any(b % opg for b in {x for box in owned_boxes(spec, cfg) for x in box[1]})
                ):
                    raise PluginError(
                        f"{where}: channel split of a grouped conv must align with groups"
                    )
                return
            if isinstance(mod, nn.Linear):
                return
            if isinstance(mod, _PER_SAMPLE_MODULES):
                if cfg.c > 1 or spatial:
                    raise PluginError(
                        f"{where}: {type(mod).__name__} mixes its features; sample splits only"
                    )
                return
            if isinstance(
                mod, nn.MaxPool2d | nn.AvgPool2d | nn.AdaptiveAvgPool2d | nn.AdaptiveMaxPool2d
            ):
                self._check_pool(where, mod.__dict__, isinstance(mod, nn.AvgPool2d), spatial)
                if isinstance(mod, nn.MaxPool2d) and mod.return_indices:
                    raise PluginError(f"{where}: max pool with return_indices is not supported")
                return
            if self._elementwise(node):
                return
        elif node.op in ("call_function", "call_method"):
            name = _op_name(node, self.modules)
            if name in ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d"):
                self._check_pool(where, self._kwargs(node), name == "avg_pool2d", spatial)
                return
            if name in ("cat", "concat") or node.target in _BINARY or self._elementwise(node):
                return
            if name in _PER_SAMPLE_FUNCTIONS:
                if cfg.c > 1 or spatial:
                    raise PluginError(f"{where}: {name} mixes its features; sample splits only")
                return
        raise PluginError(
            f"{where}: op {_op_name(node, self.modules)} is not supported by the executor"
        )

    def _check_heads(self, prog: LayerProgram, cfg: SplitConfig, where: str) -> None:
        """A head split runs :func:`attend`, not the user's code: allowed once the core is
        seen to compute exactly that on every head (two random samples, compared once)."""
        heads = prog.heads
        if heads.count % cfg.h:
            raise PluginError(f"{where}: {cfg.h} workers cannot share {heads.count} heads")
        verdict = self._heads_verdicts.get(prog.spec.name)
        if verdict is None:
            dtype = next((p.dtype for p in self.model.parameters()), torch.float32)
            gen = torch.Generator().manual_seed(0)
            qkv = torch.randn(2, heads.seq, 3 * heads.width, generator=gen, dtype=dtype)
            qkv = qkv.to(self.device)
            with torch.no_grad():
                theirs = self._region(prog, [(0, 2), (0, heads.seq)], [qkv])
                ours = attend(qkv, heads, 0, heads.count)
            tol = 1e-10 if dtype == torch.float64 else 1e-4
            verdict = theirs.shape == ours.shape and torch.allclose(
                theirs, ours, rtol=tol, atol=tol
            )
            self._heads_verdicts[prog.spec.name] = verdict
        if not verdict:
            raise PluginError(
                f"{where}: its attention is not plain multi-head attention over packed q|k|v "
                f"(softmax(q k^T / sqrt(d){' + causal mask' if heads.causal else ''}) v), "
                "which a head split computes; it splits by samples only"
            )

    @staticmethod
    def _check_pool(where: str, attrs: Mapping, is_avg: bool, spatial: bool) -> None:
        if not spatial:
            return
        if is_avg and (
            attrs.get("ceil_mode")
            or attrs.get("divisor_override")
            or (not attrs.get("count_include_pad", True) and attrs.get("padding"))
        ):
            raise PluginError(
                f"{where}: this avg pool cannot be split spatially (ceil_mode/divisor)"
            )

    def _elementwise(self, node: torch.fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(
                self.module(node), (*_ELEMENTWISE_MODULES, nn.BatchNorm2d, nn.BatchNorm1d)
            )
        return _op_name(node, self.modules) in _ELEMENTWISE_FUNCTIONS | {"batch_norm"}

    @staticmethod
    def _kwargs(node: torch.fx.Node) -> dict:
        pair = normalize_function(
            node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
        )
        return dict(pair.kwargs) if pair is not None else dict(node.kwargs)

    # -- running ------------------------------------------------------------------------

    def run(
        self,
        prog: LayerProgram,
        cfg: SplitConfig,
        out_box,
        xs: list[torch.Tensor],
        pads: list[tuple[int, int, int, int]],
    ) -> torch.Tensor:
        """The layer's output slice ``out_box`` from its gathered inputs ``xs``.

        ``xs[j]`` is in the consumer's view of input j; for spatial ops ``pads[j]``
        says how far the needed region reaches past the image border (top, bottom,
        left, right), to be filled with the op's padding value.
        """
        if prog.region:
            if cfg.h > 1:  # a share of the heads, for the worker's samples
                h0, h1 = prog.heads.span(int(out_box[2][0]), int(out_box[2][1]))
                return attend(xs[0], prog.heads, h0, h1)
            return self._region(prog, out_box, xs)
        c0, c1 = int(out_box[1][0]), int(out_box[1][1])
        spatial = cfg.h > 1 or cfg.w > 1
        x = self._anchor(prog, cfg, xs, pads, c0, c1, spatial)
        for node in prog.members:
            x = self._elementwise_op(node, x, c0, c1)
        return x

    def _anchor(self, prog, cfg, xs, pads, c0, c1, spatial):
        node = prog.anchor
        if node.op == "call_module":
            mod = self.module(node)
            if isinstance(mod, nn.Conv2d):
                w = mod.weight[c0:c1]
                b = mod.bias[c0:c1] if mod.bias is not None else None
                groups = (c1 - c0) // (mod.out_channels // mod.groups) if mod.groups > 1 else 1
                x = xs[0]
                if spatial:  # the region carries its halo; pad only where it crosses the border
                    return F.conv2d(
                        F.pad(x, _torch_pad(pads[0])), w, b, mod.stride, 0, mod.dilation, groups
                    )
                if mod.padding_mode != "zeros":
                    x = F.pad(x, mod._reversed_padding_repeated_twice, mode=mod.padding_mode)
                    return F.conv2d(x, w, b, mod.stride, 0, mod.dilation, groups)
                return F.conv2d(x, w, b, mod.stride, mod.padding, mod.dilation, groups)
            if isinstance(mod, nn.Linear):
                if prog.spec.rank != 2:  # (N, T, features): dim 1 is not the features; whole
                    c0, c1 = 0, mod.out_features
                b = mod.bias[c0:c1] if mod.bias is not None else None
                return F.linear(xs[0], mod.weight[c0:c1], b)
            if isinstance(mod, _PER_SAMPLE_MODULES):  # whole features, this worker's samples
                return mod(xs[0])
            if isinstance(
                mod, nn.MaxPool2d | nn.AvgPool2d | nn.AdaptiveAvgPool2d | nn.AdaptiveMaxPool2d
            ):
                if not spatial:
                    return mod(xs[0])
                return self._spatial_pool(type(mod).__name__, mod.__dict__, prog, xs[0], pads[0])
            return self._elementwise_op(node, xs[0], c0, c1)
        name = _op_name(node, self.modules)
        if name in ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d"):
            if not spatial:
                mapping = {prog.use_nodes[0]: xs[0]}
                return node.target(
                    *_substitute(node.args, mapping), **_substitute(node.kwargs, mapping)
                )
            return self._spatial_pool(name, self._kwargs(node), prog, xs[0], pads[0])
        if name in ("cat", "concat"):
            kw = self._kwargs(node)
            dim = kw.get("dim", 0)
            parts = [x for x in xs if x.shape[dim if dim >= 0 else x.dim() + dim] > 0]
            return torch.cat(parts, dim=dim)
        if node.target in _BINARY:
            args = _substitute(node.args, dict(zip(prog.use_nodes, xs, strict=True)))
            return _BINARY[node.target](*args)
        if name in _PER_SAMPLE_FUNCTIONS:
            mapping = dict(zip(prog.use_nodes, xs, strict=True))
            return node.target(
                *_substitute(node.args, mapping), **_substitute(node.kwargs, mapping)
            )
        return self._elementwise_op(node, xs[0], c0, c1)

    def _region(self, prog: LayerProgram, out_box, xs: list[torch.Tensor]) -> torch.Tensor:
        """Run the region's nodes on this worker's samples, with the live model's modules."""
        samples = int(out_box[0][1]) - int(out_box[0][0])
        env: dict[torch.fx.Node, object] = dict(zip(prog.use_nodes, xs, strict=True))
        for ref, (shape, dtype, batched) in prog.shape_refs.items():
            shape = [samples, *shape[1:]] if batched else list(shape)
            # read for its shape and device only: a zero-stride view of one element
            one = torch.empty((), dtype=getattr(torch, dtype or "float32"), device=self.device)
            env[ref] = one.expand(shape)
        out = None
        for node in prog.region:
            args = _substitute(node.args, env)
            kwargs = _substitute(node.kwargs, env)
            if node.op == "call_module":
                out = self.module(node)(*args, **kwargs)
            elif node.op == "call_function":
                out = node.target(*args, **kwargs)
            elif node.op == "call_method":
                out = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.op == "get_attr":
                out = _live_attr(self.model, node.target)
            else:
                raise PluginError(f"layer_split: cannot run a {node.op} node in a subgraph")
            env[node] = out
        return env[prog.region_out]

    def _spatial_pool(self, name: str, attrs: Mapping, prog: LayerProgram, x, pad):
        is_max = "max" in name.lower()
        if "adaptive" in name.lower():
            wins = prog.spec.windows
            k = (wins[0].kernel, wins[1].kernel)
            fn = F.max_pool2d if is_max else F.avg_pool2d
            return fn(x, k, k)
        x = F.pad(x, _torch_pad(pad), value=-math.inf if is_max else 0.0)
        k = attrs.get("kernel_size")
        stride = attrs.get("stride") or k
        if is_max:
            return F.max_pool2d(x, k, stride, 0, attrs.get("dilation", 1))
        return F.avg_pool2d(x, k, stride, 0)

    def _elementwise_op(
        self, node: torch.fx.Node, x: torch.Tensor, c0: int, c1: int
    ) -> torch.Tensor:
        if node.op == "call_module":
            mod = self.module(node)
            if isinstance(mod, nn.BatchNorm1d | nn.BatchNorm2d):
                return _batch_norm_slice(mod, x, c0, c1)
            if isinstance(mod, _ELEMENTWISE_MODULES):
                return mod(x)
        elif _op_name(node, self.modules) in _ELEMENTWISE_FUNCTIONS:
            inner = node.all_input_nodes[0]
            args = _substitute(node.args, {inner: x})
            kwargs = _substitute(node.kwargs, {inner: x})
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
        raise PluginError(
            f"layer_split: op {_op_name(node, self.modules)} in a layer is not supported by the executor"
        )


def _live_attr(model: nn.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _torch_pad(pad: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    top, bottom, left, right = pad
    return (left, right, top, bottom)


def _batch_norm_slice(bn: nn.modules.batchnorm._BatchNorm, x, c0: int, c1: int):
    """Batch norm over channels [c0, c1): statistics of this worker's samples (as DDP does)."""
    if bn.training and bn.track_running_stats and bn.momentum is None:
        raise PluginError("layer_split: batch norm with momentum=None is not supported")
    use_batch = bn.training or not bn.track_running_stats
    rm = bn.running_mean[c0:c1] if bn.running_mean is not None else None
    rv = bn.running_var[c0:c1] if bn.running_var is not None else None
    w = bn.weight[c0:c1] if bn.weight is not None else None
    b = bn.bias[c0:c1] if bn.bias is not None else None
    return F.batch_norm(x, rm, rv, w, b, use_batch, bn.momentum or 0.0, bn.eps)


def _substitute(value, mapping: dict):
    if isinstance(value, torch.fx.Node):
        if value not in mapping:
            raise PluginError(
                f"layer_split: op argument {value.name} is not a data input the executor knows"
            )
        return mapping[value]
    if isinstance(value, tuple | list):
        return type(value)(_substitute(v, mapping) for v in value)
    if isinstance(value, dict):
        return {k: _substitute(v, mapping) for k, v in value.items()}
    return value


# -- building the programs ----------------------------------------------------------------


def build_programs(
    model: nn.Module, graph, specs: dict[str, OpSpec]
) -> tuple[dict[str, LayerProgram], SliceOps]:
    """One :class:`LayerProgram` per layer of ``graph`` (traced from ``model``)."""
    if graph.method != "fx":
        raise PluginError(f"layer_split: the executor needs a torch.fx trace ({graph.notice})")
    gm = torch.fx.symbolic_trace(model)
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    if set(fx_nodes) != set(graph.nodes):
        raise PluginError("layer_split: the model traced differently than when it was planned")
    ops = SliceOps(model, gm)
    programs = {}
    batched = graph.batched_nodes()
    for layer in graph.layers.values():
        spec = specs[layer.name]
        if spec.subgraph:
            programs[layer.name] = _region_program(graph, layer, spec, fx_nodes, batched)
            programs[layer.name].heads = heads_of(graph, layer) if spec.heads else None
            continue
        anchor = fx_nodes[layer.nodes[0]]
        members, problem = [], ""
        seen_reshape = False
        for name in layer.nodes[1:]:
            node = fx_nodes[name]
            op = graph.nodes[name].op
            if op in _RESHAPES:
                if (
                    graph.nodes[name].output_shape
                    and graph.nodes[name].output_shape[0] != graph.batch_size
                ):
                    problem = problem or f"{op} mixes samples"
                seen_reshape = True
                continue
            if seen_reshape and op == "batch_norm":
                problem = problem or "batch norm after a reshape"
            members.append(node)
        use_nodes = [
            fx_nodes[i] for i in graph.nodes[anchor.name].inputs if graph.nodes[i].layer is not None
        ]
        programs[layer.name] = LayerProgram(specs[layer.name], anchor, members, use_nodes, problem)
    return programs, ops


_TUPLE_OPS = {"split", "chunk", "unbind", "split_with_sizes", "tensor_split"}


def _moves_samples(node: torch.fx.Node, g, gnodes) -> bool:
    """Whether a reorder or index touches dim 0 (the samples) of a batched tensor."""
    rank = len(g.output_shape or ()) or 1
    args = list(node.args)

    def dim0(d) -> bool:
        return isinstance(d, int) and d % max(rank, 1) == 0

    if g.op in ("transpose", "swapaxes", "movedim"):
        return any(dim0(d) for d in args[1:3])
    if g.op == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:]
        return not dims or not dim0(dims[0])
    if g.op == "getitem" and len(args) == 2:
        src = gnodes.get(g.inputs[0]) if g.inputs else None
        if src is not None and src.op in _TUPLE_OPS:
            return False  # one tensor of a split's tuple
        first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        return not (first is Ellipsis or first == slice(None))
    return False


def _region_program(graph, layer, spec: OpSpec, fx_nodes, batched: set[str]) -> LayerProgram:
    """A layer run as its fx subgraph (see :attr:`LayerProgram.region`), and why it cannot be,
    if it cannot: an op that draws random numbers, or one that reads some samples' values
    into a tensor without a batch dimension (anything but a shape-only op)."""
    from tunekit.api import layer_output
    from tunekit.plugins.layer_split.model import external_inputs

    gnodes = graph.nodes
    members = set(layer.nodes)
    uses = [fx_nodes[n.name] for n in external_inputs(graph, layer)]
    order = {name: i for i, name in enumerate(gnodes)}
    needed: set[str] = set(members)
    refs: dict[torch.fx.Node, tuple[list[int], str | None, bool]] = {}
    todo = list(layer.nodes)
    while todo:  # shape arithmetic (x.shape, // heads) the members read, back to tensors
        for p in fx_nodes[todo.pop()].all_input_nodes:
            if p.name in needed or p in uses:
                continue
            g = gnodes[p.name]
            if g.layer is None and g.op != "input":
                needed.add(p.name)
                todo.append(p.name)
            else:
                refs[p] = (list(g.output_shape or []), g.output_dtype, p.name in batched)
    region = [fx_nodes[n] for n in sorted(needed, key=order.__getitem__)]
    problem = ""
    readers: dict[str, list[str]] = {}
    for n in layer.nodes:
        for i in gnodes[n].inputs:
            readers.setdefault(i, []).append(gnodes[n].op)
    for n in layer.nodes:
        g = gnodes[n]
        if g.op in _RANDOM:
            problem = problem or f"{g.op} draws random numbers; each rank would draw its own"
        if spec.batched and n in batched and _moves_samples(fx_nodes[n], g, gnodes):
            problem = problem or f"{g.op} ({n}) moves the batch dimension: it mixes samples"
        if (
            spec.batched
            and n not in batched
            and any(i in batched for i in g.inputs)
            and not set(readers.get(n, [])) <= _SHAPE_ONLY
        ):
            problem = problem or (
                f"{g.op} ({n}) reads some samples' values into a tensor without a batch "
                "dimension: it mixes samples"
            )
    out = layer_output([gnodes[n] for n in layer.nodes], layer.name, gnodes)
    return LayerProgram(
        spec,
        fx_nodes[layer.nodes[0]],
        [],
        uses,
        problem,
        region=region,
        shape_refs=refs,
        region_out=fx_nodes[out.name],
    )
