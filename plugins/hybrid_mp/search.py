"""DLPlacer: optimal op-to-device placement, schedule and routing by integer linear programming.

Pal et al., Section 6. Given an :class:`~tunekit.plugins.hybrid_mp.model.OpGraph`
(ops with Δ(k), M(k); edges with D(e)) and a
:class:`~tunekit.plugins.hybrid_mp.hardware_graph.HardwareGraph` (devices,
switches, links with bandwidth B(l) and latency L(l)), :func:`place` solves

    minimise  C_max
    P(k,n) ∈ {0,1}, Σ_n P(k,n) = 1                                   (7)
    at every hardware vertex v, for every edge e = (u→w):
        Σ_out C(e,·) − Σ_in C(e,·) = P(u,v) − P(w,v)  (0 at routers)  (8)(9)
    Δ_e = Σ_l C(e,l) (D(e)/B(l) + L(l))                               (11)
    T(w) ≥ T(u) + Δ(u) + Δ_e                                           (10)
    no two tasks overlap on a device: an order binary and big-M, only
    for pairs no dependency path already orders                        (12)
    Σ_k P(k,n) M(k) ≤ Mem(n)                                           (13)
    C_max ≥ T(k) + Δ(k)   (the objective the paper leaves unstated)

with HiGHS through ``scipy.optimize.milp``. Beyond the paper:

* **Training steps.** A training graph schedules every op's backward task on
  its device too; gradients flow back along the edges' routes
  (:mod:`~tunekit.plugins.hybrid_mp.schedule`).
* **Continuous routing.** Without link contention (the paper's model) a
  fractional flow never beats the shortest path it averages over, so C(e,l)
  may be continuous with the same optimum and far fewer binaries
  (``integral_routing=True`` restores the paper's binaries).
* **Tightening.** A list-scheduling solution caps the horizon; start times
  are boxed by zero-communication heads and tails; each big-M is the
  smallest valid for its pair; each device's load bounds C_max; devices that
  are interchangeable are ordered by the first op they host (symmetry
  breaking); times and memory are rescaled to O(1) for the solver.
* **Decomposition at cut ops.** An op that every other op precedes or
  follows, and that no edge jumps over (Inception's concats, ResNet's adds),
  splits the step in time: everything before it runs before it, everything
  after after, on every device. The makespan is then a sum of independent
  blocks given the devices of the cut ops, so each block is solved exactly
  by its own small ILP for each pair of boundary devices and the blocks are
  joined by dynamic programming over the cut ops' devices, which is exact.
  It applies when memory cannot bind (the whole model fits on every device);
  otherwise the whole graph is one ILP.
* **Coarsening** (:func:`coarsen`): chains of layers become one op.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import Edge, Op, OpGraph
from tunekit.plugins.hybrid_mp.schedule import (
    Placement,
    descendants,
    heads_tails,
    improve,
    list_schedule,
    retime,
    tasks_of,
    topo_order,
)
from tunekit.search.ilp import MilpModel

__all__ = ["PlacerOptions", "place", "coarsen", "cut_ops"]


@dataclass
class PlacerOptions:
    """Settings of a DLPlacer solve."""

    time_limit_s: float = 60.0
    """Stop after this long with the best placement found and its proven gap."""
    gap: float = 0.01
    """Stop when the incumbent is proven within this relative gap of optimal (0.01 = 1 %)."""
    decompose: bool = True
    """Solve block by block between cut ops when memory cannot bind (exact, much faster)."""
    symmetry_breaking: bool = True
    """Order interchangeable devices by the first op they host."""
    integral_routing: bool = False
    """Binary routing variables C(e,l) as in the paper (continuous is exact without contention)."""
    prune_routes: bool = True
    """Give routing variables only to links on some fastest path for the edge's size (exact
    without contention); off: every link of the hardware graph, as in the paper."""
    load_cuts: bool = True
    """Add C_max ≥ Σ_k Δ(k) P(k,n) for every device (valid; tightens the relaxation)."""
    heuristic_bound: bool = True
    """Cap the horizon with a list-scheduling solution (off: the ILP alone finds the optimum)."""
    verbose: bool = False

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ConfigError(f"DLPlacer time limit must be positive, not {self.time_limit_s}")
        if not 0 <= self.gap < 1:
            raise ConfigError(f"DLPlacer gap must be in [0, 1), not {self.gap}")


def place(
    og: OpGraph,
    hw: HardwareGraph,
    options: PlacerOptions | None = None,
    pinned: Mapping[str, str] | None = None,
) -> Placement:
    """The placement, schedule and routing that minimise the step's makespan.

    ``pinned`` fixes ops to devices. The returned :class:`Placement` says how
    it was found (``method``), whether it is proven optimal within
    ``options.gap`` (``status``, ``gap``, ``bound``) and how long that took.
    """
    opts = options or PlacerOptions()
    start = time.perf_counter()
    if not og.ops:
        raise ConfigError("op graph is empty: nothing to place")
    if not hw.devices:
        raise ConfigError("hardware graph has no devices")
    total_mem = sum(op.memory_bytes for op in og.ops)
    if max(op.memory_bytes for op in og.ops) > max(hw.memory) * (1 + 1e-9):
        raise ConfigError("an op needs more memory than any device has")
    if total_mem > sum(hw.memory) * (1 + 1e-9):
        raise ConfigError(
            f"the model needs {total_mem / 1e9:.1f} GB, more than its "
            f"{len(hw.devices)} devices hold together"
        )
    for name, dev in (pinned or {}).items():
        if dev not in hw.devices:
            raise ConfigError(f"op {name} is pinned to unknown device {dev!r}")
    fits_anywhere = total_mem <= min(hw.memory) * (1 + 1e-9)
    if opts.decompose and fits_anywhere and not pinned and len(hw.devices) > 1:
        cuts = cut_ops(og)
        if cuts:
            result = _place_by_blocks(og, hw, cuts, opts)
            result.solve_s = time.perf_counter() - start
            return result
    return _place_whole(og, hw, opts, pinned or {})


# -- one ILP for the whole graph ---------------------------------------------------------


def _incumbent(og: OpGraph, hw: HardwareGraph, pinned: Mapping[str, str]) -> Placement | None:
    """The better of list scheduling (improved by local search) and everything on one device."""
    best = list_schedule(og, hw, pinned)
    if best is not None and len(og.ops) <= 64:
        best = improve(og, hw, best, pinned)
    devs = set(pinned.values())
    if len(devs) <= 1:
        dev = next(iter(devs)) if devs else hw.devices[0]
        single = list_schedule(og, hw, {op.name: dev for op in og.ops})
        if single is not None and (best is None or single.makespan < best.makespan - 1e-15):
            best = single
            best.method = "single"
    return best


def _place_whole(
    og: OpGraph, hw: HardwareGraph, opts: PlacerOptions, pinned: Mapping[str, str]
) -> Placement:
    start = time.perf_counter()
    incumbent = _incumbent(og, hw, pinned)
    free_ops = [op for op in og.ops if op.name not in pinned]
    if len(hw.devices) == 1 or not free_ops:
        if incumbent is None:
            raise ConfigError("DLPlacer: no placement satisfies the memory limits")
        # Nothing to choose: the schedule of a fixed placement without conflicts is exact.
        if len(hw.devices) == 1 or all(t.end == t.start for t in incumbent.schedule):
            incumbent.status, incumbent.gap, incumbent.bound = "optimal", 0.0, incumbent.makespan
            incumbent.solve_s = time.perf_counter() - start
            return incumbent
    result = _solve_ilp(og, hw, incumbent, opts, pinned)
    result.solve_s = time.perf_counter() - start
    return result


def _solve_ilp(
    og: OpGraph,
    hw: HardwareGraph,
    incumbent: Placement | None,
    opts: PlacerOptions,
    pinned: Mapping[str, str],
) -> Placement:
    tasks, tedges = tasks_of(og)
    n_ops, n_tasks, n_dev = len(og.ops), len(tasks), len(hw.devices)
    head, tail = heads_tails(tasks, tedges)
    critical = max(h + t.duration + tl for h, t, tl in zip(head, tasks, tail, strict=True))
    # Horizon: an upper bound on the optimal makespan -- the incumbent, or a serial
    # schedule that waits out every transfer on its slowest route.
    worst = [
        max(
            (hw.delay(a, b, e.nbytes) for a in hw.devices for b in hw.devices if a != b),
            default=0.0,
        )
        for e in og.edges
    ]
    horizon = sum(t.duration for t in tasks) + sum(
        worst[te.edge] for te in tedges if te.edge is not None
    )
    # A lower bound without solving: the critical path, and the work spread evenly.
    lower = max(critical, sum(t.duration for t in tasks) / n_dev)
    target = None
    if incumbent is not None and opts.heuristic_bound:
        if incumbent.makespan * (1 - opts.gap) <= lower:
            incumbent.status, incumbent.bound = "optimal", lower
            incumbent.gap = max(0.0, 1 - lower / incumbent.makespan)
            incumbent.size = {"ops": n_ops, "edges": len(og.edges), "ilps": 0}
            return incumbent
        # Ask only for a solution clearly better than the incumbent: if none exists the
        # incumbent is proven within gap / 2 of optimal, usually faster than closing the gap.
        target = incumbent.makespan * (1 - opts.gap / 2)
        horizon = min(horizon, target)
    horizon = max(horizon, critical) * (1 + 1e-7)  # slack for the solver's tolerances
    # Rescale: times in units of horizon/1000, memory in units of the largest device.
    tu = horizon / 1000.0 if horizon > 0 else 1.0
    mu = max(hw.memory)
    dur = [t.duration / tu for t in tasks]
    hd, tl = [h / tu for h in head], [x / tu for x in tail]
    hz = horizon / tu

    m = MilpModel()
    P = [[m.binary(f"P[{op.name},{d}]") for d in hw.devices] for op in og.ops]
    dev_idx = {d: i for i, d in enumerate(hw.devices)}
    for k, op in enumerate(og.ops):
        if op.name in pinned:
            for n in range(n_dev):
                m.fix(P[k][n], 1.0 if n == dev_idx[pinned[op.name]] else 0.0)
    T = [
        m.var(f"T[{og.ops[t.op].name}/{t.phase}]", hd[i], max(hd[i], hz - dur[i] - tl[i]))
        for i, t in enumerate(tasks)
    ]
    cmax = m.var("Cmax", critical / tu, hz)
    m.minimise({cmax: 1.0})
    # (7) one device per op
    for k in range(n_ops):
        m.eq({P[k][n]: 1.0 for n in range(n_dev)}, 1.0)
    # (13) memory
    for n in range(n_dev):
        m.le({P[k][n]: og.ops[k].memory_bytes / mu for k in range(n_ops)}, hw.memory[n] / mu)
    # (8)(9) routing as directed flow conservation; (11) each edge's delay as a linear form
    idx = og.index()
    arcs_for: dict[float, list[int]] = {}
    delay_terms: list[dict[int, float]] = []
    for e in og.edges:
        u, w = idx[e.src], idx[e.dst]
        if opts.prune_routes:
            if e.nbytes not in arcs_for:
                arcs_for[e.nbytes] = hw.fastest_arcs(e.nbytes)
            arcs = arcs_for[e.nbytes]
        else:
            arcs = list(range(len(hw.arcs)))
        C = {
            a: m.var(
                f"C[{e.src}->{e.dst},{hw.arcs[a].src}->{hw.arcs[a].dst}]",
                0.0,
                1.0,
                integer=opts.integral_routing,
            )
            for a in arcs
        }
        rows: dict[str, dict[int, float]] = {v: {} for v in hw.vertices}
        for a, var in C.items():
            arc = hw.arcs[a]
            rows[arc.src][var] = rows[arc.src].get(var, 0.0) + 1.0
            rows[arc.dst][var] = rows[arc.dst].get(var, 0.0) - 1.0
        for v, row in rows.items():
            if v in dev_idx:
                row[P[u][dev_idx[v]]] = row.get(P[u][dev_idx[v]], 0.0) - 1.0
                row[P[w][dev_idx[v]]] = row.get(P[w][dev_idx[v]], 0.0) + 1.0
            m.eq(row, 0.0)
        delay_terms.append({var: hw.arcs[a].time(e.nbytes) / tu for a, var in C.items()})
    # (10) precedence; data edges pay their transfer (gradients go back the same way)
    has_succ = [False] * n_tasks
    for te in tedges:
        has_succ[te.src] = True
        row = {T[te.dst]: 1.0, T[te.src]: -1.0}
        if te.edge is not None:
            for var, coef in delay_terms[te.edge].items():
                row[var] = row.get(var, 0.0) - coef
        m.ge(row, dur[te.src])
    for i in range(n_tasks):
        if not has_succ[i]:
            m.ge({cmax: 1.0, T[i]: -1.0}, dur[i])
    # (12) no overlap on a device, for pairs no dependency path orders
    reach = descendants(n_tasks, tedges)
    same: dict[tuple[int, int], int] = {}
    n_pairs = 0
    for a in range(n_tasks):
        if dur[a] <= 0:
            continue
        for b in range(a + 1, n_tasks):
            if dur[b] <= 0 or tasks[a].op == tasks[b].op:
                continue
            if (reach[a] >> b) & 1 or (reach[b] >> a) & 1:
                continue
            lb_a, ub_a = m.bounds(T[a])
            lb_b, ub_b = m.bounds(T[b])
            m1 = dur[a] + ub_a - lb_b  # smallest big-M for "a before b"
            m2 = dur[b] + ub_b - lb_a  # smallest big-M for "b before a"
            if m1 <= 0 or m2 <= 0:
                continue  # the time windows already order the pair
            i, j = sorted((tasks[a].op, tasks[b].op))
            if (i, j) not in same:
                s = m.var(f"S[{og.ops[i].name},{og.ops[j].name}]", 0.0, 1.0)
                for n in range(n_dev):
                    m.ge({s: 1.0, P[i][n]: -1.0, P[j][n]: -1.0}, -1.0)
                same[(i, j)] = s
            s = same[(i, j)]
            y = m.binary(f"Y[{a},{b}]")
            # y=1, s=1: b after a;  y=0, s=1: a after b;  s=0: free
            m.ge({T[b]: 1.0, T[a]: -1.0, y: -m1, s: -m1}, dur[a] - 2 * m1)
            m.ge({T[a]: 1.0, T[b]: -1.0, y: m2, s: -m2}, dur[b] - m2)
            n_pairs += 1
    # valid inequalities: a device runs one task at a time, so a task cannot start before
    # its ancestors placed on any one device have run, nor end later than C_max less its
    # descendants' work there; with no task given, the device's whole load bounds C_max
    if opts.load_cuts:
        ancestors = [0] * n_tasks
        for a in range(n_tasks):
            for b in range(n_tasks):
                if (reach[a] >> b) & 1:
                    ancestors[b] |= 1 << a

        def load(bits: int, n: int) -> dict[int, float]:
            row: dict[int, float] = {}
            for i in range(n_tasks):
                if (bits >> i) & 1 and dur[i] > 0:
                    var = P[tasks[i].op][n]
                    row[var] = row.get(var, 0.0) + dur[i]
            return row

        for n in range(n_dev):
            m.ge({cmax: 1.0, **{v: -c for v, c in load((1 << n_tasks) - 1, n).items()}}, 0.0)
            for v in range(n_tasks):
                before = load(ancestors[v], n)
                if len(before) > 1:
                    m.ge({T[v]: 1.0, **{x: -c for x, c in before.items()}}, 0.0)
                after = load(reach[v], n)
                if len(after) > 1:
                    m.ge({cmax: 1.0, T[v]: -1.0, **{x: -c for x, c in after.items()}}, dur[v])
    # symmetry breaking: in a class of interchangeable devices, device j hosts op k
    # only if the class's previous device hosts an op before k
    if opts.symmetry_breaking:
        classes = hw.interchangeable_classes(
            [e.nbytes for e in og.edges], fixed=set(pinned.values())
        )
        free_ops = [k for k, op in enumerate(og.ops) if op.name not in pinned]
        for cls in classes:
            for j_prev, j in zip(cls, cls[1:], strict=False):
                for pos, k in enumerate(free_ops):
                    row = {P[k][j]: 1.0}
                    for kk in free_ops[:pos]:
                        row[P[kk][j_prev]] = -1.0
                    m.le(row, 0.0)
    sol = m.solve(time_limit=opts.time_limit_s, mip_rel_gap=opts.gap, verbose=opts.verbose)
    size = {
        "ops": n_ops,
        "edges": len(og.edges),
        "tasks": n_tasks,
        "devices": n_dev,
        "pairs": n_pairs,
        "binaries": m.num_integer,
        "variables": m.num_vars,
        "rows": m.num_rows,
        "nodes": int(sol.nodes or 0),
        "ilps": 1,
    }
    bound = None if sol.bound is None else sol.bound * tu
    if sol.bound is not None:
        bound = max(bound, lower)
    if not sol.has_solution:
        if sol.status == "infeasible" and target is None:
            raise ConfigError("DLPlacer: no placement satisfies the memory limits")
        if incumbent is None:
            raise ConfigError(f"DLPlacer found no placement within {opts.time_limit_s:g} s")
        incumbent.size = size
        if sol.status == "infeasible":
            # nothing at or below the target exists: the optimum lies above it
            incumbent.status, incumbent.bound = "optimal", max(target, lower)
        else:
            incumbent.status, incumbent.bound = "limit", max(bound or 0.0, lower)
        incumbent.gap = max(0.0, 1 - incumbent.bound / incumbent.makespan)
        return incumbent
    x = sol.x
    assign = {
        og.ops[k].name: hw.devices[max(range(n_dev), key=lambda n: x[P[k][n]])]
        for k in range(n_ops)
    }
    # Re-time the ILP's order with the fastest routes (never later than the ILP's times).
    result = retime(og, hw, assign, [float(x[T[i]]) * tu for i in range(n_tasks)], "ilp")
    result.status = "optimal" if sol.status == "optimal" else "limit"
    result.bound = bound
    result.gap = (
        None if bound is None else max(0.0, 1 - bound / result.makespan) if result.makespan else 0.0
    )
    result.size = size
    return result


# -- decomposition at cut ops ------------------------------------------------------------


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


def _place_by_blocks(
    og: OpGraph, hw: HardwareGraph, cuts: list[str], opts: PlacerOptions
) -> Placement:
    blocks = _blocks(og, cuts)
    class_idx = (
        hw.interchangeable_classes([e.nbytes for e in og.edges]) if opts.symmetry_breaking else []
    )
    classes = [[hw.devices[i] for i in c] for c in class_idx]
    devs = hw.devices
    subs = [_sub_graph(og, b) for b in blocks]
    # Every (block, boundary devices) subproblem the dynamic programme needs, up to symmetry.
    needed: list[tuple[int, tuple]] = []
    for bi, block in enumerate(blocks):
        ins = devs if block.entry else [None]
        outs = devs if block.exit else [None]
        for d_in in ins:
            for d_out in outs:
                key = (bi, _canonical((d_in, d_out), classes)[0])
                if key not in needed:
                    needed.append(key)
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
        sub_opts = PlacerOptions(**{**opts.__dict__, "time_limit_s": share, "decompose": False})
        res = _place_whole(sub, hw, sub_opts, pins)
        solved[(bi, canon)] = res
        by_shape[shape] = (names, res)
        stats["max_block_ops"] = max(stats["max_block_ops"], len(block.ops))
        if res.size.get("ilps"):
            stats["ilps"] += 1
            stats["nodes"] += res.size.get("nodes", 0)
            stats["binaries"] = max(stats["binaries"], res.size.get("binaries", 0))

    def solve(bi: int, d_in: str | None, d_out: str | None) -> tuple[Placement, dict[str, str]]:
        canon, mapping = _canonical((d_in, d_out), classes)
        return solved[(bi, canon)], mapping

    # DP over the cut ops' devices: best[d] = (cost, lower bound, cut devices so far)
    best: dict[str, tuple[float, float, list[str]]] = {}
    for d in devs:
        p, _ = solve(0, None, d)
        best[d] = (p.makespan, _bound(p), [d])
    for bi in range(1, len(blocks) - 1):
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
    last = len(blocks) - 1
    finals = []
    lbs = []
    for d in devs:
        p, _ = solve(last, d, None)
        finals.append((best[d][0] + p.makespan, d))
        lbs.append(best[d][1] + _bound(p))
    total, d_last = min(finals, key=lambda c: c[0])
    cut_devices = best[d_last][2]
    # Assemble the assignment and each task's window in time (see _window).
    assign: dict[str, str] = dict(zip(cuts, cut_devices, strict=True))
    order_key: dict[tuple[str, str], tuple[int, float]] = {}
    n_cuts = len(cuts)
    all_optimal = True
    for bi, block in enumerate(blocks):
        d_in = cut_devices[bi - 1] if bi > 0 else None
        d_out = cut_devices[bi] if bi < n_cuts else None
        p, mapping = solve(bi, d_in, d_out)
        all_optimal &= p.status == "optimal"
        for name in block.ops:
            assign[name] = mapping.get(p.assignment[name], p.assignment[name])
        for t in p.schedule:
            if t.op in block.ops:
                order_key[(t.op, t.phase)] = (_window(bi, t.phase, n_cuts, og.training), t.start)
    for j, c in enumerate(cuts, start=1):
        order_key[(c, "fwd")] = (2 * j - 1, 0.0)
        order_key[(c, "bwd")] = (4 * n_cuts - 2 * j + 1, 0.0)
    tasks, tedges = tasks_of(og)
    topo = {v: i for i, v in enumerate(topo_order(len(tasks), tedges))}
    ranked = sorted(
        range(len(tasks)),
        key=lambda i: (*order_key[(og.ops[tasks[i].op].name, tasks[i].phase)], topo[i]),
    )
    start = [0.0] * len(tasks)
    for pos, i in enumerate(ranked):
        start[i] = float(pos)
    result = retime(og, hw, assign, start, "ilp+blocks")
    fixed = sum(og.op(c).forward_s + (og.op(c).backward_s if og.training else 0.0) for c in cuts)
    bound = min(lbs) + fixed
    result.bound = bound
    result.gap = max(0.0, 1 - bound / result.makespan) if result.makespan > 0 else 0.0
    # Each block within its gap makes the sum within it; a block cut short may still
    # leave the whole within the requested gap.
    result.status = "optimal" if all_optimal or result.gap <= opts.gap + 1e-12 else "limit"
    result.size = {
        "ops": len(og.ops),
        "edges": len(og.edges),
        "devices": len(devs),
        "blocks": len(blocks),
        "cut_ops": n_cuts,
        **stats,
    }
    if abs(result.makespan - (total + fixed)) > 1e-6 * max(result.makespan, 1e-12):
        raise AssertionError(
            f"block decomposition inconsistent: schedule {result.makespan} vs sum {total + fixed}"
        )
    return result


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


# -- coarsening ----------------------------------------------------------------------------


def coarsen(og: OpGraph, max_ops: int | None = None) -> OpGraph:
    """Merge chains (an op whose only consumer has it as only producer) into one op.

    With ``max_ops``, keep contracting the edge with the least work on its two
    ends (skipping edges whose contraction would close a cycle) until at most
    ``max_ops`` remain. Contraction keeps ops together, so the coarse optimum
    bounds the fine one from above; a chain runs back to back on one device
    unless memory pulls it apart, so merging chains rarely costs anything.
    """
    ops = {op.name: op for op in og.ops}
    order = [op.name for op in og.ops]
    edges = [Edge(e.src, e.dst, e.nbytes) for e in og.edges]

    def merge(a: str, b: str) -> None:
        """Fold op ``b`` into op ``a`` (a precedes b in the order)."""
        oa, ob = ops[a], ops[b]
        ops[a] = Op(
            name=a,
            forward_s=oa.forward_s + ob.forward_s,
            backward_s=oa.backward_s + ob.backward_s,
            memory_bytes=oa.memory_bytes + ob.memory_bytes,
            members=oa.members + ob.members,
            kind=oa.kind if oa.kind == ob.kind else "group",
        )
        del ops[b]
        order.remove(b)
        merged: dict[tuple[str, str], float] = {}
        for e in edges:
            s, d = (a if e.src == b else e.src), (a if e.dst == b else e.dst)
            if s != d:
                merged[(s, d)] = merged.get((s, d), 0.0) + e.nbytes
        edges[:] = [Edge(s, d, nb) for (s, d), nb in merged.items()]

    # Chains, in one pass: merging a chain changes no other op's degree.
    outs: dict[str, list[str]] = {n: [] for n in ops}
    ins: dict[str, list[str]] = {n: [] for n in ops}
    for e in edges:
        outs[e.src].append(e.dst)
        ins[e.dst].append(e.src)
    for a in list(order):
        if a not in ops:
            continue
        tail = a
        while len(outs[tail]) == 1 and len(ins[outs[tail][0]]) == 1:
            nxt = outs[tail][0]
            merge(a, nxt)
            tail = nxt
    while max_ops is not None and len(ops) > max(1, max_ops):
        pos = {name: i for i, name in enumerate(order)}
        reach = _reach(order, edges)
        best = None
        for e in edges:
            # contracting (u, w) closes a cycle iff another path u -> x -> ... -> w exists
            others = [x.dst for x in edges if x.src == e.src and x.dst != e.dst]
            if any((reach[x] >> pos[e.dst]) & 1 for x in others):
                continue
            work = _work(ops[e.src]) + _work(ops[e.dst])
            if best is None or work < best[0]:
                best = (work, e.src, e.dst)
        if best is None:
            break
        merge(best[1], best[2])
    return OpGraph([ops[n] for n in order], edges, training=og.training)


def _work(op: Op) -> float:
    return op.forward_s + op.backward_s


def _reach(order: list[str], edges: list[Edge]) -> dict[str, int]:
    """Bitset (by position in ``order``) of each op and everything after it."""
    pos = {name: i for i, name in enumerate(order)}
    succs: dict[str, list[str]] = {n: [] for n in order}
    for e in edges:
        succs[e.src].append(e.dst)
    reach: dict[str, int] = {}
    for v in reversed(order):
        bits = 1 << pos[v]
        for w in succs[v]:
            bits |= reach[w]
        reach[v] = bits
    return reach


def speedup_bound(og: OpGraph) -> float:
    """Σ Δ / critical path: no placement on any number of devices can beat it."""
    tasks, tedges = tasks_of(og)
    head, tail = heads_tails(tasks, tedges)
    crit = max((h + t.duration + x for h, t, x in zip(head, tasks, tail, strict=True)), default=0.0)
    return og.serial_time() / crit if crit > 0 else 1.0


def pipeline_placement(og: OpGraph, hw: HardwareGraph) -> Placement:
    """Contiguous stages of the op order with balanced work (GPipe-style partitioning).

    Stage boundaries are placed where the running sum of forward + backward
    time crosses multiples of the total / M; a stage that would overflow its
    device's memory ends early. One mini-batch gains no speed from stages
    alone (that needs micro-batches); this placement is for models that do
    not fit on one device, and as a baseline for DLPlacer.
    """
    total = sum(_work(op) for op in og.ops) or 1.0
    n = len(hw.devices)
    assign: dict[str, str] = {}
    stage, done, used = 0, 0.0, 0.0
    for op in og.ops:
        over_mem = used + op.memory_bytes > hw.memory[stage] * (1 + 1e-9)
        over_work = done >= total * (stage + 1) / n - 1e-15 and done > 0
        if (over_mem or over_work) and stage < n - 1:
            stage, used = stage + 1, 0.0
        assign[op.name] = hw.devices[stage]
        used += op.memory_bytes
        done += _work(op)
    p = list_schedule(og, hw, assign)
    if p is None:
        raise ConfigError("pipeline placement: the stages do not fit in the devices' memory")
    p.method = "pipeline"
    return p
