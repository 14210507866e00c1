"""Measuring here: one worker's share of a layer under a DeePa split config, timed.

``time_layer_split(model, graph, layer, split, *, batch_size=None, device="cpu",
warmup=2, repeats=5, threads=None)`` -> :class:`SplitTiming`. The time of ONE
worker's share of ``layer`` under a DeePa configuration. ``split`` gives one
degree per dimension of the layer's OUTPUT tensor: a mapping ``{"n": .., "c":
.., "h": .., "w": ..}`` (missing keys are 1) or a tuple ``(n, c, h, w)``. The
worker computes the output slice ``ceil(N/n) x ceil(C/c) x ceil(H/h) x
ceil(W/w)`` (ceil: the largest worker, which the step waits for). What it runs:

* conv: the input's ``ceil(N/n)`` samples with ALL input channels (grouped
  convs: ``1/c`` of them) and, on a split spatial dim, the output rows plus
  the halo the kernel needs (:meth:`~tunekit.plugins.layer_split.model.Window.input_range`,
  the geometry the model charges), with no padding on that dim (an interior
  slice); a conv with ``ceil(C/c)`` output channels (weights sliced,
  replicated on h/w splits);
* linear: ``ceil(N/n)`` samples, all input features, ``ceil(out/c)`` outputs
  (only ``n`` and ``c``; ``h = w = 1``);
* pool: like conv without weights (channels split as ``C/c``);
* concat, add and the other elementwise layers: every input sliced the same
  way along (n, c, h, w);
* rnn and embedding layers: sample splits only.

Folded members follow the anchor (a batch norm gets ``ceil(C/c)`` features).
``batch_size`` rescales dim 0 of the graph's recorded shapes (DeePa times
AlexNet at 512 images while the graph may be traced at 1). Inputs are random
tensors of the recorded shapes: the time of these ops does not depend on the
values. A split a layer cannot take raises :class:`ValueError`.

For many timings of one model build a :class:`SplitTimer` once and call
:meth:`SplitTimer.time` per (layer, split). The layer runs standalone through
the core's :class:`~tunekit.api.LayerRunner` (the same runner, clock and
threads as the layer profile: see :mod:`tunekit.observe.layer_profile`).
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx.operator_schemas import normalize_function

from tunekit.api import (
    LayerRunner,
    LayerStep,
    ModelGraph,
    check_threads,
    intra_op_threads,
    measure_layer,
    output_member,
    run_steps,
    tensor_out,
    timing_clock,
)
from tunekit.plugins.layer_split.model import Window


@dataclass
class SplitTiming:
    """One worker's share of a layer under a split config."""

    layer: str
    kind: str
    split: dict[str, int]
    forward_s: float
    backward_s: float
    input_shapes: list[list[int]] = field(default_factory=list)
    """The slice inputs the worker reads (halo included)."""
    output_shape: list[int] | None = None
    batch_size: int = 0
    clock: str = "wall"
    """``thread_cpu`` or ``wall``; see the module docstring."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_split(split: Mapping[str, int] | Sequence[int]) -> dict[str, int]:
    """``(n, c, h, w)`` or a partial mapping -> ``{"n":, "c":, "h":, "w":}``; degrees >= 1."""
    if isinstance(split, Mapping):
        unknown = set(split) - set("nchw")
        if unknown:
            raise ValueError(f"split dims must be n, c, h, w, not {sorted(unknown)}")
        out = {d: int(split.get(d, 1)) for d in "nchw"}
    else:
        vals = list(split)
        if len(vals) != 4:
            raise ValueError(f"a split tuple is (n, c, h, w), got {len(vals)} values")
        out = dict(zip("nchw", (int(v) for v in vals), strict=True))
    if any(v < 1 for v in out.values()):
        raise ValueError(f"split degrees must be >= 1, got {out}")
    return out


def _ceil_div(a: int, b: int) -> int:
    return max(1, math.ceil(a / b))


def _pair(v, nd: int) -> list[int]:
    if isinstance(v, int):
        return [v] * nd
    return [int(x) for x in v]


class SplitTimer:
    """Times layers of one model under DeePa split configs (see the module docstring).

    ``threads``: torch's intra-op threads while timing, the number one training
    rank gets (None: as set at each call)."""

    def __init__(
        self,
        model: nn.Module,
        graph: ModelGraph,
        *,
        batch_size: int | None = None,
        device: str | torch.device = "cpu",
        warmup: int = 2,
        repeats: int = 5,
        threads: int | None = None,
    ):
        self.device = torch.device(device)
        self.model = model.to(self.device).train()
        self.graph = graph
        self.batch_size = batch_size or graph.batch_size
        self.warmup, self.repeats = warmup, repeats
        check_threads(threads)  # refuse a bad count now, not at the first timing
        self.threads = threads
        self.runner = LayerRunner(self.model, graph, self.device)
        self._env: dict[str, Any] | None = None
        self._shape_envs: dict[int, dict[str, Any]] = {}
        self._batched = graph.batched_nodes()

    def time(self, layer: str, split: Mapping[str, int] | Sequence[int]) -> SplitTiming:
        """One worker's forward and backward time of ``layer`` under ``split``."""
        if layer not in self.graph.layers:
            raise ValueError(f"no layer {layer!r} in the graph")
        sp = parse_split(split)
        lay = self.graph.layers[layer]
        if lay.kind in ("input", "output"):
            return SplitTiming(layer, lay.kind, sp, 0.0, 0.0, [], lay.output_shape, self.batch_size)
        anchor = self.graph.nodes[lay.nodes[0]]
        plan = _SlicePlan(anchor, lay.kind, sp, self.graph.batch_size, self.batch_size)
        steps = [plan.step(s, self.graph.nodes[s.name]) for s in self.runner.steps(layer)]
        inputs = {}
        for name in self.runner.external_inputs(layer):
            node = self.graph.nodes.get(name)
            if node is not None and node.output_shape is None and node.op != "input":
                # shape arithmetic (x.shape[0], width // heads): its value at the slice's batch
                inputs[name] = self._shape_value(name, _ceil_div(self.batch_size, sp["n"]))
                continue
            inputs[name] = plan.input_value(
                name, self._input_value(name), batched=name in self._batched
            )
        with intra_op_threads(self.threads):
            _, fwd, bwd, _, _, _ = measure_layer(
                self.runner, layer, steps, inputs, self.warmup, self.repeats, memory=False
            )
            clock = timing_clock(self.device)[1]
        out = run_steps(steps, inputs)[output_member(self.graph, layer)]
        out_t = tensor_out(out)
        return SplitTiming(
            layer=layer,
            kind=lay.kind,
            split=sp,
            forward_s=statistics.median(fwd),
            backward_s=statistics.median(bwd),
            input_shapes=[list(t.shape) for v in inputs.values() for t in _flat_tensors(v)],
            output_shape=list(out_t.shape) if out_t is not None else None,
            batch_size=self.batch_size,
            clock=clock,
        )

    def _input_value(self, name: str):
        """A tensor of the recorded shape (batch rescaled), or the captured value if not one."""
        node = self.graph.nodes.get(name)
        single = (
            node is not None
            and node.output_shape is not None
            and node.activation_bytes
            == math.prod(node.output_shape) * _dtype(node.output_dtype).itemsize
        )
        if single:
            shape = list(node.output_shape)
            if shape and self.batch_size != self.graph.batch_size and name in self._batched:
                shape[0] = self.batch_size
            dtype = _dtype(node.output_dtype)
            if dtype.is_floating_point:
                return torch.randn(shape, dtype=dtype, device=self.device)
            return torch.zeros(shape, dtype=dtype, device=self.device)
        if self._env is None:  # non-tensor or multi-tensor inputs: take the real values
            if self.batch_size != self.graph.batch_size:
                raise ValueError(
                    f"layer input {name!r} is not a single tensor; time it at the traced batch"
                )
            self._env = self.runner.capture_env(self._example(self.graph.batch_size))
        return self._env[name]

    def _example(self, batch: int) -> tuple:
        """Model inputs of the recorded shapes and dtypes at ``batch`` samples."""
        out = []
        for n in self.graph.nodes.values():
            if n.op != "input":
                continue
            if n.output_shape is None:
                # an optional argument no batch fills (timm's ``forward(x, attn_mask=None)``):
                # it and those after it keep their defaults
                break
            shape = [batch, *n.output_shape[1:]]
            dtype = _dtype(n.output_dtype)
            if dtype.is_floating_point:
                out.append(torch.randn(shape, dtype=dtype, device=self.device))
            else:
                out.append(torch.zeros(shape, dtype=dtype, device=self.device))
        return tuple(out)

    def _shape_value(self, name: str, batch: int):
        """A shape-arithmetic node's value (an int, a size) in a forward pass at ``batch``."""
        if self.runner.gm is None:
            raise ValueError(f"layer input {name!r} is shape arithmetic, which needs an fx graph")
        if batch not in self._shape_envs:
            self._shape_envs[batch] = self.runner.capture_env(self._example(batch))
        return self._shape_envs[batch][name]


def time_layer_split(
    model: nn.Module,
    graph: ModelGraph,
    layer: str,
    split: Mapping[str, int] | Sequence[int],
    *,
    batch_size: int | None = None,
    device: str | torch.device = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = None,
) -> SplitTiming:
    """One worker's time of ``layer`` under ``split``; see the module docstring."""
    timer = SplitTimer(
        model,
        graph,
        batch_size=batch_size,
        device=device,
        warmup=warmup,
        repeats=repeats,
        threads=threads,
    )
    return timer.time(layer, split)


def _dtype(name: str | None) -> torch.dtype:
    return getattr(torch, name or "float32")


def _flat_tensors(v) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, tuple | list):
        return [t for x in v for t in _flat_tensors(x)]
    return []


_SPATIAL = ("conv", "pool")


class _SlicePlan:
    """How one layer's inputs and member ops shrink to one worker's slice."""

    def __init__(self, anchor, kind: str, split: dict[str, int], traced_batch: int, batch: int):
        self.anchor, self.kind, self.split = anchor, kind, split
        self.batch = batch
        self.traced_batch = traced_batch
        self.out_shape = list(anchor.output_shape or [])
        if self.out_shape:
            self.out_shape[0] = batch
        spatial = split["h"] > 1 or split["w"] > 1
        if kind in ("linear", "rnn", "embedding") and spatial:
            raise ValueError(f"layer {anchor.name!r} ({kind}) has no h/w dims to split")
        if kind in ("rnn", "embedding") and split["c"] > 1:
            raise ValueError(f"layer {anchor.name!r} ({kind}) supports only sample (n) splits")
        if spatial and len(self.out_shape) < 3:
            raise ValueError(f"layer {anchor.name!r} output {self.out_shape} has no h/w dims")
        # Output slice the worker computes, dim by dim (n, c, then spatial).
        self.spatial_split = [split["h"], split["w"]][: max(0, len(self.out_shape) - 2)]
        self.workers = split["n"] * split["c"] * split["h"] * split["w"]

    # inputs -------------------------------------------------------------------------------
    def input_value(self, name: str, value, batched: bool = True):
        """``value`` cut to one worker's slice; a tensor without a batch dimension (a position
        embedding, a mask) is read whole by every worker."""
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or not batched:
            return value
        shape = list(value.shape)
        sl = [slice(None)] * value.dim()
        sl[0] = slice(0, _ceil_div(shape[0], self.split["n"]))
        if self.kind == "conv":
            groups = int(self.anchor.attrs.get("groups", 1))
            if groups > 1 and self.split["c"] > 1:
                sl[1] = slice(0, _ceil_div(shape[1], self.split["c"]))
        elif self.kind not in ("linear", "rnn", "embedding") and value.dim() > 1:
            sl[1] = slice(0, _ceil_div(shape[1], self.split["c"]))
        for i, deg in enumerate(self.spatial_split):
            d = 2 + i
            if deg == 1 or d >= value.dim():
                continue
            sl[d] = slice(0, min(shape[d], self._input_rows(i, shape[d], deg)))
        return value[tuple(sl)].contiguous()

    def _input_rows(self, i: int, in_size: int, deg: int) -> int:
        """Input rows (or columns) one worker reads along spatial dim ``i``, halo included."""
        out_rows = _ceil_div(self.out_shape[2 + i], deg)
        attrs = self.anchor.attrs
        if self.kind in _SPATIAL and "kernel_size" in attrs:
            nd = len(self.out_shape) - 2
            k = _pair(attrs["kernel_size"], nd)[i]
            s = _pair(attrs.get("stride") or attrs["kernel_size"], nd)[i]
            dil = _pair(attrs.get("dilation", 1), nd)[i]
            # An interior slice: no padding, the halo the model charges (Window).
            lo, hi = Window(k, s, 0, dil).input_range(0, out_rows)
            return hi - lo
        return _ceil_div(in_size, deg)  # adaptive pools, elementwise ops

    # members ------------------------------------------------------------------------------
    def step(self, s: LayerStep, node) -> LayerStep:
        sp = self.split
        if s.kind == "call_module":
            m = s.target
            if isinstance(m, nn.modules.conv._ConvNd):
                return _replace(s, self._conv(m))
            if isinstance(m, nn.Linear):
                lin = nn.Linear(
                    m.in_features, _ceil_div(m.out_features, sp["c"]), m.bias is not None
                )
                return _replace(s, lin.to(m.weight.device))
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and sp["c"] > 1:
                bn = type(m)(_ceil_div(m.num_features, sp["c"]), eps=m.eps, affine=m.affine)
                return _replace(s, bn.to(next(m.buffers()).device))
            if isinstance(m, nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd):
                pool = copy.copy(m)
                pool.padding = self._spatial_padding(m.padding)
                return _replace(s, pool)
            if isinstance(
                m, nn.modules.pooling._AdaptiveAvgPoolNd | nn.modules.pooling._AdaptiveMaxPoolNd
            ):
                pool = copy.copy(m)
                nd = len(self.out_shape) - 2
                size = _pair(m.output_size, nd)
                pool.output_size = tuple(
                    _ceil_div(size[i], deg) for i, deg in enumerate(self.spatial_split)
                )
                return _replace(s, pool)
            return s
        if s.kind == "call_function" and node.op.startswith("conv"):
            raise ValueError(f"layer {self.anchor.name!r}: functional convolutions cannot be split")
        if s.kind == "call_function" and "pool" in node.op and "adaptive" not in node.op:
            try:
                pair = normalize_function(
                    s.target, s.args, s.kwargs, normalize_to_only_use_kwargs=True
                )
            except Exception:
                pair = None
            if pair is not None:
                kwargs = dict(pair.kwargs)
                kwargs["padding"] = self._spatial_padding(kwargs.get("padding", 0))
                return LayerStep(s.name, s.kind, s.target, (), kwargs)
            return s
        if s.kind == "call_method" and s.target in ("view", "reshape") and sp["n"] != self.workers:
            if node.output_shape is None or len(node.output_shape) != 2:
                raise ValueError(
                    f"layer {self.anchor.name!r}: cannot slice a {s.target} to {node.output_shape}"
                )
            return LayerStep(
                s.name, "call_function", lambda t, *a: t.reshape(t.shape[0], -1), (s.args[0],), {}
            )
        return s

    def _conv(self, m: nn.modules.conv._ConvNd) -> nn.Module:
        c = self.split["c"]
        groups, cin = m.groups, m.in_channels
        if groups > 1 and c > 1:
            if groups % c:
                raise ValueError(
                    f"layer {self.anchor.name!r}: {groups} groups cannot be split {c} ways"
                )
            groups, cin = groups // c, m.in_channels // c
        nd = len(m.kernel_size)
        padding = m.padding
        if isinstance(padding, str):  # "same"/"valid" -> explicit numbers
            padding = tuple(
                (d * (k - 1)) // 2 if padding == "same" else 0
                for k, d in zip(m.kernel_size, m.dilation, strict=True)
            )
        conv = type(m)(
            cin,
            _ceil_div(m.out_channels, c),
            m.kernel_size,
            stride=m.stride,
            padding=self._spatial_padding(padding, nd),
            dilation=m.dilation,
            groups=groups,
            bias=m.bias is not None,
        )
        return conv.to(m.weight.device)

    def _spatial_padding(self, padding, nd: int | None = None):
        nd = nd or len(self.out_shape) - 2
        pads = _pair(padding, nd)
        return tuple(
            0 if i < len(self.spatial_split) and self.spatial_split[i] > 1 else p
            for i, p in enumerate(pads)
        )


def _replace(s: LayerStep, module: nn.Module) -> LayerStep:
    return LayerStep(s.name, s.kind, module, s.args, s.kwargs)
