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


class SliceOps:
    """Runs layers on slices with the live model's parameters."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule):
        self.model = model
        self.modules = dict(gm.named_modules())

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
        for member in prog.members:
            if not self._elementwise(member):
                raise PluginError(
                    f"{where}: folded op {_op_name(member, self.modules)} is not supported by the executor"
                )
            if (
                cfg.c > 1
                and member.op == "call_module"
                and isinstance(self.module(member), nn.LocalResponseNorm)
            ):
                raise PluginError(f"{where}: local response norm mixes channels; no channel split")
        if node.op == "get_attr" or any(n.op == "get_attr" for n in node.all_input_nodes):
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
        raise PluginError(
            f"{where}: op {_op_name(node, self.modules)} is not supported by the executor"
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
                b = mod.bias[c0:c1] if mod.bias is not None else None
                return F.linear(xs[0], mod.weight[c0:c1], b)
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
        return self._elementwise_op(node, xs[0], c0, c1)

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
    for layer in graph.layers.values():
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
