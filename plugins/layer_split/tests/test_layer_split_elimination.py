"""The generic elimination search (tunekit.search.elimination) against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from tunekit.search.elimination import (
    CostGraph,
    EliminationError,
    brute_force,
    min_plus,
    prune_dominated,
    solve,
)


def random_graph(rng, nodes, edges, k=(2, 4)):
    g = CostGraph()
    for v in nodes:
        g.add_node(v, rng.uniform(0, 10, size=int(rng.integers(k[0], k[1] + 1))))
    for u, v in edges:
        g.add_edge(u, v, rng.uniform(0, 10, size=(g.num_configs(u), g.num_configs(v))))
    return g


def chain(n):
    names = [f"v{i}" for i in range(n)]
    return names, list(zip(names, names[1:], strict=False))


def diamond():
    return ["s", "a", "b", "t"], [("s", "a"), ("s", "b"), ("a", "t"), ("b", "t")]


def inception_like():
    """x -> four towers of different depths (one through a pool) -> concat -> y,
    with a parallel duplicate edge like a tensor read twice."""
    nodes = ["x", "b1", "b2a", "b2b", "b3a", "b3b", "b3c", "pool", "b4", "cat", "y"]
    edges = [
        ("x", "b1"),
        ("x", "b2a"),
        ("b2a", "b2b"),
        ("x", "b3a"),
        ("b3a", "b3b"),
        ("b3b", "b3c"),
        ("x", "pool"),
        ("pool", "b4"),
        ("b1", "cat"),
        ("b2b", "cat"),
        ("b3c", "cat"),
        ("b4", "cat"),
        ("cat", "y"),
        ("b1", "cat"),
    ]
    return nodes, edges


def bridge():
    """Not series-parallel (a Wheatstone bridge plus a skip edge): the eliminations stop early."""
    nodes = ["s", "a", "b", "c", "t"]
    edges = [
        ("s", "a"),
        ("s", "b"),
        ("a", "b"),
        ("a", "c"),
        ("b", "c"),
        ("c", "t"),
        ("s", "t"),
        ("b", "t"),
    ]
    return nodes, edges


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", ["chain", "diamond", "inception", "bridge"])
def test_elimination_equals_brute_force(shape, seed):
    rng = np.random.default_rng(seed)
    nodes, edges = {
        "chain": chain(6),
        "diamond": diamond(),
        "inception": inception_like(),
        "bridge": bridge(),
    }[shape]
    k = (2, 3) if shape == "inception" else (2, 4)
    g = random_graph(rng, nodes, edges, k)
    got = solve(g)
    ref = brute_force(g)
    assert got.cost == pytest.approx(ref.cost, rel=1e-12)
    assert solve(g, prune=False).cost == pytest.approx(ref.cost, rel=1e-12)
    # Eq. 1 evaluated on the returned plan is the reported cost.
    assert g.evaluate(got.assignment) == pytest.approx(got.cost, rel=1e-12)
    assert set(got.assignment) == set(nodes)


def test_series_parallel_graphs_reduce_to_two_nodes():
    rng = np.random.default_rng(0)
    for nodes, edges in (chain(8), diamond(), inception_like()):
        sol = solve(random_graph(rng, nodes, edges))
        assert sol.stats.nodes_after == 2
        assert sol.stats.residual_method == "enumeration"
    nodes, edges = inception_like()
    stats = solve(random_graph(rng, nodes, edges)).stats
    assert stats.edge_eliminations >= 4  # the towers merge into one x -> cat edge


def test_bridge_is_not_reducible_but_solved_exactly():
    rng = np.random.default_rng(3)
    nodes, edges = bridge()
    g = random_graph(rng, nodes, edges)
    sol = solve(g)
    assert sol.stats.nodes_after > 2
    assert sol.cost == pytest.approx(brute_force(g).cost)


@pytest.mark.parametrize("method", ["variable-elimination", "conditioning"])
def test_large_residual_solvers_are_exact(method):
    rng = np.random.default_rng(11)
    nodes, edges = bridge()
    g = random_graph(rng, nodes, edges, k=(3, 5))
    # Force the residual past enumeration (and past variable elimination for conditioning).
    kwargs = {"enumerate_limit": 1}
    if method == "conditioning":
        kwargs["factor_limit"] = 1
    sol = solve(g, **kwargs)
    assert sol.stats.residual_method == method
    assert sol.cost == pytest.approx(brute_force(g).cost)
    assert g.evaluate(sol.assignment) == pytest.approx(sol.cost)


def test_dense_dag_solved_by_dp():
    """Every pair connected (a tournament DAG on 6 nodes): nothing eliminates."""
    rng = np.random.default_rng(5)
    nodes = [f"v{i}" for i in range(6)]
    edges = [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1 :]]
    g = random_graph(rng, nodes, edges, k=(2, 3))
    sol = solve(g, enumerate_limit=10)
    assert sol.stats.node_eliminations == 0
    assert sol.cost == pytest.approx(brute_force(g).cost)


def test_min_plus_matches_loops():
    rng = np.random.default_rng(2)
    a, mid, b = rng.random((5, 7)), rng.random(7), rng.random((7, 3))
    out, arg = min_plus(a, mid, b)
    for i in range(5):
        for j in range(3):
            vals = a[i] + mid + b[:, j]
            assert out[i, j] == pytest.approx(vals.min())
            assert arg[i, j] == vals.argmin()


def test_bad_input_is_one_clear_error():
    g = CostGraph()
    g.add_node("a", [1.0, 2.0])
    g.add_node("b", [1.0])
    with pytest.raises(EliminationError, match="table shape"):
        g.add_edge("a", "b", np.zeros((1, 1)))
    with pytest.raises(EliminationError, match="unknown node"):
        g.add_edge("a", "zz", np.zeros((2, 1)))
    with pytest.raises(EliminationError, match="non-finite"):
        g.add_node("c", [np.nan])


def test_pruning_drops_only_hopeless_configs():
    """A config 100 above every other, whatever its neighbours, is pruned; the optimum stays."""
    rng = np.random.default_rng(9)
    nodes, edges = inception_like()
    g = random_graph(rng, nodes, edges, k=(3, 3))
    g._cost["b2a"] = g._cost["b2a"] + np.array([0.0, 0.0, 100.0])
    pruned, keep = prune_dominated(g)
    assert keep["b2a"].tolist() == [0, 1]
    sol = solve(g, prune=True)
    assert sol.stats.configs_after_pruning < sol.stats.configs_before
    assert sol.cost == pytest.approx(brute_force(g).cost)


def deepa_like_table(rng, ku, kv, match):
    """Column-constant but where the configs match (DeePa's transfer tables)."""
    t = np.broadcast_to(rng.uniform(1, 10, size=kv), (ku, kv)).copy()
    for i, j in match:
        t[i, j] = rng.uniform(0, 1)
    return t


@pytest.mark.parametrize("seed", range(5))
def test_structured_tables_take_the_fast_path_with_the_same_result(seed):
    rng = np.random.default_rng(seed)
    g = CostGraph()
    names = [f"v{i}" for i in range(7)]
    for v in names:
        g.add_node(v, rng.uniform(0, 10, size=4))
    for u, v in zip(names, names[1:], strict=False):
        # identity-like matches, sometimes a column without exception or a shuffled match
        perm = rng.permutation(4)
        match = [(int(perm[j]), j) for j in range(4) if rng.random() < 0.8]
        g.add_edge(u, v, deepa_like_table(rng, 4, 4, match))
    g.add_edge("v0", "v6", rng.uniform(0, 10, size=(4, 4)))  # a general skip edge
    ref = brute_force(g)
    sol = solve(g)
    assert sol.cost == pytest.approx(ref.cost, rel=1e-12)
    left = rng.uniform(0, 5, size=(5, 4))
    b = deepa_like_table(rng, 4, 6, [(0, 0), (1, 3), (3, 5)])
    from tunekit.search.elimination import (
        _min_plus_sparse_left,
        _min_plus_sparse_right,
        _structure,
        min_plus_values,
    )

    assert np.array_equal(_min_plus_sparse_right(left, b, _structure(b)), min_plus_values(left, b))
    a = deepa_like_table(rng, 5, 4, [(0, 0), (2, 1), (4, 3)])
    mid = rng.uniform(0, 1, size=4)
    b2 = rng.uniform(0, 5, size=(4, 3))
    assert np.array_equal(
        _min_plus_sparse_left(a, mid, b2, _structure(a)), min_plus_values(a + mid, b2)
    )
