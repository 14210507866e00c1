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

with HiGHS through ``scipy.optimize.milp``
(:mod:`~tunekit.plugins.hybrid_mp.placer_ilp` builds and solves it). Beyond the paper:

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
* **Decomposition at cut ops** (:mod:`~tunekit.plugins.hybrid_mp.decompose`).
  An op that every other op precedes or follows, and that no edge jumps over (Inception's concats, ResNet's adds),
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
from collections.abc import Mapping
from dataclasses import dataclass

from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.decompose import cut_ops, place_by_blocks
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import Edge, Op, OpGraph
from tunekit.plugins.hybrid_mp.placer_ilp import place_whole
from tunekit.plugins.hybrid_mp.schedule import Placement, heads_tails, list_schedule, tasks_of

__all__ = ["PlacerOptions", "coarsen", "pipeline_placement", "place", "speedup_bound"]


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
            result = place_by_blocks(og, hw, cuts, opts)
            result.solve_s = time.perf_counter() - start
            return result
    return place_whole(og, hw, opts, pinned or {})


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


# -- bounds and stages ---------------------------------------------------------------------


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

    With ``units`` (op -> the transformer block it lies in: ``inputs.op_units``) a
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
