"""Where hybrid_mp's placements come from: DLPlacer's ILP (cached per job), its list
schedule, contiguous stages; and, in a worker without a planned placement, the placement
it computes for itself."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from tunekit.api import Observation, Session, describe_local_machine
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.inputs import model_graph, op_units, session_graph
from tunekit.plugins.hybrid_mp.model import OpGraph, op_graph_from_model
from tunekit.plugins.hybrid_mp.options import HybridOptions
from tunekit.plugins.hybrid_mp.placement_codec import nodes_of
from tunekit.plugins.hybrid_mp.schedule import Placement, improve, list_schedule
from tunekit.plugins.hybrid_mp.search import PlacerOptions, pipeline_placement, place


def solve_placement(og: OpGraph, obs: Observation, m: int, opts: HybridOptions) -> Placement:
    """DLPlacer on the first ``m`` devices; cached in the study store when there is one."""
    hw = HardwareGraph.from_hardware(obs.hardware, m)
    digest = hashlib.sha256(
        json.dumps(
            [og.to_dict(), hw.devices, hw.memory, [a.__dict__ for a in hw.arcs]], sort_keys=True
        ).encode()
    ).hexdigest()[:20]
    return obs.cached(
        f"hybrid_mp:placement:{digest}:{opts.gap}",
        lambda: place(og, hw, PlacerOptions(time_limit_s=opts.time_limit_s, gap=opts.gap)),
        encode=Placement.to_dict,
        decode=Placement.from_dict,
    )


def quick_placement(og: OpGraph, obs: Observation, m: int) -> Placement:
    """A fast placement for the diagnosis: list scheduling (DLPlacer's starting point)."""
    hw = HardwareGraph.from_hardware(obs.hardware, m)
    quick = list_schedule(og, hw)
    return quick if quick is not None else solve_placement(og, obs, m, HybridOptions.of(obs))


def stage_placement(
    og: OpGraph, obs: Observation, m: int, units: Mapping[str, str] | None
) -> Placement:
    """Contiguous stages on ``m`` devices, cut between the ``units``
    (:func:`~tunekit.plugins.hybrid_mp.inputs.op_units`: the transformer blocks) where the
    model has them: what model parallelism can do with a chain."""
    return pipeline_placement(og, HardwareGraph.from_hardware(obs.hardware, m), units)


def alternatives(og: OpGraph, obs: Observation, m: int, best: Placement) -> list[Placement]:
    """DLPlacer's placement, then the list schedule it starts from and contiguous stages
    (the paper's comparison with a placement by hand), where they differ from it."""
    hw = HardwareGraph.from_hardware(obs.hardware, m)
    found = [best]
    start = list_schedule(og, hw)
    if start is not None:
        found.append(improve(og, hw, start))
    try:
        found.append(stage_placement(og, obs, m, op_units(og, model_graph(obs))))
    except ConfigError:
        pass  # the stages do not fit: DLPlacer's placement is the only one
    out: list[Placement] = []
    for p in found:
        if p.devices_used > 1 and all(p.assignment != q.assignment for q in out):
            out.append(p)
    return out


def worker_plan(session: Session, m: int, placer: str, time_limit_s: float) -> dict[str, Any]:
    """The placement a worker computes for itself: traced model, this machine's devices.

    Returns plain data every rank can use: fx node -> model-parallel index,
    and each node's place in the planned execution order.
    """
    graph = session_graph(session)
    hw = describe_local_machine(m, session.device.type)
    og = op_graph_from_model(
        graph, peak_flops=hw.devices[0].peak_flops, batch_size=session.batch_size
    )
    hwg = HardwareGraph.from_hardware(hw, m)
    if placer == "pipeline":
        p = pipeline_placement(og, hwg, op_units(og, graph))
    else:
        p = place(og, hwg, PlacerOptions(time_limit_s=time_limit_s))
    return nodes_of(graph, p)
