"""DLPlacer's ILP on the small placement cases of NOTES.md §2, with their exact makespans;
zero-duration ops on one stream per device; what a failed solve reports."""

from __future__ import annotations

import itertools
import random

import pytest

from tunekit.errors import ConfigError
from tunekit.hardware import load_profile
from tunekit.plugins.hybrid_mp.decompose import cut_ops
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import Edge, Op, OpGraph
from tunekit.plugins.hybrid_mp.placer_ilp import _Horizon, _without_solution
from tunekit.plugins.hybrid_mp.render import format_summary
from tunekit.plugins.hybrid_mp.schedule import (
    Placement,
    ScheduledTask,
    check_schedule,
    list_schedule,
    tasks_of,
)
from tunekit.plugins.hybrid_mp.search import (
    PlacerOptions,
    coarsen,
    pipeline_placement,
    place,
    speedup_bound,
)
from tunekit.search.ilp import MilpSolution

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


def test_pipeline_stages_cut_only_between_units():
    # three blocks of (1, 1, 2), (2, 2), (1, 1): the plain cut falls inside the second block;
    # by units it falls where most of that block's work goes, and never inside a block
    times = [1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0]
    og = graph(
        [(f"l{i}", t) for i, t in enumerate(times)], [(f"l{i}", f"l{i + 1}") for i in range(6)]
    )
    units = {f"l{i}": b for i, b in enumerate(["b0", "b0", "b0", "b1", "b1", "b2", "b2"])}
    hw = linked(2, 1.0)
    plain = pipeline_placement(og, hw)
    assert plain.assignment["l3"] != plain.assignment["l4"]  # 5 of 10 done after l3: cut
    p = pipeline_placement(og, hw, units)
    for i in range(6):
        if units[f"l{i}"] == units[f"l{i + 1}"]:
            assert p.assignment[f"l{i}"] == p.assignment[f"l{i + 1}"], i
    # block b1 (4 of 10) starts at 4: its midpoint 6 lies past half the work -> device 1
    assert [p.assignment[f"l{i}"] for i in range(7)] == ["g0"] * 3 + ["g1"] * 4
    check_schedule(og, hw, p)
    # ops outside any unit are units of their own, each on the stage holding most of it
    one_each = pipeline_placement(og, hw, {})
    assert [one_each.assignment[f"l{i}"] for i in range(7)] == ["g0"] * 4 + ["g1"] * 3


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


# -- zero-duration ops: one stream per device (Eq. 12) ----------------------------------------


def enumerated_optimum(og: OpGraph, hw: HardwareGraph, one_stream: bool = True) -> float:
    """The optimal makespan by enumeration, independent of the ILP and the list scheduler.

    Every feasible schedule runs each device's tasks in some order, and the tasks in
    the order of their intervals' midpoints form a topological order; starting each
    task as early as its inputs and its device's previous task allow never delays it.
    So the optimum is the best, over every assignment that fits in memory and every
    topological order, of that as-early-as-possible schedule -- where a zero-duration
    task, too, waits for its device's previous task to end (``one_stream=False``: it
    runs as soon as its inputs are there, the optimistic model this replaced).
    """
    tasks, tedges = tasks_of(og)
    n = len(tasks)
    preds: list[list[tuple[int, float | None]]] = [[] for _ in range(n)]
    for te in tedges:
        preds[te.dst].append((te.src, None if te.edge is None else og.edges[te.edge].nbytes))
    best = float("inf")
    for devs in itertools.product(hw.devices, repeat=len(og.ops)):
        used = {d: 0.0 for d in hw.devices}
        for op, d in zip(og.ops, devs, strict=True):
            used[d] += op.memory_bytes
        if any(used[d] > mem for d, mem in zip(hw.devices, hw.memory, strict=True)):
            continue
        dev = [devs[t.op] for t in tasks]
        for order in topological_orders(n, [[u for u, _ in p] for p in preds]):
            end = [0.0] * n
            free = {d: 0.0 for d in hw.devices}
            for v in order:
                arrivals = [
                    end[u] + (0.0 if nb is None else hw.delay(dev[u], dev[v], nb))
                    for u, nb in preds[v]
                ]
                ready = max(arrivals, default=0.0)
                if tasks[v].duration > 0 or one_stream:
                    end[v] = max(ready, free[dev[v]]) + tasks[v].duration
                    free[dev[v]] = end[v]
                else:
                    end[v] = ready
            best = min(best, max(end))
    return best


def topological_orders(n: int, preds: list[list[int]]):
    done: list[int] = []
    placed = [False] * n

    def extend():
        if len(done) == n:
            yield list(done)
            return
        for v in range(n):
            if not placed[v] and all(placed[u] for u in preds[v]):
                placed[v] = True
                done.append(v)
                yield from extend()
                done.pop()
                placed[v] = False

    yield from extend()


def test_check_schedule_rejects_a_zero_duration_op_inside_another():
    og = OpGraph([Op("conv", 4.0), Op("cat", 0.0)], [])
    hw = linked(2, 1.0)

    def scheduled(cat_device: str, cat_at: float) -> Placement:
        return Placement(
            devices=hw.devices,
            assignment={"conv": "g0", "cat": cat_device},
            schedule=[
                ScheduledTask("conv", "fwd", "g0", 0.0, 4.0),
                ScheduledTask("cat", "fwd", cat_device, cat_at, cat_at),
            ],
            routes={},
            makespan=4.0,
            serial_s=4.0,
            method="list",
        )

    with pytest.raises(AssertionError, match="cat/fwd \\(zero duration\\) at 2 runs during conv"):
        check_schedule(og, hw, scheduled("g0", 2.0))
    # touching either end, or on another device, is fine
    for device, at in (("g0", 0.0), ("g0", 4.0), ("g1", 2.0)):
        check_schedule(og, hw, scheduled(device, at))


# A pooling layer P and a concatenation Z, both Δ = 0, too big to share a 4-byte device;
# conv C (2) reads both, the fc F (4) is independent; one byte costs 1 per hop.
# P and C share g0 (P -> C carries 5), Z goes to g1 and receives P's output at 1, and F
# goes to g1 too (on g0 it would make 6). If Z may run during F (F in [0, 4]), C starts
# at 2 and the step ends at 4; a one-stream g1 runs Z before F (F then ends at 5) or
# after it (C ends at 7): 5.
ZERO_SPLIT = OpGraph(
    [
        Op("P", 0.0, memory_bytes=2),
        Op("Z", 0.0, memory_bytes=3),
        Op("F", 4.0, memory_bytes=1),
        Op("C", 2.0, memory_bytes=1),
    ],
    [Edge("P", "Z", 1.0), Edge("P", "C", 5.0), Edge("Z", "C", 1.0)],
)


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
def test_zero_duration_op_waits_for_its_device(opts):
    hw = linked(2, 1.0, mem=4.0)
    p = solve(ZERO_SPLIT, hw, opts)
    assert p.makespan == pytest.approx(5.0, abs=1e-6)
    assert p.status == "optimal"
    assert enumerated_optimum(ZERO_SPLIT, hw) == pytest.approx(5.0)
    assert enumerated_optimum(ZERO_SPLIT, hw, one_stream=False) == pytest.approx(4.0)
    ls = list_schedule(ZERO_SPLIT, hw)
    assert ls is not None
    check_schedule(ZERO_SPLIT, hw, ls, tol=1e-12)


def zero_heavy_graph(rng: random.Random, n_ops: int, training: bool) -> OpGraph:
    """Ops of which about 40 % have Δ = 0 (concatenations, analytic pooling), random edges."""
    ops = []
    for i in range(n_ops):
        t = 0.0 if rng.random() < 0.4 else float(rng.randint(1, 5))
        ops.append(Op(f"o{i}", t, 2 * t if training else 0.0, memory_bytes=rng.randint(1, 3)))
    edges = [
        Edge(f"o{i}", f"o{j}", float(rng.choice([0.5, 1, 2, 5])))
        for i in range(n_ops)
        for j in range(i + 1, n_ops)
        if rng.random() < 0.4
    ]
    return OpGraph(ops, edges, training)


def test_zero_duration_ops_ilp_and_list_schedules_against_enumeration():
    rng = random.Random(16)
    for trial in range(12):
        training = trial % 3 == 2
        og = zero_heavy_graph(rng, 3 if training else 5, training)
        total = sum(op.memory_bytes for op in og.ops)
        hw = linked(2, 1.0, mem=0.75 * total)  # memory binds now and then
        best = enumerated_optimum(og, hw)
        for opts in VARIANTS:
            p = place(og, hw, opts)
            check_schedule(og, hw, p, tol=1e-9)
            assert p.makespan == pytest.approx(best, abs=1e-6), (trial, og.to_dict())
        ls = list_schedule(og, hw)
        if ls is not None:
            check_schedule(og, hw, ls, tol=1e-12)
            assert ls.makespan >= best - 1e-9


@pytest.mark.parametrize("opts", VARIANTS, ids=["whole", "blocks"])
def test_inception_block_with_zero_duration_pool_and_concat(opts):
    # X(1) -> {b1 (3), b2 (2), pool (0) -> b4 (1)} -> cat (0) -> Y (1), c = 0.25: the pool
    # tower and the concat take no time but still a turn on their device's stream
    og = graph(
        [("X", 1), ("b1", 3), ("b2", 2), ("pool", 0), ("b4", 1), ("cat", 0), ("Y", 1)],
        [("X", "b1"), ("X", "b2"), ("X", "pool"), ("pool", "b4")]
        + [(b, "cat") for b in ("b1", "b2", "b4")]
        + [("cat", "Y")],
        nbytes=0.25,
        training=True,
    )
    hw = linked(2, 1.0)
    p = solve(og, hw, opts)
    check_schedule(og, hw, p, tol=1e-9)
    assert p.status == "optimal"
    assert p.makespan == pytest.approx(solve(og, hw, WHOLE).makespan, abs=1e-6)
    ls = list_schedule(og, hw)
    check_schedule(og, hw, ls, tol=1e-12)


# -- solver failures ------------------------------------------------------------------------


def test_memory_bound_placement_list_scheduling_cannot_start_is_solved_to_its_optimum():
    # Issue 16: list scheduling fills g0 greedily (o0, o1) and then finds no room for o3;
    # the only placement that fits puts o0, o2 on g1 and o1, o3 on g0. o1 waits for
    # o0's activation (3.02 + 1.795 / 0.819), o3 for o2's and then for o1:
    # 3.02 + 1.795 / 0.819 + 3.04 + 1.58 = 9.8317.
    og = OpGraph(
        [
            Op("o0", 3.02, memory_bytes=2.77),
            Op("o1", 3.04, memory_bytes=4.49),
            Op("o2", 1.37, memory_bytes=1.28),
            Op("o3", 1.58, memory_bytes=3.58),
        ],
        [Edge("o0", "o1", 1.795), Edge("o0", "o2", 1.109), Edge("o2", "o3", 1.615)],
    )
    hw = HardwareGraph.of({"g0": 8.44, "g1": 4.22}, [("g0", "g1", 0.819, 0.0)])
    assert list_schedule(og, hw) is None
    for opts in (PlacerOptions(time_limit_s=120), *VARIANTS):
        p = solve(og, hw, opts)  # check_schedule: precedence, one stream, memory
        assert p.makespan == pytest.approx(9.8317, abs=1e-4)
        assert p.status == "optimal" and p.solve_s < 60
        for dev, mem in zip(hw.devices, hw.memory, strict=True):
            used = sum(op.memory_bytes for op in og.ops if p.assignment[op.name] == dev)
            assert used <= mem
        assert p.assignment == {"o0": "g1", "o1": "g0", "o2": "g1", "o3": "g0"}


def test_a_failed_solve_says_what_highs_said_not_a_time_limit():
    bounds = _Horizon(critical=1.0, lower=1.0, horizon=2.0, target=None)

    def outcome(status: str, message: str) -> MilpSolution:
        return MilpSolution(status, None, None, None, None, 0.03, 0, message)

    error = outcome("error", "(HiGHS Status 4: Solve error)")
    with pytest.raises(ConfigError) as info:
        _without_solution(error, None, bounds, None, 120.0)
    text = str(info.value)
    assert "Solve error" in text and "'error' after 0.03 s" in text
    assert "within" not in text and "\n" not in text
    limit = outcome("limit", "Time limit reached. (HiGHS Status 13: Time limit reached)")
    with pytest.raises(ConfigError, match="no placement within 120 s"):
        _without_solution(limit, None, bounds, None, 120.0)
    # with a fallback placement the failure is no limit either: nothing is proven
    fallback = Placement(["g0"], {"a": "g0"}, [], {}, 2.0, 2.0, "list")
    p = _without_solution(error, fallback, bounds, None, 120.0)
    assert p.status == "heuristic" and "Solve error" in p.note
    assert "Solve error" in format_summary(p)
    assert p.bound == 1.0 and p.gap == pytest.approx(0.5)
