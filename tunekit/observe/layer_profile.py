"""Measured forward and backward time of every layer, each run standalone.

Entry points running the layers of a :class:`~tunekit.observe.graph.ModelGraph`
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

``LayerRunner``, ``measure_layer``
    run and time one layer standalone on inputs a caller chooses, through its
    member ops or replacements of them (layer_split times one worker's slice
    of a layer this way: ``tunekit.plugins.layer_split.measure``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.node import map_arg

from tunekit.observe.graph import ModelGraph, layer_output, model_args, trace_model
from tunekit.observe.step_timing import intra_op_threads
from tunekit.runtime.data import to_device

__all__ = [
    "LayerProfile",
    "LayerRunner",
    "LayerStep",
    "LayerTiming",
    "measure_layer",
    "output_member",
    "profile_layers",
    "run_steps",
    "tensor_out",
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


# -- timing ------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_iqr(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return (xs[0] if xs else 0.0), 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[2] - q[0]


def tensor_out(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple | list):
        for v in value:
            t = tensor_out(v)
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
            out = tensor_out(forward())
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


def _activation_memory(
    forward: Callable[[], Any], params: set[int], device: torch.device
) -> tuple[int, int, str]:
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
class LayerStep:
    """One member op of a layer, ready to run on resolved arguments."""

    name: str
    kind: str  # call_module | call_function | call_method | get_attr
    target: Any  # module, function, method name, or attribute value
    args: Any
    kwargs: dict


class LayerRunner:
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

    def steps(self, layer: str) -> list[LayerStep]:
        steps = []
        names = self.graph.layers[layer].nodes
        for i, m in enumerate(names):
            if self.gm is None:  # hooks graph: a chain of module calls
                src = self.graph.nodes[m].inputs[0] if i == 0 else names[i - 1]
                mod = self.model.get_submodule(m)
                steps.append(LayerStep(m, "call_module", mod, (_Ref(src),), {}))
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
            steps.append(LayerStep(m, n.op, target, args, dict(kwargs)))
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


def run_steps(steps: list[LayerStep], inputs: Mapping[str, Any]) -> Any:
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


def _layer_params(steps: list[LayerStep]) -> list[torch.Tensor]:
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


def measure_layer(
    runner: LayerRunner,
    layer: str,
    steps: list[LayerStep],
    inputs: dict[str, Any],
    warmup: int,
    repeats: int,
    memory: bool = False,
) -> tuple[Any, list[float], list[float], int, int, str]:
    """Time ``layer`` run standalone through ``steps`` (its member ops, as
    :meth:`LayerRunner.steps` gives them or changed by the caller) on ``inputs``.

    Returns the graph's layer, the forward and backward times of each repeat,
    and, with ``memory``, the activation bytes kept and peak and how they were
    measured. A tuner that times layers its own way (a worker's slice of one)
    passes its own steps and inputs."""
    graph = runner.graph
    lay = graph.layers[layer]
    out_name = output_member(graph, layer)
    from_model_input = {n for n in inputs if graph.nodes.get(n) and graph.nodes[n].op == "input"}
    leaf_inputs = {k: _grad_ready(v, k not in from_model_input) for k, v in inputs.items()}
    wrt = [t for v in leaf_inputs.values() for t in _leaves(v)] + _layer_params(steps)

    def forward():
        return run_steps(steps, leaf_inputs)[out_name]

    fwd, bwd = _time_fn(forward, wrt, runner.device, warmup, repeats)
    kept = peak = 0
    method = "cuda_memory" if runner.device.type == "cuda" else "saved_tensors"
    if memory:
        kept, peak, method = _activation_memory(
            forward, {id(p) for p in _layer_params(steps)}, runner.device
        )
    return lay, fwd, bwd, kept, peak, method


def output_member(graph: ModelGraph, layer: str) -> str:
    """The member op whose value is the layer's output (what the next layer reads)."""
    members = [graph.nodes[m] for m in graph.layers[layer].nodes]
    return layer_output(members, layer, graph.nodes).name


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
    with intra_op_threads(threads):
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
    if graph is None or (graph.method == "export" and graph.module is None):
        # an export graph from the store: capture it again
        graph = trace_model(model, example_inputs)
    model.to(device)
    args = model_args(to_device(example_inputs, device))
    runner = LayerRunner(model, graph, device)
    env = runner.capture_env(args)
    model.train()
    timings: dict[str, LayerTiming] = {}
    for name, lay in graph.layers.items():
        if lay.kind in ("input", "output") or (layers is not None and name not in layers):
            continue
        steps = runner.steps(name)
        inputs = {i: env[i] for i in runner.external_inputs(name)}
        _, fwd, bwd, kept, peak, method = measure_layer(
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
