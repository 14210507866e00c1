"""The ``placement`` knob: a planned placement as JSON text and back, checked, and mapped
onto a model's fx nodes (each node's model-parallel index and place in the run order)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.schedule import Placement, device_order_key


def encode_placement(placement: Placement) -> str:
    """A planned placement as the ``placement`` knob's JSON text.

    ``{"devices": {layer: model-parallel index}, "start": {layer: planned start, s},
    "end": {layer: planned end, s}}``: plain data that survives the config file and the
    trip to every worker. Start and end together fix each device's run order, also
    where a zero-duration layer starts when another does.
    """
    index = {d: i for i, d in enumerate(placement.devices)}
    forward = {t.op: t for t in placement.schedule if t.phase == "fwd"}
    devices, start, end = {}, {}, {}
    for op, layers in placement.members.items():
        for layer in layers:
            devices[layer] = index[placement.assignment[op]]
            start[layer] = round(forward[op].start, 12)
            end[layer] = round(forward[op].end, 12)
    return json.dumps({"devices": devices, "start": start, "end": end}, separators=(",", ":"))


def decode_placement(text: str) -> dict[str, dict[str, Any]]:
    """The ``placement`` knob's JSON, checked; empty text means "let the worker plan"."""
    if not text.strip():
        return {"devices": {}, "start": {}, "end": {}}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"placement is not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        raise ConfigError(
            'placement must be a JSON object {"devices": {layer: index}, "start": {...}}'
        )
    devices = data["devices"]
    for layer, idx in devices.items():
        if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
            raise ConfigError(f"placement: layer {layer!r} needs a device index >= 0, not {idx!r}")
    times = {key: data.get(key, {}) for key in ("start", "end")}
    for key, values in times.items():
        if not isinstance(values, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values.values()
        ):
            raise ConfigError(f"placement: {key} must map layers to numbers")
    return {"devices": devices, **times}


def check_placement(text: str) -> None:
    """The ``placement`` knob's parse check: raises ConfigError where it does not decode."""
    decode_placement(text)


def placement_nodes(graph, given: Mapping[str, Mapping[str, Any]], m: int) -> dict[str, Any]:
    """The ``placement`` knob's layers mapped onto this model's fx nodes: each node's
    model-parallel index, and its place in the planned order (the midpoint of its layer's
    planned interval, so a zero-duration layer runs when the schedule has it)."""
    devices, start, end = given["devices"], given["start"], given.get("end", {})
    unknown = sorted(set(devices) - set(graph.layers))
    if unknown:
        raise ConfigError(
            f"hybrid_mp.placement names layer {unknown[0]!r}, which this model does not have"
        )
    too_big = [layer for layer, i in devices.items() if i >= m]
    if too_big:
        raise ConfigError(
            f"hybrid_mp.placement puts {too_big[0]!r} on device {devices[too_big[0]]}, "
            f"but mp_degree={m}"
        )
    node_device, order = {}, {}
    for name, node in graph.nodes.items():
        if node.layer in devices:
            node_device[name] = int(devices[node.layer])
            if node.layer in start:
                begin = float(start[node.layer])
                order[name] = device_order_key(begin, float(end.get(node.layer, begin)))
    return {"node_device": node_device, "order": order}


def nodes_of(graph, placement: Placement) -> dict[str, Any]:
    """Per fx node: the model-parallel index and the planned start of its layer's op."""
    given = decode_placement(encode_placement(placement))
    return placement_nodes(graph, given, len(placement.devices))
