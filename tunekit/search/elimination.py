"""Exact minimisation of a sum of per-node and per-edge cost tables (DeePa's search).

A :class:`CostGraph` is a directed multigraph. Every node ``v`` has a finite set
of configurations ``0 .. K_v-1`` and a cost vector ``cost_v[c]``; every edge
``(u, v)`` has a table ``table[c_u, c_v]``. :func:`solve` returns the
assignment of one configuration per node minimising Eq. 1 of Jia et al.
("Exploring Hidden Dimensions in Parallelizing CNNs", DeePa)::

    Cost(g) = sum_v cost_v[g(v)] + sum_(u,v) table_(u,v)[g(u), g(v)]

It follows the paper's Section 4 and Appendix A.1:

1. **Edge elimination** (Eq. 3): parallel edges ``(u, v)`` merge into one
   whose table is the elementwise sum.
2. **Node elimination** (Eq. 2): a node ``w`` with exactly one in-edge
   ``(u, w)`` and one out-edge ``(w, v)`` is removed; the new edge ``(u, v)``
   has ``min_cw [in(c_u, c_w) + cost_w(c_w) + out(c_w, c_v)]`` -- a min-plus
   matrix product, vectorised with numpy -- and its argmin table is kept.
   Sources and sinks are never eliminated. Tables whose columns are constant
   but for at most one entry (DeePa's transfer tables: a consumer config
   costs the same from every producer config except the one that matches)
   are detected, and a product with one costs O(K^2) instead of O(K^3), with
   bit-identical results.
0. (Optional, before 1.) **Dominance pruning**, exact: a configuration of a node whose
   best case -- its own cost plus, per incident edge, the cheapest entry of
   its row -- exceeds another configuration's worst case can never be in an
   optimum (switching to the other lowers Eq. 1 whatever the neighbours do);
   it is dropped, and the rounds repeat while tables shrink.
3. The **residual graph** is solved exactly: by vectorised enumeration when
   its joint configuration space is small (the paper's case: two nodes), else
   by variable elimination (a DP over a min-fill ordering, with argmin tables),
   and where even that needs too much memory, by exact conditioning on one
   node at a time with a lower-bound cut. Nothing is ever approximated.
4. Eliminations are **undone in reverse order**: each eliminated node takes
   the argmin for its neighbours' chosen configurations.

The paper's appendix has two sign slips; the proofs hold with Eq. (4)
reading ``- sum xfer`` for the reduced graph and Eq. (6) reading
``e1.xfer + e2.xfer - e'.xfer = 0`` (see papers/NOTES.md, errata).

Pure numpy; no torch.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from tunekit.errors import TunekitError

__all__ = [
    "CostGraph",
    "EliminationError",
    "EliminationStats",
    "Solution",
    "brute_force",
    "min_plus",
    "min_plus_values",
    "prune_dominated",
    "solve",
]

Node = Hashable

# Enumerate the residual graph outright up to this many joint configurations.
ENUMERATE_LIMIT = 1 << 21
# Largest intermediate table (entries) variable elimination may build.
FACTOR_LIMIT = 1 << 25
# Rows of a min-plus product computed at once (bounds the K_u x K_w x K_v temporary).
_CHUNK_ENTRIES = 1 << 22


class EliminationError(TunekitError):
    """A cost graph is malformed (wrong table shapes, unknown nodes, NaN costs)."""


# -- the graph -------------------------------------------------------------------------


class CostGraph:
    """Per-node cost vectors and per-edge cost tables (a directed multigraph)."""

    def __init__(self) -> None:
        self._cost: dict[Node, np.ndarray] = {}
        self._edges: list[tuple[Node, Node, np.ndarray]] = []

    def add_node(self, name: Node, cost) -> None:
        """Add node ``name`` whose configuration ``c`` costs ``cost[c]`` (compute + update)."""
        if name in self._cost:
            raise EliminationError(f"node {name!r} added twice")
        arr = np.asarray(cost, dtype=np.float64).reshape(-1)
        if arr.size == 0:
            raise EliminationError(f"node {name!r} has no configurations")
        if not np.all(np.isfinite(arr)):
            raise EliminationError(f"node {name!r} has a non-finite cost")
        self._cost[name] = arr

    def add_edge(self, u: Node, v: Node, table) -> None:
        """Add an edge ``(u, v)`` whose cost is ``table[c_u, c_v]`` (parallel edges allowed)."""
        for x in (u, v):
            if x not in self._cost:
                raise EliminationError(f"edge ({u!r}, {v!r}) names unknown node {x!r}")
        if u == v:
            raise EliminationError(f"self-loop on node {u!r}")
        arr = np.asarray(table, dtype=np.float64)
        want = (self._cost[u].size, self._cost[v].size)
        if arr.shape != want:
            raise EliminationError(f"edge ({u!r}, {v!r}): table shape {arr.shape}, expected {want}")
        if not np.all(np.isfinite(arr)):
            raise EliminationError(f"edge ({u!r}, {v!r}) has a non-finite cost")
        self._edges.append((u, v, arr))

    @property
    def nodes(self) -> list[Node]:
        return list(self._cost)

    @property
    def edges(self) -> list[tuple[Node, Node, np.ndarray]]:
        return list(self._edges)

    def node_cost(self, name: Node) -> np.ndarray:
        return self._cost[name]

    def num_configs(self, name: Node) -> int:
        return int(self._cost[name].size)

    def evaluate(self, assignment: Mapping[Node, int]) -> float:
        """Eq. 1: the cost of one configuration per node."""
        missing = [v for v in self._cost if v not in assignment]
        if missing:
            raise EliminationError(f"assignment lacks node {missing[0]!r}")
        total = sum(float(c[assignment[v]]) for v, c in self._cost.items())
        total += sum(float(t[assignment[u], assignment[v]]) for u, v, t in self._edges)
        return total


@dataclass
class EliminationStats:
    """What the search did, for reports and benchmarks."""

    nodes_before: int
    edges_before: int
    nodes_after: int = 0
    """Nodes left once neither elimination applies (2 for series-parallel graphs)."""
    edges_after: int = 0
    node_eliminations: int = 0
    edge_eliminations: int = 0
    residual_method: str = ""
    """``enumeration``, ``variable-elimination`` or ``conditioning``."""
    residual_configs: int = 0
    """Joint configurations of the residual graph (what enumeration would visit)."""
    configs_before: int = 0
    """Sum over nodes of their configurations ..."""
    configs_after_pruning: int = 0
    """... and what dominance pruning left."""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Solution:
    assignment: dict[Node, int]
    """Configuration index chosen for every node."""
    cost: float
    """Eq. 1 of the assignment."""
    stats: EliminationStats = field(repr=False)
    """What the search did (every solver fills it in)."""


# -- min-plus product --------------------------------------------------------------------


def min_plus_values(left: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``out[i, j] = min_k left[i, k] + b[k, j]`` (the values only; argmins come on demand).

    The reduction runs over the leading axis of a ``(K_w, K_u, K_v)`` block, the
    order numpy reduces fastest; blocks are chunked to bound memory.
    """
    ku, kw = left.shape
    kv = b.shape[1]
    if kw == 1:
        return left + b
    lt = np.ascontiguousarray(left.T)
    rows = max(1, _CHUNK_ENTRIES // max(1, kw * kv))
    out = np.empty((ku, kv))
    buf = np.empty((kw, min(rows, ku), kv))
    for lo in range(0, ku, rows):
        hi = min(ku, lo + rows)
        block = buf[:, : hi - lo, :]
        np.add(lt[:, lo:hi, None], b[:, None, :], out=block)
        block.min(axis=0, out=out[lo:hi])
    return out


@dataclass
class _Sparse:
    """``t[i, j] == col[j]`` except at ``i == exc[j]`` (``-1``: no exception in column j)."""

    col: np.ndarray
    exc: np.ndarray
    injective: bool
    """No two columns have their exception in the same row."""


def _structure(t: np.ndarray) -> _Sparse | None:
    ku = t.shape[0]
    if ku < 3 or t.shape[1] < 2:
        return None
    # With at most one odd entry per column, two of its first three entries are the common value.
    common = np.where((t[0] == t[1]) | (t[0] == t[2]), t[0], t[1])
    odd = t != common
    counts = odd.sum(axis=0)
    if counts.max() > 1:
        return None
    exc = np.where(counts == 1, odd.argmax(axis=0), -1)
    rows = exc[exc >= 0]
    injective = rows.size == 0 or np.bincount(rows).max() <= 1
    return _Sparse(common, exc, bool(injective))


def _two_smallest(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Smallest value, its index, and the second smallest value along ``axis`` (0 or 1)."""
    i1 = x.argmin(axis=axis)
    other = np.arange(x.shape[1 - axis])
    at = (other, i1) if axis == 1 else (i1, other)
    m1 = x[at]
    rest = x.copy()
    rest[at] = np.inf
    return m1, i1, rest.min(axis=axis)


def _min_plus_sparse_right(left: np.ndarray, b: np.ndarray, sb: _Sparse) -> np.ndarray:
    """``min_k left[i, k] + b[k, j]`` when ``b`` is column-constant but for one entry."""
    m1, i1, m2 = _two_smallest(left, axis=1)
    e = sb.exc
    # Off the exception row every k pays col[j]: the row's best k, or its second if the best is e[j].
    out = np.where(i1[:, None] == e[None, :], m2[:, None], m1[:, None]) + sb.col[None, :]
    has = np.nonzero(e >= 0)[0]
    if has.size:
        ek = e[has]
        cand = left[:, ek] + b[ek, has][None, :]
        out[:, has] = np.minimum(out[:, has], cand)
    return out


def _min_plus_sparse_left(a: np.ndarray, mid: np.ndarray, b: np.ndarray, sa: _Sparse) -> np.ndarray:
    """``min_k (a[i, k] + mid[k]) + b[k, j]`` when ``a`` is column-constant but for one entry
    per column, no two in one row."""
    ku = a.shape[0]
    base = (sa.col + mid)[:, None] + b  # (kw, kv): every row i pays this off its exception
    n1, j1, n2 = _two_smallest(base, axis=0)
    inv = np.full(ku, -1)
    cols = np.nonzero(sa.exc >= 0)[0]
    inv[sa.exc[cols]] = cols  # the one k whose entry is odd in row i
    out = np.where(j1[None, :] == inv[:, None], n2[None, :], n1[None, :])
    rows = np.nonzero(inv >= 0)[0]
    if rows.size:
        k = inv[rows]
        cand = (a[rows, k] + mid[k])[:, None] + b[k, :]
        out[rows] = np.minimum(out[rows], cand)
    return out


def min_plus(a: np.ndarray, mid: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``out[i, j] = min_k a[i, k] + mid[k] + b[k, j]`` and its argmin ``k`` (Eq. 2)."""
    left = a + mid[None, :]
    full = left[:, :, None] + b[None, :, :]
    return min_plus_values(left, b), full.argmin(axis=1)


# -- the search ---------------------------------------------------------------------------


@dataclass
class _Elim:
    """One node elimination, to undo: ``node`` takes ``argmin_k left[g(u), k] + right[k, g(v)]``."""

    node: Node
    u: Node
    v: Node
    left: np.ndarray
    """in-edge table plus the node's own cost, ``(K_u, K_w)``."""
    right: np.ndarray
    """out-edge table, ``(K_w, K_v)``."""

    def choose(self, cu: int, cv: int) -> int:
        return int(np.argmin(self.left[cu] + self.right[:, cv]))


class _Unknown(enum.Enum):
    """The sentinel type of an edge whose structure is not looked at yet."""

    TOKEN = 0


_UNKNOWN: Final = _Unknown.TOKEN


class _Working:
    """The graph as eliminations change it: one table per ordered pair, adjacency sets."""

    def __init__(self, graph: CostGraph):
        self.cost = {v: c.copy() for v, c in graph._cost.items()}
        self.table: dict[tuple[Node, Node], np.ndarray] = {}
        self.sparse: dict[tuple[Node, Node], _Sparse | _Unknown | None] = {}
        """Per edge: its :class:`_Sparse` structure, None (general), or not yet looked at."""
        self.succ: dict[Node, set[Node]] = {v: set() for v in self.cost}
        self.pred: dict[Node, set[Node]] = {v: set() for v in self.cost}
        self.edge_eliminations = 0
        for u, v, t in graph._edges:
            self.add(u, v, t, original=True)

    def add(self, u: Node, v: Node, t: np.ndarray, original: bool = False) -> None:
        """Insert an edge; a parallel edge is merged at once (edge elimination, Eq. 3)."""
        if (u, v) in self.table:
            self.table[(u, v)] = self.table[(u, v)] + t
            self.edge_eliminations += 1
            self.sparse[(u, v)] = None
        else:
            self.table[(u, v)] = t
            self.sparse[(u, v)] = _UNKNOWN if original else None
            self.succ[u].add(v)
            self.pred[v].add(u)

    def eliminable(self, w: Node) -> bool:
        return len(self.pred[w]) == 1 and len(self.succ[w]) == 1

    def eliminate(self, w: Node) -> _Elim:
        (u,) = self.pred[w]
        (v,) = self.succ[w]
        a, sa = self.table.pop((u, w)), self.sparse.pop((u, w))
        b, sb = self.table.pop((w, v)), self.sparse.pop((w, v))
        if sb is _UNKNOWN:  # detect a table's structure only when a product needs it
            sb = _structure(b)
        if sb is None and sa is _UNKNOWN:
            sa = _structure(a)
        self.succ[u].discard(w)
        self.pred[v].discard(w)
        del self.succ[w], self.pred[w]
        mid = self.cost.pop(w)
        left = a + mid[None, :]
        if sb is not None:
            new = _min_plus_sparse_right(left, b, sb)
        elif isinstance(sa, _Sparse) and sa.injective:
            new = _min_plus_sparse_left(a, mid, b, sa)
        else:
            new = min_plus_values(left, b)
        self.add(u, v, new)
        return _Elim(w, u, v, left, b)


def prune_dominated(graph: CostGraph, rounds: int = 4) -> tuple[CostGraph, dict[Node, np.ndarray]]:
    """The graph without configurations that cannot be optimal, and the kept indices per node."""
    keep = {v: np.arange(c.size) for v, c in graph._cost.items()}
    edges = graph._edges
    for _ in range(rounds):
        lo = {v: graph._cost[v][k].copy() for v, k in keep.items()}
        hi = {v: x.copy() for v, x in lo.items()}
        for u, v, t in edges:
            sub = t[np.ix_(keep[u], keep[v])]
            lo[u] += sub.min(axis=1)
            hi[u] += sub.max(axis=1)
            lo[v] += sub.min(axis=0)
            hi[v] += sub.max(axis=0)
        changed = False
        for v in keep:
            alive = lo[v] <= hi[v].min()
            if not alive.all():
                keep[v] = keep[v][alive]
                changed = True
        if not changed:
            break
    pruned = CostGraph()
    for v, k in keep.items():
        pruned._cost[v] = graph._cost[v][k]
    pruned._edges = [(u, v, t[np.ix_(keep[u], keep[v])]) for u, v, t in edges]
    return pruned, keep


def solve(
    graph: CostGraph,
    *,
    prune: bool = False,
    enumerate_limit: int = ENUMERATE_LIMIT,
    factor_limit: int = FACTOR_LIMIT,
) -> Solution:
    """The exact minimum of Eq. 1 over all assignments, by node/edge elimination."""
    start = time.perf_counter()
    stats = EliminationStats(nodes_before=len(graph._cost), edges_before=len(graph._edges))
    stats.configs_before = sum(c.size for c in graph._cost.values())
    if not graph._cost:
        stats.seconds = time.perf_counter() - start
        return Solution({}, 0.0, stats)
    original = graph
    keep = None
    if prune:
        graph, keep = prune_dominated(graph)
    stats.configs_after_pruning = sum(c.size for c in graph._cost.values())
    work = _Working(graph)
    undo: list[_Elim] = []
    # Worklist of candidates; an elimination only changes its two neighbours' degrees.
    pending = [v for v in work.cost if work.eliminable(v)]
    while pending:
        w = pending.pop()
        if w not in work.cost or not work.eliminable(w):
            continue
        rec = work.eliminate(w)
        undo.append(rec)
        pending.extend(x for x in (rec.u, rec.v) if work.eliminable(x))
    stats.node_eliminations = len(undo)
    stats.edge_eliminations = work.edge_eliminations
    stats.nodes_after = len(work.cost)
    stats.edges_after = len(work.table)
    assignment, method, joint = _solve_residual(work, enumerate_limit, factor_limit)
    stats.residual_method = method
    stats.residual_configs = joint
    for rec in reversed(undo):
        assignment[rec.node] = rec.choose(assignment[rec.u], assignment[rec.v])
    if keep is not None:
        assignment = {v: int(keep[v][k]) for v, k in assignment.items()}
    stats.seconds = time.perf_counter() - start
    return Solution(assignment, original.evaluate(assignment), stats)


def _solve_residual(
    work: _Working, enumerate_limit: int, factor_limit: int
) -> tuple[dict[Node, int], str, int]:
    nodes = list(work.cost)
    sizes = [work.cost[v].size for v in nodes]
    joint = math.prod(sizes)
    factors: list[tuple[tuple, np.ndarray]] = [((v,), work.cost[v]) for v in nodes]
    factors += [((u, v), t) for (u, v), t in work.table.items()]
    if joint <= enumerate_limit:
        return _enumerate(nodes, factors), "enumeration", joint
    try:
        return _variable_elimination(nodes, factors, factor_limit), "variable-elimination", joint
    except _TooLarge:
        return _condition(nodes, factors, factor_limit), "conditioning", joint


def _enumerate(nodes: list[Node], factors: list[tuple[tuple, np.ndarray]]) -> dict[Node, int]:
    """Every joint configuration at once, as one broadcast sum; its argmin."""
    axis = {v: i for i, v in enumerate(nodes)}
    total = np.zeros([1] * len(nodes))
    for scope, table in factors:
        total = total + _expand(table, scope, axis, len(nodes))
    flat = int(np.argmin(total))
    idx = np.unravel_index(flat, total.shape)
    return {v: int(idx[axis[v]]) for v in nodes}


def _expand(table: np.ndarray, scope: tuple, axis: dict, ndim: int) -> np.ndarray:
    """``table`` over ``scope`` as an array broadcastable over all ``ndim`` axes."""
    order = sorted(range(len(scope)), key=lambda i: axis[scope[i]])
    t = np.transpose(table, order)
    shape = [1] * ndim
    for i in order:
        shape[axis[scope[i]]] = table.shape[i]
    return t.reshape(shape)


class _TooLarge(Exception):
    pass


def _variable_elimination(
    nodes: list[Node], factors: list[tuple[tuple, np.ndarray]], factor_limit: int
) -> dict[Node, int]:
    """Exact DP: eliminate variables in min-size order, keeping argmin tables."""
    size: dict[Node, int] = {}  # every node has a factor: its own cost vector
    for s, t in factors:
        for v, k in zip(s, t.shape, strict=True):
            size[v] = k
    live = list(factors)
    remaining = set(nodes)
    trail: list[tuple[Node, tuple, np.ndarray]] = []
    while remaining:
        best: tuple[int, Node, set[Node]] | None = None
        for x in remaining:
            scope = {v for s, _ in live if x in s for v in s} - {x}
            cost = math.prod(size[v] for v in scope) * size[x]
            if best is None or cost < best[0]:
                best = (cost, x, scope)
        assert best is not None  # remaining is not empty
        cost, x, scope = best
        if cost > factor_limit:
            raise _TooLarge
        scope_t = tuple(sorted(scope, key=nodes.index))
        full_scope = (*scope_t, x)
        axis = {v: i for i, v in enumerate(full_scope)}
        total = np.zeros([1] * len(full_scope))
        keep = []
        for s, t in live:
            if x in s:
                total = total + _expand(t, s, axis, len(full_scope))
            else:
                keep.append((s, t))
        total = np.broadcast_to(total, [size[v] for v in full_scope])
        arg = total.argmin(axis=-1)
        reduced = np.take_along_axis(total, arg[..., None], axis=-1)[..., 0]
        trail.append((x, scope_t, arg))
        keep.append((scope_t, reduced))
        live = keep
        remaining.discard(x)
    assignment: dict[Node, int] = {}
    for x, scope_t, arg in reversed(trail):
        assignment[x] = int(arg[tuple(assignment[v] for v in scope_t)])
    return assignment


def _condition(
    nodes: list[Node], factors: list[tuple[tuple, np.ndarray]], factor_limit: int
) -> dict[Node, int]:
    """Exact branch and bound: fix the most connected node, solve the rest, keep the best.

    A branch is cut when a lower bound (each factor at its own minimum given
    the fixed node) cannot beat the best found; no branch is ever guessed.
    """
    degree = {v: 0 for v in nodes}
    for s, _ in factors:
        if len(s) > 1:
            for v in s:
                degree[v] += 1
    x = max(nodes, key=lambda v: (degree[v], -nodes.index(v)))
    rest = [v for v in nodes if v != x]
    k = next(t.shape[s.index(x)] for s, t in factors if x in s)
    best_cost, best = math.inf, None
    for cx in range(k):
        sub = []
        for s, t in factors:
            if x not in s:
                sub.append((s, t))
                continue
            i = s.index(x)
            sliced = np.take(t, cx, axis=i)
            s2 = s[:i] + s[i + 1 :]
            sub.append((s2, sliced) if s2 else ((), sliced))
        const = sum(float(t) for s, t in sub if not s)
        sub = [(s, t) for s, t in sub if s]
        bound = const + sum(float(t.min()) for _, t in sub)
        if bound >= best_cost:
            continue
        if not rest:
            assignment = {}
        else:
            joint = math.prod(next(t.shape[s.index(v)] for s, t in sub if v in s) for v in rest)
            if joint <= ENUMERATE_LIMIT:
                assignment = _enumerate(rest, sub)
            else:
                try:
                    assignment = _variable_elimination(rest, sub, factor_limit)
                except _TooLarge:
                    assignment = _condition(rest, sub, factor_limit)
        value = const + sum(float(t[tuple(assignment[v] for v in s)]) for s, t in sub)
        if value < best_cost:
            best_cost, best = value, {**assignment, x: cx}
    assert best is not None  # costs are finite: the first branch is never cut
    return best


# -- reference ------------------------------------------------------------------------------


def brute_force(graph: CostGraph) -> Solution:
    """Eq. 1 minimised by trying every assignment (for tests; exponential)."""
    nodes = graph.nodes
    best_cost, best = math.inf, None
    for combo in itertools.product(*(range(graph.num_configs(v)) for v in nodes)):
        assignment = dict(zip(nodes, combo, strict=True))
        value = graph.evaluate(assignment)
        if value < best_cost:
            best_cost, best = value, assignment
    assert best is not None  # costs are finite; no nodes: the empty assignment
    stats = EliminationStats(len(nodes), len(graph.edges), len(nodes), len(graph.edges))
    stats.residual_method = "brute-force"
    return Solution(best, best_cost, stats)
