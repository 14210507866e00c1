"""DLPlacer's ILP on the small placement cases of NOTES.md §2, with their exact makespans."""

from __future__ import annotations

import itertools
import random

import pytest

from tunekit.errors import ConfigError
from tunekit.hardware import load_profile
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import Edge, Op, OpGraph
from tunekit.plugins.hybrid_mp.schedule import check_schedule, list_schedule
from tunekit.plugins.hybrid_mp.search import (
    PlacerOptions,
    coarsen,
    cut_ops,
    pipeline_placement,
    place,
    speedup_bound,
)

GB = 1e9

# Exact: gap 0. "whole" is the monolithic ILP without the list-scheduling bound, so the
# ILP alone must find the optimum; "blocks" is the default decomposition.
WHOLE = PlacerOptions(gap=0.0, decompose=False, heuristic_bound=False)
BLOCKS = PlacerOptions(gap=0.0)
VARIANTS = [WHOLE, BLOCKS]


def graph(ops, edges, nbytes=1.0, training=False) -> OpGraph:
    return OpGraph([Op(n, t) for n, t in ops], [Edge(a, b, nbytes) for a, b in edges], training)


def linked(n: int, c: float, mem: float = 16 * GB) -> HardwareGraph:
    """n devices, every pair linked, one byte costs ``c`` per hop."""
    devs = {f"g{i}": mem for i in range(n)}
    return HardwareGraph.of(
        devs, [(f"g{a}", f"g{b}", 1 / c, 0.0) for a, b in itertools.combinations(range(n), 2)]
    )


def solve(og: OpGraph, hw: HardwareGraph, opts: PlacerOptions):
    p = place(og, hw, opts)
    check_schedule(og, hw, p)
    return p


DIAMOND = graph(
    [("A", 1), ("B", 4), ("C", 4), ("D", 1)], [("A", "B"), ("A", "C"), ("B", "D"), ("C", "D")]
)
INCEPTION = graph(
    [("X", 1), ("b1", 3), ("b2", 2), ("b3", 2), ("b4", 1), ("Y", 1)],
    [("X", b) for b in ("b1", "b2", "b3", "b4")] + [(b, "Y") for b in ("b1", "b2", "b3", "b4")],
    nbytes=0.25,
)


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
@pytest.mark.parametrize(("c", "expected"), [(0.5, 6.5), (1, 7), (2, 8), (3, 9)])
def test_diamond_on_two_linked_gpus(c, expected, opts):
    # min(10, 6 + c): B and C split, D waits for one transfer
    p = solve(DIAMOND, linked(2, c), opts)
    assert p.makespan == pytest.approx(expected, abs=1e-6)
    assert p.status == "optimal"
    if expected < 10:
        assert p.assignment["B"] != p.assignment["C"]


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_chain_gains_nothing(n, opts):
    og = graph([("A", 2), ("B", 3), ("C", 1)], [("A", "B"), ("B", "C")])
    p = solve(og, linked(n, 1.0), opts)
    assert p.makespan == pytest.approx(6.0)
    assert p.speedup == pytest.approx(1.0)


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
@pytest.mark.parametrize(("n", "expected"), [(2, 6), (3, 5)])
def test_independent_ops(n, expected, opts):
    og = graph([("a", 3), ("b", 3), ("c", 2), ("d", 2), ("e", 2)], [])
    assert solve(og, linked(n, 1.0), opts).makespan == pytest.approx(expected)


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
@pytest.mark.parametrize(("c", "expected"), [(0.25, 6.5), (0.5, 7), (1, 8), (2, 10), (3, 10)])
def test_diamond_through_a_switch(c, expected, opts):
    # GPU - switch - GPU: two hops of c each, min(10, 6 + 2c)
    hw = HardwareGraph.of(
        {"g0": 16 * GB, "g1": 16 * GB}, [("g0", "sw", 1 / c, 0), ("g1", "sw", 1 / c, 0)], ["sw"]
    )
    p = solve(DIAMOND, hw, opts)
    assert p.makespan == pytest.approx(expected, abs=1e-6)
    if expected < 10:
        assert p.routes and all(
            r == ["g0", "sw", "g1"] or r == ["g1", "sw", "g0"] for r in p.routes.values()
        )


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
def test_memory_forces_a_split(opts):
    og = OpGraph(
        [Op("A", 2, memory_bytes=10 * GB), Op("B", 3, memory_bytes=10 * GB)], [Edge("A", "B", 1.0)]
    )
    p = solve(og, linked(2, 1.0), opts)
    assert p.makespan == pytest.approx(6.0)
    assert p.speedup == pytest.approx(5 / 6)
    assert p.assignment["A"] != p.assignment["B"]


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
@pytest.mark.parametrize(("n", "expected"), [(2, 6.25), (3, 5.25), (4, 5.0)])
def test_inception_like_block(n, expected, opts):
    assert solve(INCEPTION, linked(n, 1.0), opts).makespan == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
def test_two_hop_route(opts):
    # memory forces A and B apart on the line g0 - g1 - g2 (g1 too small for either);
    # D = 1 over (bw 2, lat 0.1) then (bw 1, lat 0.1): 0.6 + 1.1 = 1.7
    og = OpGraph(
        [Op("A", 2, memory_bytes=10 * GB), Op("B", 3, memory_bytes=10 * GB)], [Edge("A", "B", 1.0)]
    )
    hw = HardwareGraph.of(
        {"g0": 16 * GB, "g1": 5 * GB, "g2": 16 * GB},
        [("g0", "g1", 2.0, 0.1), ("g1", "g2", 1.0, 0.1)],
    )
    p = solve(og, hw, opts)
    assert p.makespan == pytest.approx(6.7)
    assert sorted([p.assignment["A"], p.assignment["B"]]) == ["g0", "g2"]
    assert list(p.routes.values())[0][1] == "g1"


def test_paper_binary_routing_and_full_hardware_graph_agree():
    opts = PlacerOptions(gap=0.0, decompose=False, integral_routing=True, prune_routes=False)
    hw = HardwareGraph.of(
        {"g0": 16 * GB, "g1": 16 * GB}, [("g0", "sw", 2.0, 0), ("g1", "sw", 2.0, 0)], ["sw"]
    )
    assert solve(DIAMOND, hw, opts).makespan == pytest.approx(7.0)
    assert solve(INCEPTION, linked(3, 1.0), opts).makespan == pytest.approx(5.25)


def test_training_step_schedules_backward_on_the_same_device():
    og = OpGraph(
        [Op(o.name, o.forward_s, 2 * o.forward_s) for o in INCEPTION.ops], INCEPTION.edges, True
    )
    for opts in VARIANTS:
        p = solve(og, linked(2, 1.0), opts)
        by = {(t.op, t.phase): t for t in p.schedule}
        for op in og.ops:
            assert by[(op.name, "bwd")].device == by[(op.name, "fwd")].device
            assert by[(op.name, "bwd")].start >= by[(op.name, "fwd")].end
    # both formulations find the same optimum
    assert solve(og, linked(2, 1.0), WHOLE).makespan == pytest.approx(
        solve(og, linked(2, 1.0), BLOCKS).makespan
    )


def test_too_little_memory_is_one_clear_error():
    og = OpGraph(
        [Op("A", 1, memory_bytes=20 * GB), Op("B", 1, memory_bytes=20 * GB)], [Edge("A", "B", 1)]
    )
    with pytest.raises(ConfigError, match="memory"):
        place(og, linked(2, 1.0, mem=16 * GB))
    with pytest.raises(ConfigError, match="more than its"):
        place(
            OpGraph(
                [Op("A", 1, memory_bytes=10 * GB)] * 1 + [Op("B", 1, memory_bytes=10 * GB)], []
            ),
            linked(1, 1.0),
        )


def test_cut_ops_split_the_step_and_skip_edges_prevent_them():
    assert cut_ops(DIAMOND) == ["A", "D"]
    assert cut_ops(INCEPTION) == ["X", "Y"]
    skip = graph([("A", 1), ("B", 1), ("C", 1)], [("A", "B"), ("B", "C"), ("A", "C")])
    assert cut_ops(skip) == ["A", "C"]  # B is jumped over by A -> C
    assert cut_ops(graph([("a", 1), ("b", 1)], [])) == []


def test_random_graphs_blocks_equal_whole_ilp():
    rng = random.Random(4)
    for _trial in range(6):
        # a chain of small random fork-joins, with random times and transfer sizes
        ops, edges, prev = [("s", rng.uniform(0.1, 1))], [], "s"
        for blk in range(2):
            width = rng.randint(2, 3)
            join = f"j{blk}"
            for w in range(width):
                name = f"b{blk}{w}"
                ops.append((name, rng.uniform(0.5, 3)))
                edges += [(prev, name), (name, join)]
            ops.append((join, rng.uniform(0.1, 1)))
            prev = join
        og = OpGraph(
            [Op(n, t, 2 * t) for n, t in ops],
            [Edge(a, b, rng.uniform(0.1, 1.0)) for a, b in edges],
            training=True,
        )
        hw = linked(2, 1.0)
        whole, blocks = solve(og, hw, WHOLE), solve(og, hw, BLOCKS)
        assert blocks.method == "ilp+blocks"
        assert blocks.makespan == pytest.approx(whole.makespan, rel=1e-6)
        ls = list_schedule(og, hw)
        assert ls is not None and ls.makespan >= whole.makespan - 1e-9


def test_symmetry_classes_follow_the_transfer_times():
    dgx = HardwareGraph.from_hardware(load_profile("dgx1-v100x4"), 4)
    assert dgx.interchangeable_classes([1e6]) == [[0, 1, 2, 3]]
    assert dgx.interchangeable_classes([1e6], fixed=["gpu0"]) == [[1, 2, 3]]
    line = HardwareGraph.of({"g0": 1, "g1": 1, "g2": 1}, [("g0", "g1", 1, 0), ("g1", "g2", 1, 0)])
    assert line.interchangeable_classes([1.0]) == [[0, 2]]  # the ends swap, the middle cannot


def test_dgx1_routes_take_nvlink():
    dgx = HardwareGraph.from_hardware(load_profile("dgx1-v100x4"), 2)
    assert dgx.devices == ["gpu0", "gpu1"]
    assert dgx.shortest("gpu0", "gpu1", 1e6)[1] == ["gpu0", "gpu1"]
    assert dgx.delay("gpu0", "gpu1", 25e6) == pytest.approx(1e-3 + 5e-6)


def test_coarsen_merges_chains_and_keeps_the_graph_valid():
    og = graph(
        [("a", 1), ("b", 2), ("c", 3), ("d", 1), ("e", 1)],
        [("a", "b"), ("b", "c"), ("a", "d"), ("c", "e"), ("d", "e")],
    )
    cg = coarsen(og)
    assert [op.name for op in cg.ops] == ["a", "b", "d", "e"]
    assert cg.op("b").members == ["b", "c"] and cg.op("b").forward_s == 5
    assert {(e.src, e.dst) for e in cg.edges} == {("a", "b"), ("a", "d"), ("b", "e"), ("d", "e")}
    small = coarsen(og, max_ops=2)
    assert len(small.ops) == 2
    assert sum(op.forward_s for op in small.ops) == pytest.approx(og.serial_time())
    # the coarse optimum can only be worse or equal
    hw = linked(2, 0.1)
    assert solve(cg, hw, BLOCKS).makespan >= solve(og, hw, BLOCKS).makespan - 1e-9


def test_pipeline_stages_are_contiguous_and_balanced():
    og = graph([(f"l{i}", 1.0) for i in range(8)], [(f"l{i}", f"l{i + 1}") for i in range(7)])
    p = pipeline_placement(og, linked(2, 1.0))
    assert [p.assignment[f"l{i}"] for i in range(8)] == ["g0"] * 4 + ["g1"] * 4
    check_schedule(og, linked(2, 1.0), p)


def test_speedup_bound_is_work_over_critical_path():
    assert speedup_bound(DIAMOND) == pytest.approx(10 / 6)
    assert speedup_bound(INCEPTION) == pytest.approx(10 / 5)


def test_time_limit_still_returns_a_checked_placement_with_its_gap():
    og = OpGraph(
        [Op(f"o{i}", 1 + (i * 7 % 5), 0) for i in range(14)],
        [
            Edge(f"o{i}", f"o{j}", 0.3)
            for i in range(14)
            for j in range(i + 1, 14)
            if (i * j) % 5 == 1
        ],
    )
    hw = linked(3, 1.0)
    p = place(og, hw, PlacerOptions(time_limit_s=1.0, decompose=False))
    check_schedule(og, hw, p)
    assert p.gap is not None and 0 <= p.gap < 1
    assert p.bound is not None and p.bound <= p.makespan + 1e-9
