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
    for pairs no dependency path already orders; a zero-duration task
    may touch another's interval but not fall strictly inside it       (12)
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
* **A start that fits.** When list scheduling runs out of memory although a
  placement fits, a feasibility ILP (Eqs. 7 and 13 alone) gives the
  starting placement; a HiGHS solve error is retried once without presolve,
  and a failure is reported as what HiGHS said, never as a time limit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tunekit.api import MilpModel, MilpSolution
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import Edge, Op, OpGraph
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
    topo_order,
)

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


_MIN_SOLVE_S = 0.05
"""HiGHS's share when finding a starting placement used up the time limit."""


def _place_whole(
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
    result = retime(og, hw, assign, priority, "ilp+blocks")
    fixed = sum(og.op(c).forward_s + (og.op(c).backward_s if og.training else 0.0) for c in cuts)
    bound = min(lbs) + fixed
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


def pipeline_placement(
    og: OpGraph, hw: HardwareGraph, units: Mapping[str, str] | None = None
) -> Placement:
    """Contiguous stages of the op order with balanced work (GPipe-style partitioning).

    Stage boundaries are placed where the running sum of forward + backward
    time crosses multiples of the total / M; a stage that would overflow its
    device's memory ends early. One mini-batch gains no speed from stages
    alone (that needs micro-batches); this placement is for models that do
    not fit on one device, for jobs whose replicas' all-reduce costs more than
    a waiting device, and as a baseline for DLPlacer.

    With ``units`` (op -> the transformer block it lies in: the plugin's ``op_units``) a
    stage ends only between two units, so no block is cut across devices (a cut
    inside one sends the residual stream and the branch both). A unit (without
    units: each op) goes to the stage that holds most of its work.
    """
    units = units or {}
    runs: list[list[Op]] = []  # maximal runs of ops of one unit (an op outside any: alone)
    for op in og.ops:
        if runs and units.get(op.name, op.name) == units.get(runs[-1][-1].name, runs[-1][-1].name):
            runs[-1].append(op)
        else:
            runs.append([op])
    total = sum(_work(op) for op in og.ops) or 1.0
    n = len(hw.devices)
    assign: dict[str, str] = {}
    stage, done, used = 0, 0.0, 0.0
    for run in runs:
        work = sum(_work(op) for op in run)
        memory = sum(op.memory_bytes for op in run)
        over_mem = used + memory > hw.memory[stage] * (1 + 1e-9) and used > 0
        past_half = done + work / 2 > total * (stage + 1) / n and done > 0
        if (over_mem or past_half) and stage < n - 1:
            stage, used = stage + 1, 0.0
        for op in run:
            assign[op.name] = hw.devices[stage]
        used += memory
        done += work
    p = list_schedule(og, hw, assign)
    if p is None:
        raise ConfigError("pipeline placement: the stages do not fit in the devices' memory")
    p.method = "pipeline"
    return p
