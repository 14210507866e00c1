"""Measured forward and backward time of every layer, whole or as one worker's slice.

Two entry points, both running the layers of a :class:`~tunekit.observe.graph.ModelGraph`
standalone on the local device (warm-up runs, then ``repeats`` timed runs; the
median is reported with the interquartile range as spread).

**Times add up to the step.** The forward and backward times of all layers
add up to the forward and backward of the whole model (tested within 10%), on
two conditions, which is how the timings are taken:

* the threads a training rank gets (``threads``; a rank of a 2-rank job on 2
  cores runs one): timing layers with every core's threads while the job
  gives each rank one both mis-states them and, on a machine whose cores are
  busy, makes each op wait for its descheduled helper threads (a transformer
  encoder measured 293 + 1260 ms layer by layer against a 246 ms step);
* on the CPU with one thread, the clock is the thread's CPU time
  (``time.thread_time``): a layer timed on a shared machine is otherwise
  charged for whatever ran in between (other processes, the other rank), a
  few ms of preemption on a few-ms op, different for every layer and every
  repeat. The CPU time is what the layer costs; how much wall time that
  becomes under the job's load is the measured baseline's business (a tuner
  scales it with ``tunekit.costmodel.Calibration``). On a GPU, or with
  several threads, the clock is the wall (synchronised) clock. Each result
  says which (``clock``: ``thread_cpu`` or ``wall``).

``profile_layers(model, example_inputs, graph=None, *, device="cpu", warmup=2, repeats=5, threads=None)``
    -> :class:`LayerProfile`. Each layer runs on the real inputs it receives in a
    forward pass of ``example_inputs``. Forward time is the layer's member ops;
    backward time is ``torch.autograd.grad`` of the layer's output with respect
    to its inputs (unless they come straight from the model input) and its
    parameters. Activation memory per layer: on the CPU the bytes of the
    tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``,
    parameters excluded); on CUDA the memory the forward pass leaves allocated
    (``torch.cuda.memory_allocated``) and its peak. Results are JSON-able
    (:meth:`LayerProfile.to_dict` / :meth:`LayerProfile.from_dict`) so the study
    store can cache them by ``(graph hash, hardware fingerprint)``
    (:meth:`LayerProfile.cache_key`).

``time_layer_split(model, graph, layer, split, *, batch_size=None, device="cpu", warmup=2, repeats=5, threads=None)``
    -> :class:`SplitTiming`. The time of ONE worker's share of ``layer`` under a
    DeePa configuration. ``split`` gives one degree per dimension of the layer's
    OUTPUT tensor: a mapping ``{"n": .., "c": .., "h": .., "w": ..}`` (missing
    keys are 1) or a tuple ``(n, c, h, w)``. The worker computes the output slice
    ``ceil(N/n) x ceil(C/c) x ceil(H/h) x ceil(W/w)`` (ceil: the largest worker,
    which the step waits for). What it runs:

    * conv: the input's ``ceil(N/n)`` samples with ALL input channels (grouped
      convs: ``1/c`` of them) and, on a split spatial dim, the output rows plus
      the halo the kernel needs, ``(rows - 1) * stride + dilation * (k - 1) + 1``,
      with no padding on that dim (an interior slice); a conv with ``ceil(C/c)``
      output channels (weights sliced, replicated on h/w splits);
    * linear: ``ceil(N/n)`` samples, all input features, ``ceil(out/c)`` outputs
      (only ``n`` and ``c``; ``h = w = 1``);
    * pool: like conv without weights (channels split as ``C/c``);
    * concat, add and the other elementwise layers: every input sliced the same
      way along (n, c, h, w);
    * rnn and embedding layers: sample splits only.

    Folded members follow the anchor (a batch norm gets ``ceil(C/c)`` features).
    ``batch_size`` rescales dim 0 of the graph's recorded shapes (DeePa times
    AlexNet at 512 images while the graph may be traced at 1). Inputs are random
    tensors of the recorded shapes: the time of these ops does not depend on
    the values. A split a layer cannot take raises :class:`ValueError`.

    For many timings of one model build a :class:`SplitTimer` once and call
    :meth:`SplitTimer.time` per (layer, split).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.node import map_arg
from torch.fx.operator_schemas import normalize_function

from tunekit.observe.graph import ModelGraph, trace_model
from tunekit.runtime.data import to_device

__all__ = [
    "LayerTiming",
    "LayerProfile",
    "SplitTiming",
    "SplitTimer",
    "profile_layers",
    "time_layer_split",
    "parse_split",
    "timing_clock",
]

# -- results -------------------------------------------------------------------------


@dataclass
class LayerTiming:
    """One layer measured standalone."""

    name: str
    kind: str
    forward_s: float
    """Median forward time."""
    backward_s: float
    """Median backward time (gradients of inputs and parameters)."""
    forward_iqr_s: float = 0.0
    backward_iqr_s: float = 0.0
    activation_bytes: int = 0
    """Memory the layer's forward keeps for backward (see ``memory_method``)."""
    peak_bytes: int = 0
    """CUDA only: peak memory above the start of the layer's forward."""
    memory_method: str = "saved_tensors"
    """``saved_tensors`` (autograd's saved tensors, parameters excluded) or ``cuda_memory``."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass
class LayerProfile:
    """Per-layer times of one model at one batch size on one device."""

    graph_hash: str
    device: str
    batch_size: int
    warmup: int
    repeats: int
    layers: dict[str, LayerTiming]
    hardware_fingerprint: str = ""
    torch_threads: int = 0
    clock: str = "wall"
    """``thread_cpu`` (the timing thread's CPU time) or ``wall``; see the module docstring."""

    def cache_key(self) -> str:
        """Key for the study store's cache: graph hash, hardware fingerprint, device."""
        return f"layer_profile:{self.graph_hash}:{self.hardware_fingerprint}:{self.device}"

    @property
    def forward_s(self) -> float:
        return sum(t.forward_s for t in self.layers.values())

    @property
    def backward_s(self) -> float:
        return sum(t.backward_s for t in self.layers.values())

    def top(self, n: int = 10) -> list[LayerTiming]:
        """The ``n`` layers with the largest forward + backward time."""
        return sorted(self.layers.values(), key=lambda t: t.total_s, reverse=True)[:n]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = [asdict(t) for t in self.layers.values()]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerProfile:
        d = dict(d)
        layers = {t["name"]: LayerTiming(**t) for t in d.pop("layers")}
        return cls(layers=layers, **d)


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


# -- timing ------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_iqr(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0] if xs else 0.0), 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


def _tensor_out(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list):
        for v in value:
            t = _tensor_out(v)
            if t is not None:
                return t
    return None


def timing_clock(device: str | torch.device = "cpu") -> tuple[Callable[[], float], str]:
    """The clock layer timings use here, and its name (see the module docstring).

    On the CPU with one intra-op thread: the thread's CPU time, immune to the
    preemption a shared machine adds. Otherwise the wall clock: with several
    threads the work is spread over threads this one does not account for,
    and a GPU's work is not the host thread's.
    """
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time, "thread_cpu"
    return time.perf_counter, "wall"


class _Threads:
    """``with _Threads(n):`` torch's intra-op threads set to ``n`` (None: unchanged), then restored."""

    def __init__(self, threads: int | None):
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        self.threads = threads
        self.before = 0

    def __enter__(self) -> _Threads:
        self.before = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)


def _time_fn(
    forward: Callable[[], Any],
    wrt: list[torch.Tensor],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> tuple[list[float], list[float]]:
    """Forward and backward times of ``forward`` over ``repeats`` runs after ``warmup``,
    on :func:`timing_clock`."""
    clock, _ = timing_clock(device)
    fwd: list[float] = []
    bwd: list[float] = []
    grad_out = None
    # The previous run's output and gradients stay alive through the next run. Freed at
    # once, a lone layer's few large tensors leave the top of the heap empty, the allocator
    # hands it back to the OS, and the next run page-faults it in again (thousands of faults
    # per run for a 512x512x3x3 conv, +50% on its time); in a step, the activations held
    # until backward keep the heap in use.
    held: Any = None
    for i in range(warmup + repeats):
        with torch.set_grad_enabled(bool(wrt)):
            _sync(device)
            t0 = clock()
            out = _tensor_out(forward())
            _sync(device)
            t1 = clock()
        tb = 0.0
        if wrt and out is not None and out.requires_grad:
            if grad_out is None:
                grad_out = torch.ones_like(out)
            t2 = clock()
            grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
            _sync(device)
            tb = clock() - t2
        else:
            grads = None
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(tb)
        held = (out, grads)
        del out, grads
    del held
    return fwd, bwd


def _activation_memory(forward: Callable[[], Any], params: set[int], device: torch.device):
    """(bytes kept for backward, peak bytes, method) of one forward pass."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.enable_grad():
            out = forward()
        torch.cuda.synchronize(device)
        kept = torch.cuda.memory_allocated(device) - before
        peak = torch.cuda.max_memory_allocated(device) - before
        del out
        return max(kept, 0), max(peak, 0), "cuda_memory"
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        if id(t) not in params:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return total, 0, "saved_tensors"


# -- running one layer standalone -------------------------------------------------------------


@dataclass
class _Step:
    """One member op of a layer, ready to run on resolved arguments."""

    name: str
    kind: str  # call_module | call_function | call_method | get_attr
    target: Any  # module, function, method name, or attribute value
    args: Any
    kwargs: dict


class _LayerRunner:
    """Executes layers of a traced model one at a time, on inputs from an environment."""

    def __init__(self, model: nn.Module, graph: ModelGraph, device: torch.device):
        self.model = model
        self.graph = graph
        self.device = device
        self.gm: torch.fx.GraphModule | None = None
        self.fx_nodes: dict[str, torch.fx.Node] = {}
        if graph.method in ("fx", "export"):
            # export: the captured ATen GraphModule (fx cannot trace the model again)
            self.gm = torch.fx.symbolic_trace(model) if graph.method == "fx" else graph.module
            if self.gm is None:
                raise ValueError("an export graph read back from the store cannot run; trace again")
            self.gm.to(device)  # its weights may be its own copies of the model's
            self.fx_nodes = {n.name: n for n in self.gm.graph.nodes}
            missing = set(graph.nodes) - set(self.fx_nodes)
            if missing:
                raise ValueError(
                    f"graph does not match this model (e.g. node {sorted(missing)[0]})"
                )

    # The external inputs of a layer: node names read by members but produced outside.
    def external_inputs(self, layer: str) -> list[str]:
        members = set(self.graph.layers[layer].nodes)
        if self.gm is not None:
            out: list[str] = []
            for m in self.graph.layers[layer].nodes:
                for p in self.fx_nodes[m].all_input_nodes:
                    if self._weight(p):
                        continue  # a step argument itself (see steps)
                    if p.name not in members and p.name not in out:
                        out.append(p.name)
            return out
        first = self.graph.nodes[self.graph.layers[layer].nodes[0]]
        return list(first.inputs)

    def steps(self, layer: str) -> list[_Step]:
        steps = []
        names = self.graph.layers[layer].nodes
        for i, m in enumerate(names):
            if self.gm is None:  # hooks graph: a chain of module calls
                src = self.graph.nodes[m].inputs[0] if i == 0 else names[i - 1]
                mod = self.model.get_submodule(m)
                steps.append(_Step(m, "call_module", mod, (_Ref(src),), {}))
                continue
            n = self.fx_nodes[m]

            def ref(node):
                return _attr(self.gm, node.target) if self._weight(node) else _Ref(node.name)

            args, kwargs = map_arg(n.args, ref), map_arg(n.kwargs, ref)
            if n.op == "call_module":
                target = self.gm.get_submodule(n.target)
            elif n.op == "get_attr":
                target = _attr(self.gm, n.target)
            else:
                target = n.target
            steps.append(_Step(m, n.op, target, args, dict(kwargs)))
        return steps

    def _weight(self, node: torch.fx.Node) -> bool:
        """Export graphs read every weight through ``get_attr``: the graph has no node for
        it, so steps take the parameter itself as an argument."""
        return self.graph.method == "export" and node.op == "get_attr"

    def capture_env(self, example_inputs: tuple) -> dict[str, Any]:
        """Every node's output in one forward pass of ``example_inputs`` (no grad)."""
        env: dict[str, Any] = {}
        with torch.no_grad():
            if self.gm is not None:

                class _Capture(torch.fx.Interpreter):
                    def run_node(self, n):
                        env[n.name] = super().run_node(n)
                        return env[n.name]

                if self.graph.method == "export":  # placeholders are the inputs' leaves
                    from tunekit.observe.graph_export import flat_inputs

                    example_inputs = tuple(flat_inputs(example_inputs))
                _Capture(self.gm).run(*example_inputs)
            else:
                handles = []
                for name in self.graph.nodes:
                    if self.graph.nodes[name].op in ("input", "output"):
                        continue
                    mod = self.model.get_submodule(name)

                    def hook(_m, inp, out, name=name):
                        env.setdefault(f"{name}:in", inp[0] if len(inp) == 1 else inp)
                        env.setdefault(name, out)

                    handles.append(mod.register_forward_hook(hook))
                try:
                    self.model(*example_inputs)
                finally:
                    for h in handles:
                        h.remove()
                src = next(n for n in self.graph.nodes.values() if n.op == "input").name
                env[src] = example_inputs[0] if len(example_inputs) == 1 else example_inputs
                # A chain: each first member reads what its module really received.
                for lay in self.graph.layers.values():
                    first = self.graph.nodes[lay.nodes[0]]
                    if first.op not in ("input", "output") and f"{first.name}:in" in env:
                        env[first.inputs[0]] = env.pop(f"{first.name}:in")
        return env


@dataclass(frozen=True)
class _Ref:
    """A reference to another node's output inside a step's arguments."""

    name: str


def _attr(root: nn.Module, path: str):
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve(value, local: Mapping[str, Any]):
    if isinstance(value, _Ref):
        return local[value.name]
    if isinstance(value, tuple):
        return tuple(_resolve(v, local) for v in value)
    if isinstance(value, list):
        return [_resolve(v, local) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, local) for k, v in value.items()}
    return value


def _run_steps(steps: list[_Step], inputs: Mapping[str, Any]) -> Any:
    local = dict(inputs)
    out = None
    for s in steps:
        args, kwargs = _resolve(s.args, local), _resolve(s.kwargs, local)
        if s.kind == "call_module" or s.kind == "call_function":
            out = s.target(*args, **kwargs)
        elif s.kind == "call_method":
            out = getattr(args[0], s.target)(*args[1:], **kwargs)
        else:
            out = s.target
        local[s.name] = out
    return local


def _layer_params(steps: list[_Step]) -> list[torch.Tensor]:
    params: list[torch.Tensor] = []
    for s in steps:
        if isinstance(s.target, nn.Module):
            params.extend(p for p in s.target.parameters() if p.requires_grad)
        elif isinstance(s.target, nn.Parameter) and s.target.requires_grad:
            params.append(s.target)
        # export graphs pass weights as arguments (a parameter read by two steps counts once)
        for a in [*s.args, *s.kwargs.values()]:
            if isinstance(a, nn.Parameter) and a.requires_grad and all(a is not p for p in params):
                params.append(a)
    return params


def _grad_ready(value, needs_grad: bool):
    """A detached leaf copy of a captured input (requiring grad when backward should reach it)."""
    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        if needs_grad and leaf.is_floating_point():
            leaf.requires_grad_(True)
        return leaf
    if isinstance(value, tuple | list):
        return type(value)(_grad_ready(v, needs_grad) for v in value)
    return value


def _leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, tuple | list):
        return [t for v in value for t in _leaves(v)]
    return []




def _measure(
    runner: _LayerRunner,
    layer: str,
    steps: list[_Step],
    inputs: dict[str, Any],
    warmup: int,
    repeats: int,
    memory: bool,
):
    graph = runner.graph
    lay = graph.layers[layer]
    out_name = _output_member(graph, layer)
    from_model_input = {n for n in inputs if graph.nodes.get(n) and graph.nodes[n].op == "input"}
    leaf_inputs = {k: _grad_ready(v, k not in from_model_input) for k, v in inputs.items()}
    wrt = [t for v in leaf_inputs.values() for t in _leaves(v)] + _layer_params(steps)

    def forward():
        return _run_steps(steps, leaf_inputs)[out_name]

    fwd, bwd = _time_fn(forward, wrt, runner.device, warmup, repeats)
    kept = peak = 0
    method = "cuda_memory" if runner.device.type == "cuda" else "saved_tensors"
    if memory:
        kept, peak, method = _activation_memory(
            forward, {id(p) for p in _layer_params(steps)}, runner.device
        )
    return lay, fwd, bwd, kept, peak, method


def _output_member(graph: ModelGraph, layer: str) -> str:
    members = graph.layers[layer].nodes
    read_outside = {i for n in graph.nodes.values() if n.layer != layer for i in n.inputs}
    for m in reversed(members):
        if m in read_outside and graph.nodes[m].output_shape is not None:
            return m
    for m in reversed(members):
        if graph.nodes[m].output_shape is not None:
            return m
    return members[-1]


# -- profile_layers -------------------------------------------------------------------------------


def profile_layers(
    model: nn.Module,
    example_inputs: Any,
    graph: ModelGraph | None = None,
    *,
    device: str | torch.device = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    layers: Sequence[str] | None = None,
    hardware_fingerprint: str = "",
    threads: int | None = None,
) -> LayerProfile:
    """Time every layer (or ``layers``) of ``model`` standalone; see the module docstring.

    The model is moved to ``device`` and run in training mode, as in a training step.
    ``threads``: torch's intra-op threads while timing, the number one training
    rank gets (None: as set now).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    with _Threads(threads):
        return _profile_layers(
            model, example_inputs, graph, device, warmup, repeats, layers, hardware_fingerprint
        )


def _profile_layers(
    model: nn.Module,
    example_inputs: Any,
    graph: ModelGraph | None,
    device: str | torch.device,
    warmup: int,
    repeats: int,
    layers: Sequence[str] | None,
    hardware_fingerprint: str,
) -> LayerProfile:
    device = torch.device(device)
    args = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    if graph is None or (graph.method == "export" and graph.module is None):
        graph = trace_model(model, args)  # an export graph from the store: capture it again
    model.to(device)
    args = to_device(args, device)
    runner = _LayerRunner(model, graph, device)
    env = runner.capture_env(args)
    model.train()
    timings: dict[str, LayerTiming] = {}
    for name, lay in graph.layers.items():
        if lay.kind in ("input", "output") or (layers is not None and name not in layers):
            continue
        steps = runner.steps(name)
        inputs = {i: env[i] for i in runner.external_inputs(name)}
        _, fwd, bwd, kept, peak, method = _measure(
            runner, name, steps, inputs, warmup, repeats, memory=True
        )
        f, fi = _median_iqr(fwd)
        b, bi = _median_iqr(bwd)
        timings[name] = LayerTiming(name, lay.kind, f, b, fi, bi, kept, peak, method)
    return LayerProfile(
        graph_hash=graph.graph_hash(),
        device=str(device),
        batch_size=graph.batch_size,
        warmup=warmup,
        repeats=repeats,
        layers=timings,
        hardware_fingerprint=hardware_fingerprint,
        torch_threads=torch.get_num_threads(),
        clock=timing_clock(device)[1],
    )


# -- split timing ---------------------------------------------------------------------------------


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
        _Threads(threads)  # refuse a bad count now, not at the first timing
        self.threads = threads
        self.runner = _LayerRunner(self.model, graph, self.device)
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
        with _Threads(self.threads):
            _, fwd, bwd, _, _, _ = _measure(
                self.runner, layer, steps, inputs, self.warmup, self.repeats, memory=False
            )
            clock = timing_clock(self.device)[1]
        out = _run_steps(steps, inputs)[_output_member(self.graph, layer)]
        out_t = _tensor_out(out)
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
            return (out_rows - 1) * s + dil * (k - 1) + 1
        return _ceil_div(in_size, deg)  # adaptive pools, elementwise ops

    # members ------------------------------------------------------------------------------
    def step(self, s: _Step, node) -> _Step:
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
                return _Step(s.name, s.kind, s.target, (), kwargs)
            return s
        if s.kind == "call_method" and s.target in ("view", "reshape") and sp["n"] != self.workers:
            if node.output_shape is None or len(node.output_shape) != 2:
                raise ValueError(
                    f"layer {self.anchor.name!r}: cannot slice a {s.target} to {node.output_shape}"
                )
            return _Step(
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


def _replace(s: _Step, module: nn.Module) -> _Step:
    return _Step(s.name, s.kind, module, s.args, s.kwargs)
