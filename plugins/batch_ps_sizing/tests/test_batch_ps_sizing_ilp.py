"""Eq. 6, the algorithm-choice ILP (scipy.optimize.milp), against brute force and the paper's Figure 2."""

from __future__ import annotations

import itertools
import random

import pytest

from tunekit.plugins.batch_ps_sizing import model as zou
from tunekit.plugins.batch_ps_sizing.search import (
    AlgorithmOption,
    choose_algorithms,
    conv_algorithm_tables,
    plan_batch_by_algorithms,
)
from tunekit.plugins.batch_ps_sizing.tests.paper_batch_ps_sizing import PAPER_ALEXNET


def _brute_force(layers, bound):
    best = None
    for combo in itertools.product(*[range(len(opts)) for opts in layers]):
        mem = sum(layers[k][i].memory_bytes for k, i in enumerate(combo))
        if mem > bound:
            continue
        t = sum(layers[k][i].time_s for k, i in enumerate(combo))
        if best is None or t < best[1] - 1e-12:
            best = (list(combo), t)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_ilp_matches_brute_force(seed):
    rng = random.Random(seed)
    layers = [
        [
            AlgorithmOption(f"a{j}", rng.uniform(0.1, 2.0), rng.choice([0.0, rng.uniform(1, 100)]))
            for j in range(rng.randint(1, 4))
        ]
        for _ in range(rng.randint(1, 6))
    ]
    bound = rng.uniform(0, 200)
    expected = _brute_force(layers, bound)
    got = choose_algorithms(layers, bound)
    if expected is None:
        assert got is None
        return
    choice, total = got
    assert total == pytest.approx(expected[1])
    assert sum(layers[k][i].memory_bytes for k, i in enumerate(choice)) <= bound + 1e-6


def test_ilp_infeasible_when_even_the_leanest_choice_is_too_big():
    layers = [[AlgorithmOption("a", 1.0, 10.0), AlgorithmOption("b", 2.0, 5.0)]]
    assert choose_algorithms(layers, 4.0) is None
    assert choose_algorithms(layers, 5.0) == ([1], 2.0)
    assert choose_algorithms(layers, 10.0) == ([0], 1.0)


def test_batch_choice_is_normalised_per_sample():
    """The paper compares per-step times; per sample (per epoch) is the fair comparison."""

    def tables(b):
        return [
            [
                AlgorithmOption("fast", 1.0 + 0.01 * b, 10.0 * b),
                AlgorithmOption("lean", 1.0 + 0.02 * b, 0.0),
            ]
        ]

    best, rows = plan_batch_by_algorithms([32, 64, 128], tables, lambda b: 1000.0)
    by_batch = {r.batch: r for r in rows}
    assert by_batch[64].algorithms == ["fast"] and by_batch[128].algorithms == ["lean"]
    assert best == 64
    # The unnormalised choice would have been the smallest batch.
    assert min(rows, key=lambda r: r.time_s).batch == 32


def test_conv_tables_use_the_im2col_buffer_size():
    batch = 128
    tables = conv_algorithm_tables(PAPER_ALEXNET, batch, peak_flops=4.37e12)
    assert len(tables) == 5 and all(len(t) == 3 for t in tables)
    implicit, gemm, fft = tables[0]
    assert implicit.memory_bytes == 0
    assert gemm.memory_bytes == 4 * batch * 55 * 55 * 11 * 11 * 3
    assert gemm.time_s < implicit.time_s  # lowering buys speed with memory
    assert fft.memory_bytes > gemm.memory_bytes  # Table 2: FFT needs more memory than GEMM on conv1


def test_memory_bound_forces_slower_algorithms_at_large_batches():
    """Figure 2's mechanism: past a batch, Eq. 5's bound leaves no room for the fast algorithms."""
    device = 3e9
    batches = [16, 32, 64, 128, 256]
    best, rows = plan_batch_by_algorithms(
        batches,
        lambda b: conv_algorithm_tables(PAPER_ALEXNET, b, 4.37e12),
        lambda b: zou.memory_bound_bits(device * 8, PAPER_ALEXNET, b) / 8,
    )
    by_batch = {r.batch: r for r in rows}
    assert "implicit_gemm" not in by_batch[16].algorithms
    assert "implicit_gemm" in by_batch[256].algorithms
    per_sample = [by_batch[b].time_per_sample_s for b in batches if by_batch[b].feasible]
    assert per_sample[-1] > min(per_sample)
    assert best not in (None, 256)
