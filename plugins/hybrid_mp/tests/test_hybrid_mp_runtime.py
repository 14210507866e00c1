"""The executor: a placement split into per-device segments, trained on real gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from tunekit.observe.graph import trace_model
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import op_graph_from_model
from tunekit.plugins.hybrid_mp.placement_codec import nodes_of
from tunekit.plugins.hybrid_mp.runtime import mesh_coords
from tunekit.plugins.hybrid_mp.schedule import check_schedule, device_order_key
from tunekit.plugins.hybrid_mp.search import PlacerOptions, place
from tunekit.plugins.hybrid_mp.split_program import build_program
from tunekit.plugins.hybrid_mp.tests.ranks_hybrid_mp import hybrid_rank, reference_run
from tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp import Branchy, branchy
from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close, default_dtype, run_ranks

BRANCHY = "tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp:branchy"
PLAIN = "tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp:branchy_plain"


def towers_on_device_1(model) -> dict[str, int]:
    """Towers b2 and b4 of every block on device 1, everything else on device 0."""
    w = branchy()
    x, _ = w.example_batch(2)
    g = trace_model(model, x)
    return {
        name: int(any(f".{t}" in node.target for t in ("b2", "b4")))
        for name, node in g.nodes.items()
        if node.layer and node.op not in ("input", "output")
    }


# The equivalence tests run in float64: a split model sums gradients in another
# order than one process, which float32 cannot bound tightly on every CPU.
F64 = torch.float64


def reference(spec: str, *args, **kwargs) -> dict:
    with default_dtype(F64):
        return reference_run(spec, *args, **kwargs)


def test_segments_alternate_devices_along_the_planned_order():
    model = Branchy(width=16, blocks=1)
    placement = towers_on_device_1(model)
    prog = build_program(model, placement, mp=2)
    devices = [s.device for s in prog.segments]
    assert all(a != b for a, b in zip(devices, devices[1:], strict=False))
    assert prog.segments[-1].has_loss and prog.loss_device == 0
    # every value read across segments is produced exactly once and declared on both ends
    for value, consumers in prog.consumers.items():
        src = prog.segments[prog.producer[value]]
        assert value in src.outputs
        assert all(value in prog.segments[c].inputs for c in consumers)
    # tower parameters live on device 1 only, the stem's on device 0
    by_id = {id(p): n for n, p in model.named_parameters()}
    owners = {by_id[i]: d for i, d in prog.param_devices.items()}
    assert owners["blocks.0.b2.0.0.weight"] == {1} and owners["stem.0.weight"] == {0}
    # a planned order leads: start the pool tower first
    first = {n: (0.0 if ".b4" in n or "b4" in n else 1.0) for n in placement}
    prog2 = build_program(model, placement, order=first, mp=2)
    assert prog2.segments[0].device == 0 and any("b4" in n.name for n in prog2.segments[1].nodes)


def test_each_device_runs_its_ops_in_the_schedules_order():
    # Analytic Δ: the towers' pooling and the concatenations take no time. The plan puts
    # the pool tower's zero-duration pool where another op starts on its device; the
    # executor must run it first (its consumer waits on another device), not after.
    model = Branchy(width=64, blocks=1)
    x, _ = branchy().example_batch(2)
    graph = trace_model(model, x, batch_size=16)
    og = op_graph_from_model(graph, peak_flops=1e10, batch_size=16)
    hw = HardwareGraph.of({"d0": 1e12, "d1": 1e12}, [("d0", "d1", 1e9, 1e-5)])
    p = place(og, hw, PlacerOptions(time_limit_s=30))
    check_schedule(og, hw, p, tol=1e-9)
    assert p.devices_used == 2
    forward = [t for t in p.schedule if t.phase == "fwd"]
    zero = [t for t in forward if t.end == t.start]
    assert {og.op(t.op).kind for t in zero} == {"pool", "concat"}
    assert any(
        z.device == t.device and z.start == t.start and t.end > t.start
        for z in zero
        for t in forward
    ), "no zero-duration op shares its start with another op: the tie this test is about"
    plan = nodes_of(graph, p)
    program = build_program(model, plan["node_device"], plan["order"], mp=2)
    topo = {op.name: k for k, op in enumerate(og.ops)}  # ties of zero-length ops: any order
    for i, dev in enumerate(p.devices):
        planned = sorted(
            (t for t in forward if t.device == dev),
            key=lambda t: (device_order_key(t.start, t.end), topo[t.op]),
        )
        assert layers_run_on(program, graph, i, set(topo)) == [t.op for t in planned]


def layers_run_on(program, graph, device: int, layers: set[str]) -> list[str]:
    """Which of ``layers`` one device's segments run, in program order."""
    out: list[str] = []
    for seg in program.segments:
        if seg.device != device:
            continue
        for node in seg.nodes:
            layer = graph.nodes[node.name].layer if node.name in graph.nodes else None
            if layer in layers and (not out or out[-1] != layer):
                out.append(layer)
    return out


def test_mesh_coordinates():
    assert [mesh_coords(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def tower_placement_knob() -> str:
    """The same placement at layer level, as the tuner's ``placement`` knob carries it."""
    w = branchy()
    x, _ = w.example_batch(2)
    g = trace_model(w.model(), x)
    devices = {
        name: int(any(f".{t}" in g.nodes[lay.nodes[0]].target for t in ("b2", "b4")))
        for name, lay in g.layers.items()
        if lay.kind not in ("input", "output")
    }
    return json.dumps({"devices": devices})


@pytest.mark.slow
@pytest.mark.equivalence
def test_two_rank_model_parallel_trains_like_one_process():
    steps = 3
    # one replica of a 2-device worker: global batch B, batch norm included; the
    # placement goes in as the tuner's placement knob, through HybridMp.apply
    knobs = {"placement": tower_placement_knob()}
    ranks = run_ranks(hybrid_rank, 2, args=(BRANCHY, steps, 2, None, knobs), dtype=F64)
    ref = reference(BRANCHY, steps, 1, ranks[0]["lr"])
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=EQUIVALENCE_RTOL)
        assert_states_close(r["state"], ref["state"], "parameters and batch-norm buffers")
        assert_states_close(
            r["optimizer"]["state"][0], ref["optimizer"]["state"][0], "momentum of param 0"
        )
    # both ranks really held a share: the towers went to rank 1 and came back
    assert {s["device"] for s in ranks[0]["segments"]} == {0, 1}
    assert sum(ranks[1]["comm_bytes"]) > 0


@pytest.mark.slow
@pytest.mark.equivalence
def test_two_by_two_mesh_planned_by_the_tuner_trains_like_one_process_then_rolls_back():
    # 2 data-parallel replicas of 2-device workers (global batch 2 x B, learning rate / 2),
    # then a reset to plain DDP on 4 ranks (global batch 4 x B) for one step: the owners'
    # parameters and momentum must have reached every rank
    steps = 2
    knobs = {"time_limit_s": 20.0}
    ranks = run_ranks(hybrid_rank, 4, args=(PLAIN, steps, 2, None, knobs, None, 1), dtype=F64)
    ref = reference(PLAIN, steps, 2, ranks[0]["lr"], then=(1, 4, branchy().lr))
    assert ranks[0]["lr"] == pytest.approx(branchy().lr / 2)
    for r in ranks:
        # the hybrid reports the global batch's loss (DDP, afterwards, each rank's own shard's)
        assert r["losses"][:steps] == pytest.approx(ref["losses"][:steps], rel=EQUIVALENCE_RTOL)
        assert_states_close(r["state"], ref["state"], "parameters")


@pytest.mark.slow
@pytest.mark.equivalence
def test_values_consumed_out_of_send_order_still_match():
    from tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp import ORDER, PLACEMENT

    spec = "tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp:crossing"
    plan = {"node_device": PLACEMENT, "order": ORDER}
    ranks = run_ranks(hybrid_rank, 2, args=(spec, 3, 2, plan), dtype=F64)
    # device 0 sends a (l1) before b (l2); device 1 reads b first
    segs = ranks[1]["segments"]
    assert [s["device"] for s in segs] == [0, 1, 0, 1]
    assert segs[3]["inputs"] == ["l2", "l1", "l0"]  # l0 is its own device's
    ref = reference(spec, 3, 1, ranks[0]["lr"])
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=EQUIVALENCE_RTOL)
        assert_states_close(r["state"], ref["state"], "parameters")


@pytest.mark.slow
@pytest.mark.equivalence
def test_transformer_blocks_in_two_stages_train_like_one_process():
    # the worker's own stage plan (placer "pipeline") on a toy GPT: whole blocks per device,
    # the embeddings on device 0 and the head on device 1
    spec = "tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp:plain_gpt"
    ranks = run_ranks(hybrid_rank, 2, args=(spec, 3, 2, None, {"placer": "pipeline"}), dtype=F64)
    ref = reference(spec, 3, 1, ranks[0]["lr"])
    for r in ranks:
        assert r["losses"] == pytest.approx(ref["losses"], rel=EQUIVALENCE_RTOL)
        assert_states_close(r["state"], ref["state"], "parameters")
    first, second = ranks[0]["segments"]  # one stage each, in order
    assert (first["device"], second["device"]) == (0, 1)
    assert first["nodes"][-1] == "add_2" and second["nodes"][0] == "blocks_1_ln1"  # block 0 | 1
    assert sum(ranks[0]["comm_bytes"]) > 0
