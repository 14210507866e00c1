"""DLPlacer's ILP for one graph: a starting placement, bounds on the makespan, the model
built one constraint family at a time (Eqs. 7 to 13 of Pal et al.; see
:mod:`~tunekit.plugins.hybrid_mp.search`), HiGHS, and what its answer proves."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tunekit.api import MilpModel, MilpSolution
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import OpGraph
from tunekit.plugins.hybrid_mp.schedule import (
    Placement,
    Task,
    TaskEdge,
    descendants,
    device_order_key,
    heads_tails,
    improve,
    list_schedule,
    retime,
    tasks_of,
)

if TYPE_CHECKING:  # search imports this module to place
    from tunekit.plugins.hybrid_mp.search import PlacerOptions

__all__ = ["place_whole"]


_MIN_SOLVE_S = 0.05
"""HiGHS's share when finding a starting placement used up the time limit."""


def place_whole(
    og: OpGraph, hw: HardwareGraph, opts: PlacerOptions, pinned: Mapping[str, str]
) -> Placement:
    """One ILP for the whole graph, started from the best heuristic placement."""
    start = time.perf_counter()
    incumbent = _incumbent(og, hw, pinned, opts)
    free_ops = [op for op in og.ops if op.name not in pinned]
    if len(hw.devices) == 1 or not free_ops:
        if incumbent is None:
            raise ConfigError("DLPlacer: no placement satisfies the memory limits")
        # Nothing to choose: the schedule of a fixed placement without conflicts is exact.
        if len(hw.devices) == 1 or all(t.end == t.start for t in incumbent.schedule):
            incumbent.status, incumbent.gap, incumbent.bound = "optimal", 0.0, incumbent.makespan
            incumbent.solve_s = time.perf_counter() - start
            return incumbent
    time_left = max(opts.time_limit_s - (time.perf_counter() - start), _MIN_SOLVE_S)
    result = _solve_ilp(og, hw, incumbent, opts, pinned, time_left)
    result.solve_s = time.perf_counter() - start
    return result


def _incumbent(
    og: OpGraph, hw: HardwareGraph, pinned: Mapping[str, str], opts: PlacerOptions
) -> Placement | None:
    """The better of list scheduling (improved by local search) and everything on one device.

    List scheduling places greedily and can run out of memory where a placement
    exists; it then starts from an assignment that fits (:func:`_fitting_assignment`).
    """
    best = list_schedule(og, hw, pinned)
    if best is None:
        best = list_schedule(og, hw, _fitting_assignment(og, hw, pinned, opts))
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


def _fitting_assignment(
    og: OpGraph, hw: HardwareGraph, pinned: Mapping[str, str], opts: PlacerOptions
) -> dict[str, str]:
    """Some assignment of every op to a device within the devices' memory: Eqs. (7) and
    (13) alone, a feasibility ILP (no times, no objective) that HiGHS answers in moments.

    Raises ConfigError when none exists (proven) or HiGHS cannot tell.
    """
    m = MilpModel()
    P = [[m.binary(f"P[{op.name},{d}]") for d in hw.devices] for op in og.ops]
    _add_one_device_per_op(m, P, og, hw, pinned)
    _add_memory_limits(m, P, og, hw)
    sol = _run_highs(m, opts.time_limit_s, opts.gap, opts.verbose)
    if sol.status == "infeasible":
        raise ConfigError("DLPlacer: no placement satisfies the memory limits")
    if not sol.has_solution:
        raise ConfigError(f"DLPlacer: no placement that fits in memory: {_highs_said(sol)}")
    return _assignment(sol.x, P, og, hw)


@dataclass
class _Horizon:
    """What bounds the makespan before solving."""

    critical: float
    """The longest zero-communication path: no placement beats it."""
    lower: float
    """Proven lower bound: the critical path, or the work spread over every device."""
    horizon: float
    """An upper bound on the optimal makespan (or the target the ILP must beat)."""
    target: float | None
    """The makespan a solution must reach to beat the incumbent clearly; None: no incumbent."""


def _horizon(
    og: OpGraph,
    hw: HardwareGraph,
    tasks: list[Task],
    tedges: list[TaskEdge],
    head: list[float],
    tail: list[float],
    incumbent: Placement | None,
    opts: PlacerOptions,
) -> _Horizon:
    critical = max(h + t.duration + tl for h, t, tl in zip(head, tasks, tail, strict=True))
    # A serial schedule that waits out every transfer on its slowest route is feasible.
    worst = [
        max(
            (hw.delay(a, b, e.nbytes) for a in hw.devices for b in hw.devices if a != b),
            default=0.0,
        )
        for e in og.edges
    ]
    work = sum(t.duration for t in tasks)
    horizon = work + sum(worst[te.edge] for te in tedges if te.edge is not None)
    lower = max(critical, work / len(hw.devices))
    target = None
    if incumbent is not None and opts.heuristic_bound:
        # Ask only for a solution clearly better than the incumbent: if none exists the
        # incumbent is proven within gap / 2 of optimal, usually faster than closing the gap.
        target = incumbent.makespan * (1 - opts.gap / 2)
        horizon = min(horizon, target)
    horizon = max(horizon, critical) * (1 + 1e-7)  # slack for the solver's tolerances
    return _Horizon(critical, lower, horizon, target)


@dataclass
class _Ilp:
    """DLPlacer's ILP under construction: the model and the variables its constraint
    families share. Times are in units of ``tu`` (horizon / 1000), so the solver sees
    numbers of order one."""

    og: OpGraph
    hw: HardwareGraph
    tasks: list[Task]
    tedges: list[TaskEdge]
    tu: float
    dur: list[float]
    """Task durations in units of ``tu``."""
    reach: list[int]
    """Bitset of each task's descendants."""
    m: MilpModel
    P: list[list[int]]
    """P(k, n): op k runs on device n."""
    T: list[int]
    """T(i): start of task i."""
    cmax: int


def _new_ilp(
    og: OpGraph,
    hw: HardwareGraph,
    tasks: list[Task],
    tedges: list[TaskEdge],
    head: list[float],
    tail: list[float],
    bounds: _Horizon,
) -> _Ilp:
    """Variables P, T and C_max, each start boxed by its zero-communication head and tail."""
    tu = bounds.horizon / 1000.0 if bounds.horizon > 0 else 1.0
    hz = bounds.horizon / tu
    dur = [t.duration / tu for t in tasks]
    m = MilpModel()
    P = [[m.binary(f"P[{op.name},{d}]") for d in hw.devices] for op in og.ops]
    T = []
    for i, t in enumerate(tasks):
        earliest, latest = head[i] / tu, hz - dur[i] - tail[i] / tu
        T.append(m.var(f"T[{og.ops[t.op].name}/{t.phase}]", earliest, max(earliest, latest)))
    cmax = m.var("Cmax", bounds.critical / tu, hz)
    m.minimise({cmax: 1.0})
    reach = descendants(len(tasks), tedges)
    return _Ilp(og, hw, tasks, tedges, tu, dur, reach, m, P, T, cmax)


def _solve_ilp(
    og: OpGraph,
    hw: HardwareGraph,
    incumbent: Placement | None,
    opts: PlacerOptions,
    pinned: Mapping[str, str],
    time_limit_s: float,
) -> Placement:
    """DLPlacer's ILP, built one constraint family at a time, solved by HiGHS."""
    tasks, tedges = tasks_of(og)
    head, tail = heads_tails(tasks, tedges)
    bounds = _horizon(og, hw, tasks, tedges, head, tail, incumbent, opts)
    if bounds.target is not None and incumbent.makespan * (1 - opts.gap) <= bounds.lower:
        incumbent.status, incumbent.bound = "optimal", bounds.lower
        incumbent.gap = _relative_gap(bounds.lower, incumbent.makespan)
        incumbent.size = {"ops": len(og.ops), "edges": len(og.edges), "ilps": 0}
        return incumbent
    ilp = _new_ilp(og, hw, tasks, tedges, head, tail, bounds)
    _add_one_device_per_op(ilp.m, ilp.P, og, hw, pinned)
    _add_memory_limits(ilp.m, ilp.P, og, hw)
    delays = _add_routing(ilp, opts)
    _add_precedence(ilp, delays)
    n_pairs = _add_no_overlap(ilp)
    if opts.load_cuts:
        _add_load_cuts(ilp)
    if opts.symmetry_breaking:
        _add_symmetry_breaking(ilp, pinned)
    sol = _run_highs(ilp.m, time_limit_s, opts.gap, opts.verbose)
    size = {
        "ops": len(og.ops),
        "edges": len(og.edges),
        "tasks": len(tasks),
        "devices": len(hw.devices),
        "pairs": n_pairs,
        "binaries": ilp.m.num_integer,
        "variables": ilp.m.num_vars,
        "rows": ilp.m.num_rows,
        "nodes": int(sol.nodes or 0),
        "ilps": 1,
    }
    bound = None if sol.bound is None else max(sol.bound * ilp.tu, bounds.lower)
    if not sol.has_solution:
        result = _without_solution(sol, incumbent, bounds, bound, time_limit_s)
    else:
        result = _from_solution(sol, ilp)
        result.status = {"optimal": "optimal", "limit": "limit"}.get(sol.status, "heuristic")
        if result.status == "heuristic":
            result.note = _highs_said(sol)
        result.bound = bound
        result.gap = _relative_gap(bound, result.makespan)
    result.size = size
    return result


def _relative_gap(bound: float | None, makespan: float) -> float | None:
    if bound is None:
        return None
    return max(0.0, 1 - bound / makespan) if makespan else 0.0


def _from_solution(sol: MilpSolution, ilp: _Ilp) -> Placement:
    """The ILP's placement, re-timed in the ILP's run order on each device with the
    fastest routes (never later than the ILP's own times)."""
    x = sol.x
    assign = _assignment(x, ilp.P, ilp.og, ilp.hw)
    priority = []
    for i, d in enumerate(ilp.dur):
        start = float(x[ilp.T[i]])
        priority.append(device_order_key(start, start + d))
    return retime(ilp.og, ilp.hw, assign, priority, "ilp")


def _without_solution(
    sol: MilpSolution,
    incumbent: Placement | None,
    bounds: _Horizon,
    solver_bound: float | None,
    time_limit_s: float,
) -> Placement:
    """The incumbent, labelled with what the solver proved, when HiGHS found nothing better.

    Raises ConfigError when there is no incumbent either, saying what HiGHS said: a
    time limit only when it was reached.
    """
    if incumbent is None:
        if sol.status == "infeasible":
            raise ConfigError("DLPlacer: no placement satisfies the memory limits")
        if sol.status == "limit":
            raise ConfigError(
                f"DLPlacer found no placement within {time_limit_s:g} s ({_highs_said(sol)})"
            )
        raise ConfigError(f"DLPlacer found no placement: {_highs_said(sol)}")
    if sol.status == "infeasible" and bounds.target is not None:
        # nothing at or below the target exists: the optimum lies above it
        incumbent.status, incumbent.bound = "optimal", max(bounds.target, bounds.lower)
    elif sol.status == "limit":
        incumbent.status, incumbent.bound = "limit", max(solver_bound or 0.0, bounds.lower)
    else:
        # The solver failed (or called a model infeasible that the incumbent satisfies):
        # nothing is proven beyond the bounds known before solving.
        incumbent.status, incumbent.bound = "heuristic", bounds.lower
        incumbent.note = _highs_said(sol)
    incumbent.gap = _relative_gap(incumbent.bound, incumbent.makespan)
    return incumbent


def _run_highs(m: MilpModel, time_limit_s: float, gap: float, verbose: bool) -> MilpSolution:
    """Solve with HiGHS; after a solve error, once more without presolve in the time left.

    HiGHS's MIP presolve can end in "Solve error" within milliseconds on a small,
    well-scaled DLPlacer model that solves to optimality without it (issue 16: four
    ops on two devices with a binding memory limit). An error proves nothing, so it
    is never read as infeasibility or as a time limit.
    """
    start = time.perf_counter()
    sol = m.solve(time_limit=time_limit_s, mip_rel_gap=gap, verbose=verbose)
    left = time_limit_s - (time.perf_counter() - start)
    if sol.status == "error" and left > 0:
        first = sol.message
        sol = m.solve(time_limit=left, mip_rel_gap=gap, presolve=False, verbose=verbose)
        sol.message = f"{first}; without presolve: {sol.message}"
        sol.time_s = time.perf_counter() - start
    return sol


def _highs_said(sol: MilpSolution) -> str:
    """HiGHS's verdict in one line: status, message and time."""
    return f"HiGHS ended '{sol.status}' after {sol.time_s:.2f} s: {sol.message}"


def _assignment(
    x: Sequence[float], P: list[list[int]], og: OpGraph, hw: HardwareGraph
) -> dict[str, str]:
    """Op name -> the device whose P(k, n) is largest in the solution."""
    n_dev = len(hw.devices)
    return {
        op.name: hw.devices[max(range(n_dev), key=lambda n: x[P[k][n]])]
        for k, op in enumerate(og.ops)
    }


# -- the constraint families -------------------------------------------------------------


def _add_one_device_per_op(
    m: MilpModel, P: list[list[int]], og: OpGraph, hw: HardwareGraph, pinned: Mapping[str, str]
) -> None:
    """(7) Σ_n P(k, n) = 1, with pinned ops fixed to their device."""
    dev_idx = {d: i for i, d in enumerate(hw.devices)}
    for k, op in enumerate(og.ops):
        m.eq({P[k][n]: 1.0 for n in range(len(hw.devices))}, 1.0)
        if op.name in pinned:
            for n in range(len(hw.devices)):
                m.fix(P[k][n], 1.0 if n == dev_idx[pinned[op.name]] else 0.0)


def _add_memory_limits(m: MilpModel, P: list[list[int]], og: OpGraph, hw: HardwareGraph) -> None:
    """(13) Σ_k P(k, n) M(k) ≤ Mem(n), in units of the largest device's memory."""
    mu = max(hw.memory)
    for n, mem in enumerate(hw.memory):
        m.le({P[k][n]: op.memory_bytes / mu for k, op in enumerate(og.ops)}, mem / mu)


def _add_routing(ilp: _Ilp, opts: PlacerOptions) -> list[dict[int, float]]:
    """(8)(9) routing as directed flow conservation over the hardware graph; returns
    (11) each edge's delay Δ_e as a linear form in the routing variables C(e, l)."""
    m, hw, P = ilp.m, ilp.hw, ilp.P
    idx = ilp.og.index()
    dev_idx = {d: i for i, d in enumerate(hw.devices)}
    arcs_for: dict[float, list[int]] = {}
    delay_terms: list[dict[int, float]] = []
    for e in ilp.og.edges:
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
        delay_terms.append({var: hw.arcs[a].time(e.nbytes) / ilp.tu for a, var in C.items()})
    return delay_terms


def _add_precedence(ilp: _Ilp, delay_terms: list[dict[int, float]]) -> None:
    """(10) T(dst) ≥ T(src) + Δ(src) + Δ_e, data edges paying their transfer (gradients
    go back the same way); C_max ≥ T(k) + Δ(k) for the tasks nothing follows."""
    m, T, dur = ilp.m, ilp.T, ilp.dur
    has_succ = [False] * len(ilp.tasks)
    for te in ilp.tedges:
        has_succ[te.src] = True
        row = {T[te.dst]: 1.0, T[te.src]: -1.0}
        if te.edge is not None:
            for var, coef in delay_terms[te.edge].items():
                row[var] = row.get(var, 0.0) - coef
        m.ge(row, dur[te.src])
    for i, followed in enumerate(has_succ):
        if not followed:
            m.ge({ilp.cmax: 1.0, T[i]: -1.0}, dur[i])


def _add_no_overlap(ilp: _Ilp) -> int:
    """(12) no two tasks overlap on a device, for pairs no dependency path orders; returns
    the number of pairs.

    Per pair an order binary y and a big-M: y = 1 puts b after a, y = 0 a after b, both
    enforced only when the pair shares a device (s = 1). A zero-duration task takes part:
    "a before b" then reads T(b) ≥ T(a) + 0 and "b before a" T(a) ≥ T(b) + Δ(b), so it may
    touch the other task's start or end (the rows are ≥, never >) but not fall strictly
    inside it, as a one-stream executor cannot run it there. Two zero-duration tasks
    never conflict and get no pair.
    """
    m, tasks, dur, T = ilp.m, ilp.tasks, ilp.dur, ilp.T
    same: dict[tuple[int, int], int] = {}
    n_pairs = 0
    for a in range(len(tasks)):
        for b in range(a + 1, len(tasks)):
            if (dur[a] <= 0 and dur[b] <= 0) or tasks[a].op == tasks[b].op:
                continue
            if (ilp.reach[a] >> b) & 1 or (ilp.reach[b] >> a) & 1:
                continue
            lb_a, ub_a = m.bounds(T[a])
            lb_b, ub_b = m.bounds(T[b])
            # The smallest valid big-Ms: with M1 relaxed, T(b) - T(a) ≥ Δ(a) - M1 = lb_b - ub_a
            # holds for any times in the windows (likewise M2); Δ = 0 needs no special case.
            m1 = dur[a] + ub_a - lb_b  # for "a before b"
            m2 = dur[b] + ub_b - lb_a  # for "b before a"
            if m1 <= 0 or m2 <= 0:
                continue  # the time windows already order the pair
            s = _shared_device(ilp, same, tasks[a].op, tasks[b].op)
            y = m.binary(f"Y[{a},{b}]")
            m.ge({T[b]: 1.0, T[a]: -1.0, y: -m1, s: -m1}, dur[a] - 2 * m1)
            m.ge({T[a]: 1.0, T[b]: -1.0, y: m2, s: -m2}, dur[b] - m2)
            n_pairs += 1
    return n_pairs


def _shared_device(ilp: _Ilp, same: dict[tuple[int, int], int], k1: int, k2: int) -> int:
    """S(i, j) ≥ P(i, n) + P(j, n) - 1 for every device: 1 when ops i and j share one
    (continuous; the big-M rows push it down to exactly that)."""
    i, j = sorted((k1, k2))
    if (i, j) not in same:
        names = ilp.og.ops
        s = ilp.m.var(f"S[{names[i].name},{names[j].name}]", 0.0, 1.0)
        for n in range(len(ilp.hw.devices)):
            ilp.m.ge({s: 1.0, ilp.P[i][n]: -1.0, ilp.P[j][n]: -1.0}, -1.0)
        same[(i, j)] = s
    return same[(i, j)]


def _add_load_cuts(ilp: _Ilp) -> None:
    """Valid inequalities: a device runs one task at a time, so a task cannot start before
    its ancestors placed on any one device have run, nor end later than C_max less its
    descendants' work there; with no task given, the device's whole load bounds C_max."""
    m, T, dur, reach = ilp.m, ilp.T, ilp.dur, ilp.reach
    n_tasks = len(ilp.tasks)
    ancestors = [0] * n_tasks
    for a in range(n_tasks):
        for b in range(n_tasks):
            if (reach[a] >> b) & 1:
                ancestors[b] |= 1 << a

    def load(bits: int, n: int) -> dict[int, float]:
        row: dict[int, float] = {}
        for i in range(n_tasks):
            if (bits >> i) & 1 and dur[i] > 0:
                var = ilp.P[ilp.tasks[i].op][n]
                row[var] = row.get(var, 0.0) + dur[i]
        return row

    for n in range(len(ilp.hw.devices)):
        m.ge({ilp.cmax: 1.0, **{v: -c for v, c in load((1 << n_tasks) - 1, n).items()}}, 0.0)
        for v in range(n_tasks):
            before = load(ancestors[v], n)
            if len(before) > 1:
                m.ge({T[v]: 1.0, **{x: -c for x, c in before.items()}}, 0.0)
            after = load(reach[v], n)
            if len(after) > 1:
                m.ge({ilp.cmax: 1.0, T[v]: -1.0, **{x: -c for x, c in after.items()}}, dur[v])


def _add_symmetry_breaking(ilp: _Ilp, pinned: Mapping[str, str]) -> None:
    """In a class of interchangeable devices, device j hosts op k only if the class's
    previous device hosts an op before k."""
    og = ilp.og
    classes = ilp.hw.interchangeable_classes(
        [e.nbytes for e in og.edges], fixed=set(pinned.values())
    )
    free_ops = [k for k, op in enumerate(og.ops) if op.name not in pinned]
    for cls in classes:
        for j_prev, j in zip(cls, cls[1:], strict=False):
            for pos, k in enumerate(free_ops):
                row = {ilp.P[k][j]: 1.0}
                for kk in free_ops[:pos]:
                    row[ilp.P[kk][j_prev]] = -1.0
                ilp.m.le(row, 0.0)
