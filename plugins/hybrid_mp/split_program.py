"""The traced model cut into per-device segments: what every rank of a model-parallel
worker walks (:mod:`~tunekit.plugins.hybrid_mp.runtime`) and what the calibrated
model simulates (:mod:`~tunekit.plugins.hybrid_mp.executor_sim`).

Segments are maximal runs of ``torch.fx`` nodes on one device in the planned
execution order (where the placement's schedule has each op: the midpoint of its
interval, so a zero-duration op runs between the ops it sits between, never later).
They are intervals of a topological order, so every rank can walk the same list and
run only its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from tunekit.errors import ConfigError, PluginError

__all__ = ["Segment", "SplitProgram", "build_program"]


@dataclass
class Segment:
    """A run of fx nodes on one model-parallel device."""

    index: int
    device: int
    nodes: list[torch.fx.Node]
    inputs: list[str] = field(default_factory=list)
    """Values (node names) this segment reads from other segments."""
    outputs: list[str] = field(default_factory=list)
    """Values it produces that later segments read."""
    has_loss: bool = False


@dataclass
class SplitProgram:
    """The traced model cut into segments by device, in execution order."""

    gm: torch.fx.GraphModule
    segments: list[Segment]
    mp: int
    producer: dict[str, int]
    """Value -> index of the segment that produces it."""
    consumers: dict[str, list[int]]
    """Value -> indices of the segments that read it (in order)."""
    replicated: list[torch.fx.Node]
    """Placeholders and attribute reads: evaluated on every rank."""
    output_node: torch.fx.Node
    param_devices: dict[int, set[int]]
    """id(parameter) -> model-parallel devices that use it."""
    buffer_devices: dict[int, set[int]]

    @property
    def loss_device(self) -> int:
        return next(s.device for s in self.segments if s.has_loss)

    def describe(self) -> list[dict[str, Any]]:
        """Segments as plain data (for logs and tests)."""
        return [
            {
                "index": s.index,
                "device": s.device,
                "nodes": [n.name for n in s.nodes],
                "inputs": list(s.inputs),
                "outputs": list(s.outputs),
            }
            for s in self.segments
        ]


def build_program(
    model: nn.Module,
    node_device: Mapping[str, int],
    order: Mapping[str, float] | None = None,
    mp: int | None = None,
) -> SplitProgram:
    """Trace ``model`` and cut it into per-device segments.

    ``node_device`` maps fx node names to model-parallel device indices
    (nodes it leaves out run where their first input runs); ``order`` maps
    node names to their planned place in time (``placement_nodes`` gives the
    midpoint of each op's scheduled interval), which leads the execution order
    among nodes whose inputs are ready: each device then runs its nodes in the
    schedule's order for that device.
    """
    gm = _symbolic_trace(model)
    nodes = list(gm.graph.nodes)
    replicated = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    rep = set(replicated)
    output_node = next(n for n in nodes if n.op == "output")
    mp = mp or (max(node_device.values(), default=0) + 1)
    device = _node_devices(nodes, rep, node_device, mp)
    ordered = _execution_order(nodes, rep, order or {})
    segments = _cut_segments(ordered, device, output_node)
    producer, consumers = _connect_segments(segments, rep)
    param_devices, buffer_devices = _state_devices(gm, ordered, device)
    return SplitProgram(
        gm=gm,
        segments=segments,
        mp=mp,
        producer=producer,
        consumers=consumers,
        replicated=replicated,
        output_node=output_node,
        param_devices=param_devices,
        buffer_devices=buffer_devices,
    )


def _symbolic_trace(model: nn.Module) -> torch.fx.GraphModule:
    try:
        return torch.fx.symbolic_trace(model)
    except Exception as exc:
        raise PluginError(
            f"hybrid_mp: torch.fx cannot trace {type(model).__name__} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); model parallelism needs a traceable model"
        ) from exc


def _node_devices(
    nodes: list[torch.fx.Node],
    rep: set[torch.fx.Node],
    node_device: Mapping[str, int],
    mp: int,
) -> dict[torch.fx.Node, int]:
    """Each computing node's device: as placed, else its first computed input's (else 0)."""
    device: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if n in rep:
            continue
        if n.name in node_device:
            device[n] = int(node_device[n.name])
        else:
            producers = [a for a in n.all_input_nodes if a not in rep]
            device[n] = device[producers[0]] if producers else 0
        if not 0 <= device[n] < mp:
            raise ConfigError(
                f"hybrid_mp: node {n.name} placed on device {device[n]}, outside 0..{mp - 1}"
            )
    return device


def _execution_order(
    nodes: list[torch.fx.Node], rep: set[torch.fx.Node], order: Mapping[str, float]
) -> list[torch.fx.Node]:
    """The computing nodes in execution order: Kahn's algorithm led by the planned times
    (ties by fx position); a node without one inherits the latest of its inputs'."""
    fx_pos = {n: i for i, n in enumerate(nodes)}
    prio: dict[torch.fx.Node, float] = {}
    for n in nodes:
        inherited = max((prio[a] for a in n.all_input_nodes if a in prio), default=0.0)
        prio[n] = float(order[n.name]) if n.name in order else inherited
    pending = {n: sum(1 for a in n.all_input_nodes if a not in rep) for n in nodes if n not in rep}
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for a in n.all_input_nodes:
            users[a].append(n)
    ready = [(prio[n], fx_pos[n]) for n, k in pending.items() if k == 0]
    heapq.heapify(ready)
    ordered: list[torch.fx.Node] = []
    while ready:
        _, pos = heapq.heappop(ready)
        n = nodes[pos]
        ordered.append(n)
        for u in users[n]:
            if u in pending:
                pending[u] -= 1
                if pending[u] == 0:
                    heapq.heappush(ready, (prio[u], fx_pos[u]))
    return ordered


def _cut_segments(
    ordered: list[torch.fx.Node], device: Mapping[torch.fx.Node, int], output_node: torch.fx.Node
) -> list[Segment]:
    """Maximal runs of consecutive nodes on one device; the output node belongs with
    whatever produces the model's output, and marks its segment as the loss's."""
    segments: list[Segment] = []
    for n in ordered:
        if not segments or segments[-1].device != device[n]:
            segments.append(Segment(len(segments), device[n], []))
        segments[-1].nodes.append(n)
        if n is output_node:
            segments[-1].has_loss = True
    return segments


def _connect_segments(
    segments: list[Segment], rep: set[torch.fx.Node]
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Fill each segment's inputs and outputs (values crossing segments); returns each
    such value's producing segment and its consuming segments in order."""
    seg_of = {n: s.index for s in segments for n in s.nodes}
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for s in segments:
        for n in s.nodes:
            for a in n.all_input_nodes:
                if a in rep or seg_of[a] == s.index:
                    continue
                if a.name not in s.inputs:
                    s.inputs.append(a.name)
                    consumers.setdefault(a.name, []).append(s.index)
                    producer[a.name] = seg_of[a]
                    src = segments[seg_of[a]]
                    if a.name not in src.outputs:
                        src.outputs.append(a.name)
    return producer, consumers


def _state_devices(
    gm: torch.fx.GraphModule, ordered: list[torch.fx.Node], device: Mapping[torch.fx.Node, int]
) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Who uses which parameters and buffers, by id (a module called on two devices
    shares them)."""
    modules = dict(gm.named_modules())
    param_devices: dict[int, set[int]] = {}
    buffer_devices: dict[int, set[int]] = {}
    for n in ordered:
        owned: list[torch.Tensor] = []
        bufs: list[torch.Tensor] = []
        if n.op == "call_module":
            owned = list(modules[n.target].parameters())
            bufs = list(modules[n.target].buffers())
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                attr = _attr(gm, str(a.target))
                if isinstance(attr, nn.Parameter):
                    owned.append(attr)
                elif isinstance(attr, torch.Tensor):
                    bufs.append(attr)
        for p in owned:
            param_devices.setdefault(id(p), set()).add(device[n])
        for b in bufs:
            buffer_devices.setdefault(id(b), set()).add(device[n])
    return param_devices, buffer_devices


def _attr(root: nn.Module, path: str):
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
