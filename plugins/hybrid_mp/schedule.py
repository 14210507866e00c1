"""Schedules of an op graph on devices: the task DAG, list scheduling, and checks.

A training step is scheduled the way the paper's framework graphs ran it:
every op k has a forward task (Δ(k) forward) and, in a training graph, a
backward task on the same device that needs the op's own forward (saved
activations) and the gradient from each consumer, sent back along the edge
with the same bytes and route. :class:`Placement` holds a placement with its
schedule and quality; :func:`list_schedule` gives a fast feasible one (the
ILP's upper bound and a fallback); :func:`check_schedule` verifies any.

A device runs one task at a time, in one stream (Eq. 12). That holds for
tasks of zero duration too (a concatenation, a pooling layer whose analytic
Δ is 0): such a task sits at an instant when no other task of its device is
running -- it may touch another task's start or end, never fall strictly
inside it -- because a one-stream executor runs it between two others, not
during one.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.hardware_graph import HardwareGraph
from tunekit.plugins.hybrid_mp.model import OpGraph

# -- tasks ---------------------------------------------------------------------------------


@dataclass
class Task:
    op: int
    phase: str  # "fwd" | "bwd"
    duration: float


@dataclass
class TaskEdge:
    src: int
    dst: int
    edge: int | None
    """Index into ``OpGraph.edges`` when data crosses it; None for an op's forward -> backward."""


def tasks_of(og: OpGraph) -> tuple[list[Task], list[TaskEdge]]:
    """The scheduled DAG: forward tasks, and for a training graph the backward tasks too."""
    idx = og.index()
    tasks = [Task(k, "fwd", op.forward_s) for k, op in enumerate(og.ops)]
    tedges = [TaskEdge(idx[e.src], idx[e.dst], i) for i, e in enumerate(og.edges)]
    if og.training:
        k_ops = len(og.ops)
        tasks += [Task(k, "bwd", op.backward_s) for k, op in enumerate(og.ops)]
        tedges += [TaskEdge(k, k_ops + k, None) for k in range(k_ops)]
        tedges += [
            TaskEdge(k_ops + idx[e.dst], k_ops + idx[e.src], i) for i, e in enumerate(og.edges)
        ]
    return tasks, tedges


def topo_order(n: int, tedges: Sequence[TaskEdge]) -> list[int]:
    """A topological order of ``n`` tasks, smallest index first among ready ones."""
    indeg = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for te in tedges:
        out[te.src].append(te.dst)
        indeg[te.dst] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        v = heapq.heappop(ready)
        order.append(v)
        for w in out[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                heapq.heappush(ready, w)
    if len(order) != n:
        raise ConfigError("op graph has a cycle")
    return order


def heads_tails(
    tasks: Sequence[Task], tedges: Sequence[TaskEdge]
) -> tuple[list[float], list[float]]:
    """Longest zero-communication path before each task's start, and after its end."""
    n = len(tasks)
    order = topo_order(n, tedges)
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for te in tedges:
        preds[te.dst].append(te.src)
        succs[te.src].append(te.dst)
    head = [0.0] * n
    for v in order:
        head[v] = max((head[u] + tasks[u].duration for u in preds[v]), default=0.0)
    tail = [0.0] * n
    for v in reversed(order):
        tail[v] = max((tasks[w].duration + tail[w] for w in succs[v]), default=0.0)
    return head, tail


def descendants(n: int, tedges: Sequence[TaskEdge]) -> list[int]:
    """Bitset of the tasks reachable from each task."""
    order = topo_order(n, tedges)
    succs: list[list[int]] = [[] for _ in range(n)]
    for te in tedges:
        succs[te.src].append(te.dst)
    reach = [0] * n
    for v in reversed(order):
        bits = 0
        for w in succs[v]:
            bits |= reach[w] | (1 << w)
        reach[v] = bits
    return reach


def device_order_key(start: float, end: float) -> float:
    """A task's place in its device's run order: the midpoint of its interval.

    Intervals on one device never overlap, so midpoints order them as their
    starts do; a zero-duration task at another's start sorts before it, one at
    its end after it, where start times alone would tie.
    """
    return (start + end) / 2


def _free_instant(busy: Sequence[tuple[float, float]], t: float) -> float:
    """The first instant at or after ``t`` not strictly inside a busy interval.

    ``busy`` holds a device's positive-duration intervals, disjoint and in
    order; a zero-duration task may touch them, never fall inside one.
    """
    i = bisect.bisect_left(busy, t, key=lambda iv: iv[0]) - 1  # last interval starting before t
    if i >= 0 and t < busy[i][1]:
        return busy[i][1]
    return t


# -- results -------------------------------------------------------------------------------


@dataclass
class ScheduledTask:
    op: str
    phase: str
    device: str
    start: float
    end: float


@dataclass
class Placement:
    """A placement of an op graph on devices, with its schedule and its quality."""

    devices: list[str]
    assignment: dict[str, str]
    """Op name -> device."""
    schedule: list[ScheduledTask]
    routes: dict[str, list[str]]
    """``src->dst`` -> hardware vertices of the fastest route, for edges that cross devices."""
    makespan: float
    serial_s: float
    """Σ_k Δ(k): the step on one device."""
    method: str
    """``ilp``, ``ilp+blocks`` (ILP per block between cut ops, joined by dynamic
    programming), ``list`` (list scheduling) or ``single`` (one device)."""
    status: str = "heuristic"
    """``optimal`` (within ``gap``), ``limit`` (time limit; best found), ``heuristic``
    (nothing proven: list scheduling, or the solver failed -- see ``note``)."""
    gap: float | None = None
    """Relative optimality gap proven by the solver (0 = optimal)."""
    bound: float | None = None
    """Proven lower bound on the makespan."""
    solve_s: float = 0.0
    size: dict[str, int] = field(default_factory=dict)
    """Problem size: ops, edges, binaries, variables, rows, nodes, blocks, ILPs."""
    members: dict[str, list[str]] = field(default_factory=dict)
    """Op name -> layer names (to map a coarsened placement back to layers)."""
    note: str = ""
    """What the solver said when it failed and this placement is the fallback."""

    @property
    def speedup(self) -> float:
        """Predicted SU^M = Σ_k Δ(k) / makespan."""
        return self.serial_s / self.makespan if self.makespan > 0 else 1.0

    @property
    def devices_used(self) -> int:
        return len(set(self.assignment.values()))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["speedup"] = self.speedup
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Placement:
        d = dict(d)
        d.pop("speedup", None)
        d["schedule"] = [ScheduledTask(**t) for t in d["schedule"]]
        return cls(**d)


def build_placement(
    og: OpGraph,
    hw: HardwareGraph,
    assign: Mapping[str, str],
    start: Sequence[float],
    method: str,
    status: str = "heuristic",
) -> Placement:
    """A :class:`Placement` from an assignment and the start time of every task."""
    tasks, _ = tasks_of(og)
    schedule = [
        ScheduledTask(
            og.ops[t.op].name, t.phase, assign[og.ops[t.op].name], float(s), float(s) + t.duration
        )
        for t, s in zip(tasks, start, strict=True)
    ]
    routes = {}
    for e in og.edges:
        a, b = assign[e.src], assign[e.dst]
        if a != b:
            routes[f"{e.src}->{e.dst}"] = hw.shortest(a, b, e.nbytes)[1]
    return Placement(
        devices=list(hw.devices),
        assignment={op.name: assign[op.name] for op in og.ops},
        schedule=schedule,
        routes=routes,
        makespan=max((t.end for t in schedule), default=0.0),
        serial_s=og.serial_time(),
        method=method,
        status=status,
        members={op.name: list(op.members) for op in og.ops},
    )


# -- list scheduling -----------------------------------------------------------------------


def list_schedule(
    og: OpGraph, hw: HardwareGraph, fixed: Mapping[str, str] | None = None
) -> Placement | None:
    """HEFT-style list scheduling: a fast feasible placement and schedule.

    Tasks go in order of decreasing upward rank (longest path to the end with
    average transfer times); an op not in ``fixed`` goes to the device, among
    those with memory left, where its forward task finishes first; its
    backward task follows it there. A zero-duration task takes the first
    instant, once its inputs are there, that no task of the device runs
    through. With every op in ``fixed`` this only schedules that placement.
    Returns None when memory admits no placement this way.
    """
    tasks, tedges = tasks_of(og)
    n = len(tasks)
    devs = hw.devices
    preds: list[list[TaskEdge]] = [[] for _ in range(n)]
    succs: list[list[TaskEdge]] = [[] for _ in range(n)]
    for te in tedges:
        preds[te.dst].append(te)
        succs[te.src].append(te)

    def avg_delay(e: int | None) -> float:
        if e is None or len(devs) < 2:
            return 0.0
        nb = og.edges[e].nbytes
        pairs = [(a, b) for a in devs for b in devs if a != b]
        return sum(hw.delay(a, b, nb) for a, b in pairs) / len(pairs)

    order = topo_order(n, tedges)
    rank = [0.0] * n
    for v in reversed(order):
        rank[v] = tasks[v].duration + max(
            (avg_delay(te.edge) + rank[te.dst] for te in succs[v]), default=0.0
        )

    def delay(a: str, b: str, e: int | None) -> float:
        return 0.0 if e is None else hw.delay(a, b, og.edges[e].nbytes)

    mem_left = dict(zip(devs, hw.memory, strict=True))
    dev_of: dict[int, str] = {}
    for k, op in enumerate(og.ops):
        if fixed and op.name in fixed:
            if fixed[op.name] not in mem_left:
                raise ConfigError(f"op {op.name} is fixed to unknown device {fixed[op.name]!r}")
            dev_of[k] = fixed[op.name]
            mem_left[dev_of[k]] -= op.memory_bytes
    if any(v < -1e-6 * max(hw.memory) for v in mem_left.values()):
        return None
    free = {d: 0.0 for d in devs}
    busy: dict[str, list[tuple[float, float]]] = {d: [] for d in devs}
    start = [0.0] * n
    end = [0.0] * n
    placed = [""] * n

    def earliest_start(v: int, d: str, avail: float) -> float:
        # A task of positive duration goes after the device's last one; a zero-duration
        # task may go earlier, at any instant no other task of the device runs through.
        if tasks[v].duration > 0:
            return max(free[d], avail)
        return _free_instant(busy[d], avail)

    indeg = [len(preds[v]) for v in range(n)]
    ready = [(-rank[v], v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(ready)
    while ready:
        _, v = heapq.heappop(ready)
        k = tasks[v].op
        if k in dev_of:
            options = [dev_of[k]]
        else:
            need = og.ops[k].memory_bytes
            options = [d for d in devs if mem_left[d] >= need - 1e-9 * max(hw.memory)]
            if not options:
                return None
        best = None
        for d in options:
            avail = max(
                (end[te.src] + delay(placed[te.src], d, te.edge) for te in preds[v]), default=0.0
            )
            s = earliest_start(v, d, avail)
            if best is None or s + tasks[v].duration < best[0] - 1e-15:
                best = (s + tasks[v].duration, s, d)
        fin, s, d = best
        if k not in dev_of:
            dev_of[k] = d
            mem_left[d] -= og.ops[k].memory_bytes
        placed[v], start[v], end[v] = d, s, fin
        if tasks[v].duration > 0:
            busy[d].append((s, fin))
        # later tasks start after this one, so none can run through its instant
        free[d] = max(free[d], fin)
        for te in succs[v]:
            indeg[te.dst] -= 1
            if indeg[te.dst] == 0:
                heapq.heappush(ready, (-rank[te.dst], te.dst))
    assign = {og.ops[k].name: d for k, d in dev_of.items()}
    return build_placement(og, hw, assign, start, "list")


def improve(
    og: OpGraph,
    hw: HardwareGraph,
    placement: Placement,
    fixed: Mapping[str, str] | None = None,
    max_sweeps: int = 4,
) -> Placement:
    """Local search: move one op at a time to the device that shortens the list schedule most.

    Cheap, and a tighter upper bound makes the ILP's big-M constants and
    horizon smaller.
    """
    best = placement
    fixed = fixed or {}
    for _ in range(max_sweeps):
        improved = False
        for op in og.ops:
            if op.name in fixed:
                continue
            for dev in hw.devices:
                if dev == best.assignment[op.name]:
                    continue
                trial = list_schedule(og, hw, {**best.assignment, op.name: dev})
                if trial is not None and trial.makespan < best.makespan * (1 - 1e-9):
                    best, improved = trial, True
        if not improved:
            break
    best.method = placement.method
    return best


def retime(
    og: OpGraph,
    hw: HardwareGraph,
    assign: Mapping[str, str],
    priority: Sequence[float],
    method: str,
) -> Placement:
    """Start every task as early as possible, each device running its tasks in ``priority`` order.

    ``priority`` ranks the tasks (lower first); from a schedule, pass
    :func:`device_order_key` of each task's interval. Every task, zero-duration
    ones included, starts once its device's previous task has ended, so the
    result is one run order per device, as an executor with one stream per
    device runs it. Transfers take their fastest routes, so no task starts
    later than in a feasible schedule with the same order.
    """
    tasks, tedges = tasks_of(og)
    n = len(tasks)
    preds: list[list[TaskEdge]] = [[] for _ in range(n)]
    for te in tedges:
        preds[te.dst].append(te)
    succs: list[list[int]] = [[] for _ in range(n)]
    for te in tedges:
        succs[te.src].append(te.dst)
    dev = [assign[og.ops[t.op].name] for t in tasks]
    topo_pos = {v: i for i, v in enumerate(topo_order(n, tedges))}
    # Kahn's algorithm led by the priorities: dependencies always hold, even where a
    # solver's tolerance put a task a hair before its predecessor.
    indeg = [len(preds[v]) for v in range(n)]
    ready = [(priority[v], topo_pos[v], v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(ready)
    new_start = [0.0] * n
    free: dict[str, float] = {}
    while ready:
        _, _, v = heapq.heappop(ready)
        at = free.get(dev[v], 0.0)
        for te in preds[v]:
            d = 0.0 if te.edge is None else hw.delay(dev[te.src], dev[v], og.edges[te.edge].nbytes)
            at = max(at, new_start[te.src] + tasks[te.src].duration + d)
        new_start[v] = at
        free[dev[v]] = at + tasks[v].duration
        for w in succs[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                heapq.heappush(ready, (priority[w], topo_pos[w], w))
    return build_placement(og, hw, assign, new_start, method, "optimal")


def check_schedule(og: OpGraph, hw: HardwareGraph, placement: Placement, tol: float = 1e-6) -> None:
    """Raise AssertionError unless the schedule obeys precedence with the fastest transfer
    times, runs one task at a time per device (a zero-duration task never strictly inside
    another's interval), and fits in memory. ``tol`` is relative to the makespan."""
    tasks, tedges = tasks_of(og)
    by_key = {(t.op, t.phase): t for t in placement.schedule}
    sched = [by_key[(og.ops[t.op].name, t.phase)] for t in tasks]
    slack = tol * max(placement.makespan, 1e-12)
    for te in tedges:
        a, b = sched[te.src], sched[te.dst]
        d = 0.0 if te.edge is None else hw.delay(a.device, b.device, og.edges[te.edge].nbytes)
        assert b.start + slack >= a.end + d, (
            f"{a.op}/{a.phase} -> {b.op}/{b.phase} starts too early"
        )
    _check_one_task_at_a_time(sched, slack)
    used: dict[str, float] = {}
    for op in og.ops:
        dev = placement.assignment[op.name]
        used[dev] = used.get(dev, 0.0) + op.memory_bytes
    for dev, mem in zip(hw.devices, hw.memory, strict=True):
        assert used.get(dev, 0.0) <= mem * (1 + 1e-9), f"{dev} is over its memory"
    assert abs(placement.makespan - max((t.end for t in sched), default=0.0)) <= slack + 1e-15


def _check_one_task_at_a_time(sched: Sequence[ScheduledTask], slack: float) -> None:
    """Eq. 12 on every device: intervals of positive length do not overlap, and no
    zero-duration task lies strictly inside one (touching an end is fine)."""
    runs: dict[str, list[ScheduledTask]] = {}
    instants: dict[str, list[ScheduledTask]] = {}
    for t in sched:
        (runs if t.end > t.start else instants).setdefault(t.device, []).append(t)
    for dev, ts in runs.items():
        ts.sort(key=lambda t: t.start)
        for x, y in zip(ts, ts[1:], strict=False):
            assert y.start + slack >= x.end, f"{x.op} and {y.op} overlap on {dev}"
        for z in instants.get(dev, []):
            inside = [x for x in ts if x.start + slack < z.start < x.end - slack]
            assert not inside, (
                f"{z.op}/{z.phase} (zero duration) at {z.start:.6g} runs during "
                f"{inside[0].op}/{inside[0].phase} [{inside[0].start:.6g}, {inside[0].end:.6g}] "
                f"on {dev}"
            )
