"""DLPlacer's inputs from a traced model: Δ(k), M(k), D(e); and the rendering of results."""

from __future__ import annotations

import json

import pytest

from tunekit.costmodel import BACKWARD_FLOPS_RATIO
from tunekit.errors import ConfigError
from tunekit.hardware import load_profile
from tunekit.observe.graph import trace_model
from tunekit.plugins.hybrid_mp.decompose import cut_ops
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import (
    EpochTable,
    OpGraph,
    decide,
    op_graph_from_model,
    optimizer_state_factor,
)
from tunekit.plugins.hybrid_mp.render import (
    format_decision_table,
    format_gantt,
    format_placement_table,
    format_summary,
    placement_rows,
    save_gantt_png,
)
from tunekit.plugins.hybrid_mp.schedule import Placement, check_schedule
from tunekit.plugins.hybrid_mp.search import PlacerOptions, place
from tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp import branchy


@pytest.fixture(scope="module")
def graph():
    w = branchy()
    x, _ = w.example_batch(2)
    return trace_model(w.model(), x, batch_size=8)


def test_analytic_op_graph_follows_the_layers(graph):
    og = op_graph_from_model(graph, peak_flops=1e12, batch_size=16)
    layers = {n: lay for n, lay in graph.layers.items() if lay.kind not in ("input", "output")}
    assert [op.name for op in og.ops] == list(layers)
    conv = next(op for op in og.ops if op.kind == "conv")
    lay = graph.layers[conv.name]
    # FLOPs scale with the batch (8 -> 16); backward is twice forward
    assert conv.forward_s == pytest.approx(lay.flops * 2 / 1e12)
    assert conv.backward_s == pytest.approx(BACKWARD_FLOPS_RATIO * conv.forward_s)
    assert conv.memory_bytes == pytest.approx(lay.param_bytes * 3 + lay.activation_bytes * 2)
    edge = og.edges[0]
    assert edge.nbytes == pytest.approx(graph.layers[edge.src].activation_bytes * 2)
    # the four towers join at concats: Inception-like cut ops exist
    assert [og.op(c).kind for c in cut_ops(og)].count("concat") == 2
    assert og.training and og.serial_time() == pytest.approx(
        sum(o.forward_s + o.backward_s for o in og.ops)
    )


def test_measured_times_override_the_analytic_ones(graph):
    names = [n for n, lay in graph.layers.items() if lay.kind not in ("input", "output")]
    measured = {n: (0.001, 0.003) for n in names}
    og = op_graph_from_model(graph, measured=measured)
    assert all(op.forward_s == 0.001 and op.backward_s == 0.003 for op in og.ops)
    fwd_only = op_graph_from_model(graph, measured=measured, training=False)
    assert not fwd_only.training and fwd_only.serial_time() == pytest.approx(0.001 * len(names))
    with pytest.raises(ConfigError, match="peak"):
        op_graph_from_model(graph)
    with pytest.raises(ConfigError, match="efficiency"):
        op_graph_from_model(graph, peak_flops=1e12, efficiency=0)


def test_optimizer_state_factor():
    assert optimizer_state_factor("SGD") == 1
    assert optimizer_state_factor("AdamW") == 2


def test_op_graph_validation():
    with pytest.raises(ConfigError, match="topological"):
        OpGraph.from_dict(
            {
                "ops": [{"name": "a", "forward_s": 1}, {"name": "b", "forward_s": 1}],
                "edges": [{"src": "b", "dst": "a", "nbytes": 1}],
            }
        )
    with pytest.raises(ConfigError, match="unknown op"):
        OpGraph.from_dict(
            {
                "ops": [{"name": "a", "forward_s": 1}],
                "edges": [{"src": "a", "dst": "z", "nbytes": 1}],
            }
        )


def test_placement_round_trips_and_renders(graph, tmp_path):
    og = op_graph_from_model(graph, peak_flops=15.7e12 * 0.05, batch_size=64)
    hw = HardwareGraph.from_hardware(load_profile("dgx1-v100x4"), 2)
    p = place(og, hw, PlacerOptions(time_limit_s=30))
    check_schedule(og, hw, p)
    data = json.loads(json.dumps(p.to_dict()))  # JSON-able, for Candidate.details
    again = Placement.from_dict(data)
    assert again.assignment == p.assignment and again.makespan == p.makespan
    rows = placement_rows(data)
    assert {r["op"] for r in rows} == {op.name for op in og.ops}
    assert all(r["bwd_start_s"] >= r["fwd_end_s"] for r in rows)
    table = format_placement_table(data, max_rows=5)
    assert "fwd start" in table and "more" in table
    gantt = format_gantt(p, width=60)
    lines = gantt.splitlines()
    assert lines[0].startswith("gpu0 |") and len(lines[0]) == len("gpu0 |") + 61
    assert "A=" in lines[-1]
    assert "SU^2" in format_summary(data)
    png = save_gantt_png(data, tmp_path / "gantt.png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_decision_table_marks_the_best():
    d = decide(256, {2: 1.32}, EpochTable({32: 4, 64: 7, 128: 12, 256: 23}))
    text = format_decision_table(d.to_dict())
    assert "<- best" in text and "128" in text
    assert text.splitlines()[-1].startswith("best over the best DP-only scale")
