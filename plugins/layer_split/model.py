"""DeePa's cost model: configurations, the slices they give each worker, and the cost tables.

A configuration of an op is one degree per dimension of its OUTPUT tensor --
sample ``n``, channel ``c``, height ``h``, width ``w`` (FC layers: ``n`` and
``c``) -- whose product is the number of workers it uses (Jia et al., Sec. 3).
Worker ``k`` of a configuration runs on device ``k`` (the row-major index of
its coordinates over ``(n, c, h, w)``), so two ops with equal configurations
hold equal slices on equal devices and nothing moves between them.

The per-step cost of a global configuration ``g`` is Eq. 1::

    Cost(g) = sum_v compute_v(g(v)) + update_v(g(v)) + sum_(u,v) xfer_(u,v)(g(u), g(v))

with tables built here:

* ``compute`` -- forward + backward time of the largest worker's slice:
  measured by running it (``runtime.time_layer_slice``), or analytic
  (FLOPs / (peak x efficiency), with a memory-traffic floor and a per-op overhead)
  for hardware one does not have.
* ``xfer`` -- in the paper's convention (the default, which reproduces its
  Tables 2 and 3) every consumer worker receives a full copy of the input
  region it needs, at one machine-wide rate, and nothing moves between equal
  configurations; the ``exact`` variant counts only bytes not already on the
  worker's device, halos included, both in the forward pass and for the
  gradients sent back, plus a latency per message.
* ``update`` -- gradient synchronisation: in the paper's convention
  ``replicas x parameter bytes / rate`` where ``replicas = n*h*w`` (spatial
  splits replicate weights like samples do) and 0 with a single replica; the
  ``exact`` variant counts the bytes of a ring all-reduce of each channel shard
  among its replicas at the same rate (or times it with a measured
  all-reduce fit when the hardware has one).

Note on the paper's rule "xfer is 0 when c_u == c_v": taken literally it makes
a channel-split FC feeding a channel-split FC free, although each consumer
worker needs every input feature. We apply it only where the consumer's
sample and channel needs are already on its device (halos are ignored, as the
paper does); Tables 2 and 3 are unaffected.

One module, though long: the op specs, their windows and the three Eq. 1 tables
are one model, each table read by the others' code (a transfer's cost needs
the producer's and the consumer's slices), and the paper's worked tables are
tested against it as a whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tunekit.api import ComputeRate, Hardware
from tunekit.errors import PluginError

DIMS = ("n", "c", "h", "w")

# -- configurations --------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class SplitConfig:
    """Degrees of parallelism of one op's output over (sample, channel, height, width)."""

    n: int = 1
    c: int = 1
    h: int = 1
    w: int = 1

    def __post_init__(self) -> None:
        for d in DIMS:
            v = getattr(self, d)
            if not isinstance(v, int) or v < 1:
                raise PluginError(f"layer_split: degree {d}={v!r} must be a positive integer")

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        return (self.n, self.c, self.h, self.w)

    @property
    def workers(self) -> int:
        return self.n * self.c * self.h * self.w

    def coords(self, worker: int) -> tuple[int, int, int, int]:
        """Coordinates of worker (= device) ``worker`` over (n, c, h, w), row-major."""
        return tuple(int(i) for i in np.unravel_index(worker, self.degrees))

    def label(self) -> str:
        """Compact form: ``n2``, ``c2``, ``h2w2``; ``1`` for one worker."""
        parts = [f"{d}{v}" for d, v in zip(DIMS, self.degrees, strict=True) if v > 1]
        return "".join(parts) or "1"

    @classmethod
    def parse(cls, text: str) -> SplitConfig:
        """Inverse of :meth:`label`."""
        import re

        text = text.strip()
        if text == "1":
            return cls()
        parts = re.fullmatch(r"((?:[nchw]\d+)+)", text)
        if not parts:
            raise PluginError(f"layer_split: {text!r} is not a config like n2, c2 or h2w2")
        degrees = {d: int(v) for d, v in re.findall(r"([nchw])(\d+)", text)}
        return cls(**degrees)


def candidate_degrees(ndev: int) -> list[int]:
    return [d for d in range(1, ndev + 1) if ndev % d == 0]


# -- op specs -----------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """How output positions along one spatial dim map to input positions (conv, pool)."""

    kernel: int
    stride: int
    pad: int
    dilation: int = 1

    def input_range(self, lo, hi):
        """Input positions (padding included: may be < 0 or >= size) that outputs [lo, hi)
        read, halo included; elementwise on numpy arrays. One geometry for the transfers
        the model charges and the slices the split timer runs (``measure.py``)."""
        return lo * self.stride - self.pad, (
            (hi - 1) * self.stride - self.pad + (self.kernel - 1) * self.dilation + 1
        )


@dataclass(frozen=True)
class Use:
    """One tensor argument of an op: which producer, and where it lands in the output."""

    producer: str
    direct: bool
    """The consumer reads the producer's split tensor as is (no reshape in between)."""
    cat_dim: int | None = None
    """For concat: the canonical dim this argument is concatenated along ..."""
    cat_offset: int = 0
    """... and its offset there."""
    shape: tuple[int, ...] = ()
    """The argument's shape as the consumer reads it, at the global batch."""


@dataclass
class OpSpec:
    """One layer as the cost model and the executor see it, at the global batch."""

    name: str
    kind: str
    """``input``, ``output``, ``conv``, ``linear``, ``pool``, ``concat``, ``add``, ``norm``, ``other``."""
    shape: tuple[int, int, int, int]
    """Canonical (N, C, H, W) of the tensor the config splits (missing dims are 1)."""
    rank: int
    """Real number of dims of that tensor."""
    out_shape: tuple[int, ...]
    """The layer's output as its consumers read it (after a trailing flatten, say)."""
    splittable: tuple[bool, bool, bool, bool]
    param_bytes: int
    flops: float
    """Forward FLOPs at the global batch."""
    elem_bytes: int = 4
    windows: tuple[Window | None, Window | None] = (None, None)
    channel_rule: str = "own"
    """Input channels a worker needs: ``own`` (its output channels), ``all``, or ``groups``."""
    groups: int = 1
    uses: list[Use] = field(default_factory=list)
    replicated: bool = False
    """Held whole by every device (the input batch: every rank builds it; a layer without a
    batch dimension, such as ``torch.arange(seq)`` or a position embedding: every rank
    computes it whole)."""
    batched: bool = True
    subgraph: bool = False
    """The executor runs it as its fx subgraph (``units.runs_as_subgraph``): sample splits
    (and head splits of an attention core: :attr:`heads`)."""
    heads: int = 0
    """A fused attention core's heads (:func:`~tunekit.plugins.layer_split.heads.heads_of`):
    its output channels split by whole heads too (``h`` of a ``(N, T, C)`` tensor); 0: none."""
    dtype: str | None = None
    """The recorded dtype of the layer's output (``int64`` for token ids, ``float32`` ...)."""
    """The tensor's first dim is the batch (False: a per-model constant, ``shape`` as is)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def canonical(shape: Sequence[int]) -> tuple[int, int, int, int]:
    s = list(shape)
    if len(s) > 4:
        s = [s[0], math.prod(s[1:]), 1, 1]
    return tuple(s + [1] * (4 - len(s)))  # type: ignore[return-value]


def _pair(v, default: int) -> tuple[int, int]:
    if v is None or v == []:
        return default, default
    if isinstance(v, list | tuple):
        return (int(v[0]), int(v[-1])) if v else (default, default)
    return int(v), int(v)


def _conv_windows(attrs: dict) -> tuple[Window, Window]:
    k = _pair(attrs.get("kernel_size"), 1)
    s = _pair(attrs.get("stride"), 1)
    d = _pair(attrs.get("dilation"), 1)
    pad = attrs.get("padding", 0)
    if pad == "valid":
        p = (0, 0)
    elif pad == "same":
        p = tuple(d[i] * (k[i] - 1) // 2 for i in range(2))
    else:
        p = _pair(pad, 0)
    return tuple(Window(k[i], s[i], p[i], d[i]) for i in range(2))  # type: ignore[return-value]


def _pool_windows(op: str, attrs: dict, in_hw: tuple[int, int], out_hw: tuple[int, int]):
    """Pool windows, or None where a spatial split is not a plain window (adaptive, uneven)."""
    if op.startswith("adaptive"):
        wins = []
        for i in range(2):
            if out_hw[i] and in_hw[i] % out_hw[i] == 0:
                k = in_hw[i] // out_hw[i]
                wins.append(Window(k, k, 0))
            else:
                wins.append(None)
        return tuple(wins)
    k = _pair(attrs.get("kernel_size"), 1)
    stride = attrs.get("stride")
    s = k if stride in (None, [], ()) else _pair(stride, 1)
    p = _pair(attrs.get("padding"), 0)
    d = _pair(attrs.get("dilation"), 1)
    return tuple(Window(k[i], s[i], p[i], d[i]) for i in range(2))


_RESHAPE_OPS = {"flatten", "view", "reshape", "contiguous", "squeeze", "unsqueeze"}


def specs_from_graph(graph, global_batch: int) -> dict[str, OpSpec]:
    """One :class:`OpSpec` per layer of a :class:`~tunekit.observe.graph.ModelGraph`.

    Shapes, bytes and FLOPs are rescaled from the trace batch to ``global_batch``.
    """
    from tunekit.api import layer_output
    from tunekit.plugins.layer_split.heads import heads_of
    from tunekit.plugins.layer_split.units import runs_as_subgraph

    scale = global_batch / graph.batch_size
    nodes = graph.nodes
    batched = graph.batched_nodes()

    def at_batch(shape) -> tuple[int, ...]:
        return (global_batch, *shape[1:]) if shape else (global_batch,)

    specs: dict[str, OpSpec] = {}
    for layer in graph.layers.values():
        anchor = nodes[layer.nodes[0]]
        const = (
            layer.kind not in ("input", "output")
            and layer_output([nodes[m] for m in layer.nodes], layer.name, nodes).name not in batched
        )
        subgraph = runs_as_subgraph(graph, layer, batched)
        if layer.kind == "output":
            srcs = [nodes[i] for i in anchor.inputs]
            if not srcs or srcs[0].output_shape is None:
                raise PluginError("layer_split: the model's output is not a tensor")
            split_shape = at_batch(srcs[0].output_shape)
            out_shape = split_shape
        elif layer.kind == "input":
            split_shape = out_shape = at_batch(anchor.output_shape)
        elif const:  # no batch dimension: every rank computes it whole
            split_shape = out_shape = tuple(layer.output_shape or (1,))
        elif subgraph:  # run as a subgraph: split where it ends
            split_shape = out_shape = at_batch(layer.output_shape)
        else:
            # The split tensor is the last member before any reshape; consumers read the layer output.
            last = anchor
            for m in layer.nodes[1:]:
                node = nodes[m]
                if node.op in _RESHAPE_OPS:
                    break
                last = node
            split_shape = at_batch(last.output_shape)
            out_shape = at_batch(layer.output_shape)
        shape = canonical(split_shape)
        rank = min(len(split_shape), 4)
        elem = _elem_bytes(anchor.output_dtype)
        spec = OpSpec(
            name=layer.name,
            kind=layer.kind,
            shape=shape,
            rank=rank,
            out_shape=tuple(out_shape),
            splittable=(True, False, False, False),
            param_bytes=int(layer.param_bytes),
            flops=float(layer.flops) * scale,
            elem_bytes=elem,
            replicated=layer.kind == "input",
            dtype=layer_output([nodes[m] for m in layer.nodes], layer.name, nodes).output_dtype
            if layer.kind != "output"
            else None,
        )
        if const:
            spec.replicated, spec.batched = True, False
            spec.flops = float(layer.flops)
            spec.subgraph = True
            specs[layer.name] = spec
            continue
        if subgraph:  # samples (and heads); a worker reads its samples of every input whole
            spec.subgraph = True
            heads = heads_of(graph, layer)
            if heads is not None:
                spec.heads = heads.count
                spec.splittable = (True, False, True, False)
            specs[layer.name] = spec
            continue
        _set_rules(spec, layer, anchor, nodes, at_batch)
        specs[layer.name] = spec
    _set_uses(specs, graph, at_batch)
    return specs


def _elem_bytes(dtype: str | None) -> int:
    return {
        "float64": 8,
        "float16": 2,
        "bfloat16": 2,
        "int64": 8,
        "int32": 4,
        "uint8": 1,
        "bool": 1,
        "int8": 1,
    }.get(dtype or "float32", 4)


def _set_rules(spec: OpSpec, layer, anchor, nodes, at_batch) -> None:
    """Which dims split, and what input a worker needs, by op kind."""
    kind, rank, attrs = spec.kind, spec.rank, layer.attrs
    spatial = rank >= 3
    in_shape = None
    if anchor.inputs:
        src = nodes[anchor.inputs[0]].output_shape
        in_shape = canonical(at_batch(src)) if src else None
    if kind == "conv":
        spec.groups = int(attrs.get("groups", 1) or 1)
        spec.channel_rule = "groups" if spec.groups > 1 else "all"
        if rank == 4 and in_shape is not None:
            spec.windows = _conv_windows(attrs)
        elif rank == 3 and in_shape is not None:
            spec.windows = (_conv_windows(attrs)[0], None)
        spec.splittable = (True, True, spec.windows[0] is not None, spec.windows[1] is not None)
    elif kind == "pool":
        spec.channel_rule = "own"
        if spatial and in_shape is not None:
            wins = _pool_windows(anchor.op, attrs, in_shape[2:], spec.shape[2:])
            spec.windows = (wins[0], wins[1] if rank == 4 else None)
        spec.splittable = (True, True, spec.windows[0] is not None, spec.windows[1] is not None)
    elif kind == "linear":
        spec.channel_rule = "all"
        spec.splittable = (True, rank == 2, False, False)
    elif kind in ("concat", "add") or anchor.op == "batch_norm":
        spec.splittable = (True, rank >= 2, rank >= 3, rank >= 4)
    elif kind in ("input", "output"):
        spec.splittable = (kind == "output", False, False, False)
    else:  # layer/group norm, embedding, rnn, other: only samples are known to be independent
        spec.splittable = (True, False, False, False)
    if len(anchor.output_shape or ()) > 4:  # canonical dims merge beyond four: samples only
        spec.splittable = (True, False, False, False)


def _set_uses(specs: dict[str, OpSpec], graph, batch_shape) -> None:
    nodes = graph.nodes
    batched = graph.batched_nodes()

    def at_batch(shape, name=None):  # a per-model constant keeps its own first dim
        return batch_shape(shape) if name is None or name in batched else tuple(shape)

    for layer in graph.layers.values():
        spec = specs[layer.name]
        anchor = nodes[layer.nodes[0]]
        srcs = [nodes[i] for i in anchor.inputs if nodes[i].layer is not None]
        if spec.subgraph:  # every member's inputs
            srcs = external_inputs(graph, layer)
        cat_dim = None
        offsets = []
        if spec.kind == "concat" and srcs:
            cat_dim, offsets = _concat_layout(
                spec.shape, [canonical(at_batch(s.output_shape, s.name)) for s in srcs]
            )
        uses = []
        for j, src in enumerate(srcs):
            prod = specs[src.layer]
            # Direct: the consumer reads the producer's split tensor element for element
            # (no flatten or view in between that would mix dims).
            view = canonical(at_batch(src.output_shape, src.name)) if src.output_shape else None
            if not prod.batched:  # read whole by every worker: only samples split
                spec.splittable = (spec.splittable[0], False, False, False)
            uses.append(
                Use(
                    src.layer,
                    view == prod.shape,
                    cat_dim,
                    offsets[j] if offsets else 0,
                    tuple(at_batch(src.output_shape, src.name)) if src.output_shape else (),
                )
            )
        spec.uses = uses


def external_inputs(graph, layer) -> list:
    """The data inputs (graph nodes of other layers) a layer's members read, in order."""
    nodes, out = graph.nodes, []
    for m in layer.nodes:
        for i in nodes[m].inputs:
            if nodes[i].layer not in (None, layer.name) and nodes[i] not in out:
                out.append(nodes[i])
    return out


def _concat_layout(out: tuple[int, ...], parts: list[tuple[int, ...]]) -> tuple[int, list[int]]:
    """The dim a concat joins along (where the parts add up to the output) and their offsets."""
    for d in range(4):
        if sum(p[d] for p in parts) == out[d] and all(
            p[e] == out[e] for p in parts for e in range(4) if e != d
        ):
            offs, acc = [], 0
            for p in parts:
                offs.append(acc)
                acc += p[d]
            return d, offs
    raise PluginError("layer_split: cannot tell which dimension a concat joins along")


# -- config spaces ----------------------------------------------------------------------


def config_space(spec: OpSpec, ndev: int) -> list[SplitConfig]:
    """Every configuration of ``spec`` on ``ndev`` devices (fewer workers allowed).

    Degrees are divisors of ``ndev`` whose product divides ``ndev`` (for 16
    devices: powers of two, 70 tuples over four dims), none larger than the
    dimension it splits.
    """
    if spec.replicated:
        return [SplitConfig()]
    degs = candidate_degrees(ndev)
    per_dim = [
        [d for d in degs if d <= spec.shape[i]] if spec.splittable[i] else [1] for i in range(4)
    ]
    if spec.heads:  # an attention core's channels split by whole heads
        per_dim[2] = [d for d in per_dim[2] if spec.heads % d == 0]
    out = []
    for n in per_dim[0]:
        for c in per_dim[1]:
            for h in per_dim[2]:
                for w in per_dim[3]:
                    p = n * c * h * w
                    if ndev % p == 0:
                        out.append(SplitConfig(n, c, h, w))
    return out


# -- slices and regions --------------------------------------------------------------------
#
# A box is a (4, 2) int array: [lo, hi) per canonical dim. Functions take stacks of
# boxes, shape (..., 4, 2), so whole config spaces are mapped at once.


def owned_boxes(spec: OpSpec, cfg: SplitConfig) -> np.ndarray:
    """``(workers, 4, 2)``: the output slice each worker computes (and then holds)."""
    coords = np.stack(np.unravel_index(np.arange(cfg.workers), cfg.degrees), axis=-1)  # (P, 4)
    size = np.asarray(spec.shape, dtype=np.int64)
    deg = np.asarray(cfg.degrees, dtype=np.int64)
    q, r = size // deg, size % deg
    lo = coords * q + np.minimum(coords, r)
    hi = lo + q + (coords < r)
    return np.stack([lo, hi], axis=-1)


def owned_stack(spec: OpSpec, space: Sequence[SplitConfig], ndev: int) -> np.ndarray:
    """``(K, ndev, 4, 2)``: each config's slices by device; devices it leaves idle hold nothing."""
    out = np.zeros((len(space), ndev, 4, 2), dtype=np.int64)
    for i, cfg in enumerate(space):
        out[i, : cfg.workers] = owned_boxes(spec, cfg)
    return out


def input_boxes(
    consumer: OpSpec, use: Use, producer: OpSpec, out: np.ndarray, halo: bool = True
) -> np.ndarray:
    """The regions of ``producer``'s split tensor that consumer workers owning ``out`` need.

    UNCLIPPED: spatial ranges may reach into the padding (below 0 or past the
    end); :func:`clip_boxes` them for bytes. An empty output needs nothing.
    With ``halo=False`` a spatially split conv or pool is charged only its own
    stride-aligned share of the input, as the paper's Table 3 does (its
    ``{h=2, w=2}`` row moves the same bytes as the sample splits).
    """
    out = np.asarray(out, dtype=np.int64)
    full = np.array([[0, s] for s in producer.shape], dtype=np.int64)
    need = np.broadcast_to(full, out.shape).copy()
    kind = consumer.kind
    if not producer.batched:  # a per-model constant: every worker reads all of it
        pass
    elif consumer.subgraph or not use.direct or kind == "linear":
        # A reshape keeps samples apart, and an FC layer reads all features: own samples, all else.
        need[..., 0, :] = out[..., 0, :]
    elif kind in ("conv", "pool"):
        need[..., 0, :] = out[..., 0, :]
        if consumer.channel_rule == "own":
            need[..., 1, :] = out[..., 1, :]
        elif consumer.channel_rule == "groups":
            opg = consumer.shape[1] // consumer.groups
            ipg = producer.shape[1] // consumer.groups
            need[..., 1, 0] = out[..., 1, 0] // opg * ipg
            need[..., 1, 1] = ((out[..., 1, 1] - 1) // opg + 1) * ipg
        for i, d in enumerate((2, 3)):
            win = consumer.windows[i]
            if win is None:
                continue
            lo, hi = out[..., d, 0], out[..., d, 1]
            if halo:
                need[..., d, 0], need[..., d, 1] = win.input_range(lo, hi)
            else:
                need[..., d, 0] = lo * win.stride
                need[..., d, 1] = np.where(
                    hi >= consumer.shape[d], producer.shape[d], hi * win.stride
                )
    elif kind == "concat" and use.cat_dim is not None:
        need[:] = out
        d = use.cat_dim
        need[..., d, 0] = np.maximum(out[..., d, 0] - use.cat_offset, 0)
        need[..., d, 1] = np.minimum(out[..., d, 1] - use.cat_offset, producer.shape[d])
    elif producer.shape == consumer.shape:  # elementwise: add, norm, the loss
        need[:] = out
    else:
        need[..., 0, :] = out[..., 0, :]
    empty = np.any(out[..., 1] <= out[..., 0], axis=-1)
    need[empty] = 0
    return need


def clip_boxes(boxes: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    size = np.asarray(shape, dtype=np.int64)
    lo = np.clip(boxes[..., 0], 0, size)
    hi = np.clip(boxes[..., 1], lo, size)
    return np.stack([lo, hi], axis=-1)


def box_numel(box: np.ndarray) -> np.ndarray | int:
    """Elements in a box (or in each of a stack of boxes)."""
    n = np.prod(np.maximum(box[..., 1] - box[..., 0], 0), axis=-1)
    return int(n) if np.ndim(n) == 0 else n


# -- hardware rates ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rate:
    """One machine-wide transfer rate (the paper's convention)."""

    bandwidth: float  # bytes/s
    latency: float  # s
    source: str

    def time(self, nbytes: float, messages: float = 0.0) -> float:
        return nbytes / self.bandwidth + messages * self.latency


def transfer_rate(hw: Hardware, ndev: int) -> Rate:
    """The rate DeePa's tables charge: a calibrated ``model`` p2p fit, else a measured
    p2p fit, else the slowest device-to-device path of the hardware graph."""
    fits = [c for c in hw.collectives if c.op == "p2p"]
    fits.sort(key=lambda c: (c.backend != "model", abs(c.world_size - ndev)))
    if fits:
        f = fits[0]
        return Rate(f.bandwidth, f.latency, f"{f.backend} p2p fit, {f.bandwidth / 1e9:.3g} GB/s")
    names = hw.device_names[:ndev]
    if len(names) < 2:
        return Rate(math.inf, 0.0, "one device")
    bw = min(hw.path_bandwidth(names[0], b) for b in names[1:])
    lat = max(sum(lk.latency for lk in hw.route(names[0], b)) for b in names[1:])
    return Rate(bw, lat, f"slowest path of {hw.name}, {bw / 1e9:.3g} GB/s")


# -- cost tables ------------------------------------------------------------------------


@dataclass
class CostOptions:
    """How the cost tables are computed."""

    xfer: str = "paper"
    """``paper``: full copy of its input region per consumer worker, 0 between equal configs;
    ``exact``: only bytes missing on the device, halos and backward gradients included."""
    update: str = "paper"
    """``paper``: replicas x parameter bytes / rate; ``exact``: ring all-reduce bytes per channel shard."""
    efficiency: float = 0.5
    """Analytic compute: the fraction of peak FLOP/s a slice reaches."""
    flops_per_byte: float = 16.0
    """Analytic compute: peak FLOP/s over memory bandwidth (K80, V100 ~ 16-18) for the memory floor."""
    op_overhead_s: float = 30e-6
    """Analytic compute: fixed cost per layer for forward + backward (kernel launches)."""

    def __post_init__(self) -> None:
        if self.xfer not in ("paper", "exact"):
            raise PluginError(f"layer_split: xfer model must be paper or exact, not {self.xfer!r}")
        if self.update not in ("paper", "exact"):
            raise PluginError(
                f"layer_split: update model must be paper or exact, not {self.update!r}"
            )
        if not 0 < self.efficiency <= 1:
            raise PluginError("layer_split: efficiency must be in (0, 1]")


ComputeFn = Callable[[OpSpec, SplitConfig], float]


def analytic_compute(hw: Hardware, options: CostOptions) -> ComputeFn:
    """compute(v, c) from FLOPs: the largest worker's share at ``efficiency`` x peak,
    never below its memory traffic, plus a fixed per-op overhead."""
    dev = hw.devices[0]
    rate = ComputeRate.assumed(dev.peak_flops, options.efficiency)
    mem_bw = dev.peak_flops / options.flops_per_byte

    def compute(spec: OpSpec, cfg: SplitConfig) -> float:
        if spec.kind in ("input", "output"):
            return 0.0
        largest = int(box_numel(owned_boxes(spec, cfg)).max())
        share = largest / spec.numel
        passes = 3.0 if spec.param_bytes else 2.0  # backward = data grad (+ weight grad)
        flop_s = rate.seconds(passes * spec.flops * share)
        mem_s = passes * 2 * largest * spec.elem_bytes / mem_bw  # read input + write output, ~
        return max(flop_s, mem_s) + options.op_overhead_s

    return compute


@dataclass
class Tables:
    """Eq. 1's tables for one model on one machine."""

    specs: dict[str, OpSpec]
    spaces: dict[str, list[SplitConfig]]
    compute: dict[str, np.ndarray]
    update: dict[str, np.ndarray]
    xfer: list[tuple[str, str, np.ndarray]]
    """(producer, consumer, table[c_u, c_v]) per use: an op reading a tensor twice has two."""
    xfer_bytes: list[tuple[str, str, np.ndarray]]
    update_bytes: dict[str, np.ndarray]
    ndev: int
    rate: Rate
    options: CostOptions
    compute_source: str


def update_table(
    spec: OpSpec, space: list[SplitConfig], hw: Hardware, rate: Rate, options: CostOptions
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds and bytes of gradient synchronisation per config."""
    secs = np.zeros(len(space))
    nbytes = np.zeros(len(space))
    if not spec.param_bytes:
        return secs, nbytes
    for i, cfg in enumerate(space):
        replicas = cfg.n * cfg.h * cfg.w
        if replicas <= 1:
            continue
        if options.update == "paper":
            nbytes[i] = replicas * spec.param_bytes
            secs[i] = rate.time(nbytes[i])
            continue
        # exact: each of the c weight shards is ring-all-reduced among its replicas,
        # 2(r-1)/r of the shard per member; a measured all-reduce fit times it when there is one.
        shard = spec.param_bytes / cfg.c
        nbytes[i] = cfg.c * 2 * (replicas - 1) * shard
        fit = hw.fit("all_reduce", replicas)
        if fit is not None:
            secs[i] = fit.time(shard)
        else:
            secs[i] = rate.time(nbytes[i], messages=2 * (replicas - 1))
    return secs, nbytes


def xfer_table(
    consumer: OpSpec,
    use: Use,
    producer: OpSpec,
    own: np.ndarray,
    cu_space: list[SplitConfig],
    consumer_own: np.ndarray,
    cv_space: list[SplitConfig],
    rate: Rate,
    options: CostOptions,
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds and bytes to move ``producer``'s output to ``consumer``, per (c_u, c_v).

    ``own`` and ``consumer_own`` are :func:`owned_stack` of the two layers' spaces.
    """
    ku, kv = len(cu_space), len(cv_space)
    if producer.replicated:
        return np.zeros((ku, kv)), np.zeros((ku, kv))
    elem = producer.elem_bytes
    halo = options.xfer == "exact"
    want = clip_boxes(input_boxes(consumer, use, producer, consumer_own, halo), producer.shape)
    want_dev = box_numel(want).astype(np.float64)  # (kv, ndev)
    if options.xfer == "paper":
        nbytes = np.broadcast_to(want_dev.sum(axis=1)[None, :] * elem, (ku, kv)).copy()
        index = {c: i for i, c in enumerate(cu_space)}
        for j, cv in enumerate(cv_space):
            i = index.get(cv)
            if i is not None and _nonspatial_resident(own[i], want[j], cv.workers):
                nbytes[i, j] = 0.0
        return nbytes / rate.bandwidth, nbytes
    # Resident elements: the producer's slice on device d overlaps what worker d needs.
    lo = np.maximum(own[:, None, :, :, 0], want[None, :, :, :, 0])
    hi = np.minimum(own[:, None, :, :, 1], want[None, :, :, :, 1])
    per_dev = np.prod(np.maximum(hi - lo, 0), axis=-1)  # (ku, kv, ndev)
    missing = want_dev[None, :, :] - per_dev
    nbytes = 2.0 * missing.sum(axis=-1) * elem  # forward activations + backward gradients
    messages = 2.0 * (missing > 0).sum(axis=-1)
    return nbytes / rate.bandwidth + messages * rate.latency, nbytes


def _nonspatial_resident(own: np.ndarray, want: np.ndarray, workers: int) -> bool:
    """Whether every worker's sample and channel needs lie within its own slice."""
    for k in range(workers):
        for d in (0, 1):
            if want[k, d, 1] > want[k, d, 0] and (
                want[k, d, 0] < own[k, d, 0] or want[k, d, 1] > own[k, d, 1]
            ):
                return False
    return True


def build_tables(
    specs: dict[str, OpSpec],
    hw: Hardware,
    ndev: int,
    options: CostOptions | None = None,
    compute_fn: ComputeFn | None = None,
    compute_source: str = "analytic",
    spaces: dict[str, list[SplitConfig]] | None = None,
) -> Tables:
    """Every table of Eq. 1 for ``specs`` on ``ndev`` devices of ``hw``."""
    options = options or CostOptions()
    if ndev < 1:
        raise PluginError("layer_split: needs at least one device")
    if len(hw.devices) < ndev and not any(c.op == "p2p" for c in hw.collectives):
        raise PluginError(
            f"layer_split: hardware {hw.name!r} has {len(hw.devices)} devices, not {ndev}"
        )
    rate = transfer_rate(hw, ndev)
    if compute_fn is None:
        compute_fn = analytic_compute(hw, options)
    spaces = spaces or {v: config_space(s, ndev) for v, s in specs.items()}
    compute, update, update_bytes = {}, {}, {}
    for v, spec in specs.items():
        compute[v] = np.array([compute_fn(spec, c) for c in spaces[v]], dtype=np.float64)
        update[v], update_bytes[v] = update_table(spec, spaces[v], hw, rate, options)
    owned = {v: owned_stack(spec, spaces[v], ndev) for v, spec in specs.items()}
    xfer, xfer_bytes = [], []
    for v, spec in specs.items():
        for use in spec.uses:
            u = use.producer
            secs, nbytes = xfer_table(
                spec, use, specs[u], owned[u], spaces[u], owned[v], spaces[v], rate, options
            )
            xfer.append((use.producer, v, secs))
            xfer_bytes.append((use.producer, v, nbytes))
    return Tables(
        specs,
        spaces,
        compute,
        update,
        xfer,
        xfer_bytes,
        update_bytes,
        ndev,
        rate,
        options,
        compute_source,
    )
