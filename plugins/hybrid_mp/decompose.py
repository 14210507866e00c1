"""DLPlacer decomposed at cut ops: exact, and what makes Inception-v3 solve in seconds.

An op that every other op precedes or follows, and that no edge jumps over
(Inception's concats, ResNet's adds), splits the step in time: everything before it
runs before it, everything after after, on every device. The makespan is then a sum
of independent blocks given the devices of the cut ops, so each block is solved
exactly by its own small ILP (:func:`~tunekit.plugins.hybrid_mp.placer_ilp.place_whole`)
for each pair of boundary devices, up to device symmetry and once per identical
block, and the blocks are joined by dynamic programming over the cut ops' devices.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import Op, OpGraph
from tunekit.plugins.hybrid_mp.placer_ilp import place_whole
from tunekit.plugins.hybrid_mp.schedule import (
    Placement,
    device_order_key,
    retime,
    tasks_of,
    topo_order,
)

if TYPE_CHECKING:  # search imports this module to decompose
    from tunekit.plugins.hybrid_mp.search import PlacerOptions

__all__ = ["cut_ops", "place_by_blocks"]


def cut_ops(og: OpGraph) -> list[str]:
    """Ops that split the step in time: every other op is an ancestor or a descendant,
    and no edge runs from an ancestor to a descendant past them."""
    n = len(og.ops)
    idx = og.index()
    succ: list[list[int]] = [[] for _ in range(n)]
    pred: list[list[int]] = [[] for _ in range(n)]
    for e in og.edges:
        succ[idx[e.src]].append(idx[e.dst])
        pred[idx[e.dst]].append(idx[e.src])
    desc = [0] * n
    for v in reversed(range(n)):  # ops are in topological order
        for w in succ[v]:
            desc[v] |= desc[w] | (1 << w)
    anc = [0] * n
    for v in range(n):
        for u in pred[v]:
            anc[v] |= anc[u] | (1 << u)
    everyone = (1 << n) - 1
    cuts = []
    for c in range(n):
        if anc[c] | desc[c] | (1 << c) != everyone:
            continue
        if any((anc[c] >> idx[e.src]) & 1 and (desc[c] >> idx[e.dst]) & 1 for e in og.edges):
            continue
        cuts.append(og.ops[c].name)
    return cuts


@dataclass
class _Block:
    entry: str | None
    exit: str | None
    ops: list[str]


def _blocks(og: OpGraph, cuts: list[str]) -> list[_Block]:
    """The ops between consecutive cut ops (before the first, after the last)."""
    cut_set = set(cuts)
    blocks = [_Block(None, cuts[0], [])]
    for c in cuts[1:]:
        blocks.append(_Block(blocks[-1].exit, c, []))
    blocks.append(_Block(cuts[-1], None, []))
    b = 0
    for op in og.ops:  # topological order: a block's ops sit between its cuts
        if op.name in cut_set:
            b += 1
        else:
            blocks[b].ops.append(op.name)
    return blocks


def _sub_graph(og: OpGraph, block: _Block) -> OpGraph:
    """The block's ops with its cut ops as zero-time boundary ops."""
    names = [n for n in (block.entry,) if n] + block.ops + [n for n in (block.exit,) if n]
    keep = set(names)
    by_name = {op.name: op for op in og.ops}
    ops = []
    for name in names:
        op = by_name[name]
        if name in (block.entry, block.exit):
            op = Op(name, 0.0, 0.0, 0.0, [name], op.kind)
        ops.append(op)
    edges = [e for e in og.edges if e.src in keep and e.dst in keep]
    return OpGraph(ops, edges, training=og.training)


def _canonical(
    devs: tuple[str | None, ...], classes: list[list[str]]
) -> tuple[tuple, dict[str, str]]:
    """Relabel devices within interchangeable classes by first appearance.

    Returns the canonical tuple and the map canonical device -> actual device
    (a permutation of each class).
    """
    mapping: dict[str, str] = {}
    for cls in classes:
        seen = [d for d in dict.fromkeys(devs) if d in cls]
        rest_actual = [d for d in cls if d not in seen]
        for canon_dev, actual in zip(cls, seen + rest_actual, strict=True):
            mapping[canon_dev] = actual
    inverse = {v: k for k, v in mapping.items()}
    canon = tuple(inverse.get(d, d) if d is not None else None for d in devs)
    return canon, mapping


_BlockSolver = Callable[[int, str | None, str | None], tuple[Placement, dict[str, str]]]
"""(block, entry device, exit device) -> the block's placement for canonical devices, and
the map canonical device -> actual device."""


def place_by_blocks(
    og: OpGraph, hw: HardwareGraph, cuts: list[str], opts: PlacerOptions
) -> Placement:
    """DLPlacer block by block between the cut ops ``cuts``: each block solved for every
    pair of boundary devices (up to device symmetry), the blocks joined by dynamic
    programming over the cut ops' devices, the whole retimed as one schedule."""
    blocks = _blocks(og, cuts)
    class_idx = (
        hw.interchangeable_classes([e.nbytes for e in og.edges]) if opts.symmetry_breaking else []
    )
    classes = [[hw.devices[i] for i in c] for c in class_idx]
    solved, stats = _solve_blocks(og, hw, blocks, classes, opts)

    def solve(bi: int, d_in: str | None, d_out: str | None) -> tuple[Placement, dict[str, str]]:
        canon, mapping = _canonical((d_in, d_out), classes)
        return solved[(bi, canon)], mapping

    total, lower, cut_devices = _join_blocks(len(blocks), hw.devices, solve)
    result, all_optimal, any_unproven = _assemble(og, hw, blocks, cuts, cut_devices, solve)
    fixed = sum(og.op(c).forward_s + (og.op(c).backward_s if og.training else 0.0) for c in cuts)
    bound = lower + fixed
    result.bound = bound
    result.gap = max(0.0, 1 - bound / result.makespan) if result.makespan > 0 else 0.0
    # Each block within its gap makes the sum within it; a block cut short may still
    # leave the whole within the requested gap. A block the solver failed on is no limit.
    if all_optimal or result.gap <= opts.gap + 1e-12:
        result.status = "optimal"
    else:
        result.status = "heuristic" if any_unproven else "limit"
    result.size = {
        "ops": len(og.ops),
        "edges": len(og.edges),
        "devices": len(hw.devices),
        "blocks": len(blocks),
        "cut_ops": len(cuts),
        **stats,
    }
    if abs(result.makespan - (total + fixed)) > 1e-6 * max(result.makespan, 1e-12):
        raise AssertionError(
            f"block decomposition inconsistent: schedule {result.makespan} vs sum {total + fixed}"
        )
    return result


def _subproblems(
    blocks: list[_Block], devs: list[str], classes: list[list[str]]
) -> list[tuple[int, tuple]]:
    """Every (block, boundary devices) subproblem the dynamic programme needs, up to symmetry."""
    needed: list[tuple[int, tuple]] = []
    for bi, block in enumerate(blocks):
        ins = devs if block.entry else [None]
        outs = devs if block.exit else [None]
        for d_in in ins:
            for d_out in outs:
                key = (bi, _canonical((d_in, d_out), classes)[0])
                if key not in needed:
                    needed.append(key)
    return needed


def _solve_blocks(
    og: OpGraph,
    hw: HardwareGraph,
    blocks: list[_Block],
    classes: list[list[str]],
    opts: PlacerOptions,
) -> tuple[dict[tuple, Placement], dict[str, int]]:
    """Each subproblem by its own ILP, its boundary ops pinned, within a share of the time
    left; a block identical to one solved before reuses its solution, renamed."""
    subs = [_sub_graph(og, b) for b in blocks]
    needed = _subproblems(blocks, hw.devices, classes)
    deadline = time.perf_counter() + opts.time_limit_s
    solved: dict[tuple, Placement] = {}
    by_shape: dict[tuple, tuple[list[str], Placement]] = {}
    stats = {"ilps": 0, "nodes": 0, "binaries": 0, "max_block_ops": 0, "reused": 0}
    for pos, (bi, canon) in enumerate(needed):
        sub, block = subs[bi], blocks[bi]
        names = [op.name for op in sub.ops]
        shape = (_shape(sub), canon)
        if shape in by_shape:  # the same block again (Inception's repeated modules)
            old_names, old = by_shape[shape]
            solved[(bi, canon)] = _renamed(old, dict(zip(old_names, names, strict=True)))
            stats["reused"] += 1
            continue
        pins = {}
        if block.entry:
            pins[block.entry] = canon[0]
        if block.exit:
            pins[block.exit] = canon[1]
        left = deadline - time.perf_counter()
        share = max(0.5, min(left, 2 * left / (len(needed) - pos)))
        sub_opts = dataclasses.replace(opts, time_limit_s=share, decompose=False)
        res = place_whole(sub, hw, sub_opts, pins)
        solved[(bi, canon)] = res
        by_shape[shape] = (names, res)
        stats["max_block_ops"] = max(stats["max_block_ops"], len(block.ops))
        if res.size.get("ilps"):
            stats["ilps"] += 1
            stats["nodes"] += res.size.get("nodes", 0)
            stats["binaries"] = max(stats["binaries"], res.size.get("binaries", 0))
    return solved, stats


def _join_blocks(
    n_blocks: int, devs: list[str], solve: _BlockSolver
) -> tuple[float, float, list[str]]:
    """Dynamic programming over the cut ops' devices: the least total makespan, a lower
    bound on it (the blocks' bounds summed), and the cut ops' devices that reach it."""
    # best[d] = (cost, lower bound, cut devices so far) with the latest cut op on d
    best: dict[str, tuple[float, float, list[str]]] = {}
    for d in devs:
        p, _ = solve(0, None, d)
        best[d] = (p.makespan, _bound(p), [d])
    for bi in range(1, n_blocks - 1):
        nxt: dict[str, tuple[float, float, list[str]]] = {}
        for d2 in devs:
            cands = []
            lbs = []
            for d1 in devs:
                p, _ = solve(bi, d1, d2)
                cands.append((best[d1][0] + p.makespan, d1))
                lbs.append(best[d1][1] + _bound(p))
            cost, d1 = min(cands, key=lambda c: c[0])
            nxt[d2] = (cost, min(lbs), best[d1][2] + [d2])
        best = nxt
    last = n_blocks - 1
    finals = []
    lbs = []
    for d in devs:
        p, _ = solve(last, d, None)
        finals.append((best[d][0] + p.makespan, d))
        lbs.append(best[d][1] + _bound(p))
    total, d_last = min(finals, key=lambda c: c[0])
    return total, min(lbs), best[d_last][2]


def _assemble(
    og: OpGraph,
    hw: HardwareGraph,
    blocks: list[_Block],
    cuts: list[str],
    cut_devices: list[str],
    solve: _BlockSolver,
) -> tuple[Placement, bool, bool]:
    """The blocks' placements for the chosen cut devices as one placement, retimed with
    every task in its block's window in time (see :func:`_window`); and whether every
    block was proven optimal, and whether any was not proven at all."""
    assign: dict[str, str] = dict(zip(cuts, cut_devices, strict=True))
    order_key: dict[tuple[str, str], tuple[int, float]] = {}
    n_cuts = len(cuts)
    all_optimal, any_unproven = True, False
    for bi, block in enumerate(blocks):
        d_in = cut_devices[bi - 1] if bi > 0 else None
        d_out = cut_devices[bi] if bi < n_cuts else None
        p, mapping = solve(bi, d_in, d_out)
        all_optimal &= p.status == "optimal"
        any_unproven |= p.status == "heuristic"
        for name in block.ops:
            assign[name] = mapping.get(p.assignment[name], p.assignment[name])
        for t in p.schedule:
            if t.op in block.ops:
                window = _window(bi, t.phase, n_cuts, og.training)
                order_key[(t.op, t.phase)] = (window, device_order_key(t.start, t.end))
    for j, c in enumerate(cuts, start=1):
        order_key[(c, "fwd")] = (2 * j - 1, 0.0)
        order_key[(c, "bwd")] = (4 * n_cuts - 2 * j + 1, 0.0)
    tasks, tedges = tasks_of(og)
    topo = {v: i for i, v in enumerate(topo_order(len(tasks), tedges))}
    ranked = sorted(
        range(len(tasks)),
        key=lambda i: (*order_key[(og.ops[tasks[i].op].name, tasks[i].phase)], topo[i]),
    )
    priority = [0.0] * len(tasks)
    for pos, i in enumerate(ranked):
        priority[i] = float(pos)
    return retime(og, hw, assign, priority, "ilp+blocks"), all_optimal, any_unproven


def _shape(og: OpGraph) -> tuple:
    """What a block's solution depends on, without its names."""
    idx = og.index()
    return (
        og.training,
        tuple((op.forward_s, op.backward_s, op.memory_bytes) for op in og.ops),
        tuple((idx[e.src], idx[e.dst], e.nbytes) for e in og.edges),
    )


def _renamed(p: Placement, names: Mapping[str, str]) -> Placement:
    """A copy of ``p`` for an identical block whose ops are called ``names[old]``."""
    q = Placement.from_dict(p.to_dict())
    q.assignment = {names[k]: v for k, v in q.assignment.items()}
    q.members = {names[k]: [names.get(x, x) for x in v] for k, v in q.members.items()}
    q.routes = {
        f"{names[a]}->{names[b]}": r
        for (a, b), r in ((k.split("->"), v) for k, v in q.routes.items())
    }
    for t in q.schedule:
        t.op = names[t.op]
    return q


def _bound(p: Placement) -> float:
    return p.bound if p.bound is not None else p.makespan


def _window(block: int, phase: str, n_cuts: int, training: bool) -> int:
    """Where a block's task runs in the step: blocks' forward passes and cut ops alternate,
    the last block runs forward and backward, then backward passes return in reverse."""
    if phase == "fwd" or block == n_cuts or not training:
        return 2 * block
    return 4 * n_cuts - 2 * block
