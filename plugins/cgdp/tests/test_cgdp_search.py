"""Chunk layouts and the chunk-size searches: the paper's numbers, exactly (NOTES.md §4)."""

from __future__ import annotations

import pytest

from tunekit.plugins.cgdp.search import (
    Algorithm1,
    NoiseAwareChunkSearch,
    as_layout,
    chunk_layout,
    chunk_sizes,
    unit_layout,
)

# -- layouts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "chunks"),
    [
        (1, 152),
        (2, 77),
        (3, 52),
        (6, 27),
        (8, 26),
        (9, 24),
        (10, 17),
        (20, 19),
        (76, 77),
        (152, 152),
        (153, 152),
        (1000, 152),
    ],
)
def test_layout_counts_for_resnet152_depth(k, chunks):
    assert len(chunk_layout(152, k)) == chunks


def test_layout_six_layers_chunk_three():
    assert chunk_layout(6, 3) == [[6, 5, 4], [3], [2], [1]]


@pytest.mark.parametrize("num_layers", [1, 2, 5, 6, 7, 152])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 200])
def test_layout_covers_every_layer_once_in_backward_order(num_layers, k):
    layout = chunk_layout(num_layers, k)
    flat = [layer for chunk in layout for layer in chunk]
    assert flat == list(range(num_layers, 0, -1))
    sizes = [len(c) for c in layout]
    # uniform chunks of k first, then singletons, and never a chunk larger than k
    big = [s for s in sizes if s > 1]
    assert all(s == k for s in big)
    assert sizes == sorted(sizes, reverse=True)


def test_chunk_size_at_least_the_depth_is_the_naive_layout():
    assert chunk_sizes(152, 152) == chunk_sizes(152, 1) == (1,) * 152


def test_bad_layout_arguments():
    with pytest.raises(ValueError, match="chunk size"):
        chunk_layout(6, 0)
    with pytest.raises(ValueError, match="layer"):
        chunk_layout(0, 3)


# -- Algorithm 1 -------------------------------------------------------------------------


def run_to_end(search, seconds_of) -> None:
    while (chunk := search.next_chunk()) is not None:
        search.record(lapse=seconds_of(chunk))


def v_shape(best: int):
    """Interval time falling to a minimum at ``best`` and rising after it."""
    return lambda chunk: 1.0 + abs(chunk - best) / 100


def test_trace_step10_range5_finds_9_at_iteration_90_and_stops_at_150():
    alg = Algorithm1(step=10, range_=5, interval=10)
    run_to_end(alg, v_shape(9))
    ran = [r.chunk for r in alg.history]
    assert ran == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30, 40, 50, 60]
    assert alg.best_chunk == 9
    assert alg.found_at() == 90
    assert alg.iterations == 150
    stop = alg.history[-1]
    assert (stop.action, stop.chunk, stop.time_s, stop.iteration) == ("stop", 60, None, 150)
    # 60 >= 9 + 10 * 5: the last interval's time is not used
    assert alg.chunk == 9 and alg.done and alg.next_chunk() is None


def test_trace_step10_range10_best20_stops_after_21_intervals():
    alg = Algorithm1(step=10, range_=10, interval=10)
    run_to_end(alg, v_shape(20))
    assert alg.best_chunk == 20
    assert alg.intervals == 21
    assert alg.iterations == 210
    assert alg.history[-1].chunk == 120  # 120 >= 20 + 10 * 10


@pytest.mark.parametrize("best", range(1, 10))
def test_intervals_after_a_best_below_step(best):
    # Sec. 4.2: with best_chunk < step, another (step - best_chunk + range) runs before stopping.
    alg = Algorithm1(step=10, range_=5)
    run_to_end(alg, v_shape(best))
    assert alg.intervals - alg.found_at() // 10 == 10 - best + 5


def test_algorithm1_sums_step_times_and_refuses_after_stop():
    alg = Algorithm1(step=2, range_=1, interval=2)
    alg.record([0.5, 0.5])  # chunk 1: 1.0 s
    assert alg.next_chunk() == 2
    alg.record([0.6, 0.6])  # chunk 2: 1.2 s, slower
    assert alg.next_chunk() == 4
    alg.record([0.1, 0.1])  # 4 >= 1 + 2 * 1: stop; this (fast) time is not used
    assert alg.done and alg.best_chunk == 1
    assert [r.time_s for r in alg.history] == [1.0, 1.2, None]
    with pytest.raises(RuntimeError, match="stopped"):
        alg.record([1.0])


def test_search_parameters_are_checked():
    with pytest.raises(ValueError, match="step"):
        Algorithm1(step=0)
    with pytest.raises(ValueError, match="range"):
        NoiseAwareChunkSearch(range_=0)
    with pytest.raises(ValueError, match="accept_rounds"):
        NoiseAwareChunkSearch(max_rounds=2, accept_rounds=3)
    with pytest.raises(ValueError, match="warmup"):
        NoiseAwareChunkSearch(interval=3, warmup=3)


# -- the noise-aware variant --------------------------------------------------------------


def drive(search, step_times_of) -> list[tuple[int, str]]:
    """Run a search to its end; ``step_times_of(chunk, interval_index)`` gives an interval's step times."""
    runs = []
    while (chunk := search.next_chunk()) is not None:
        times = step_times_of(chunk, search.intervals)
        search.record(times)
        runs.append((chunk, search.history[-1].action))
    return runs


def steady(best: int, n: int = 10):
    return lambda chunk, _i: [1.0 + abs(chunk - best) / 100] * n


def test_noise_aware_finds_the_minimum_of_a_steady_job():
    search = NoiseAwareChunkSearch(step=10, range_=5, interval=10, num_layers=152)
    drive(search, steady(9))
    assert search.best_chunk == 9 and search.done


def test_noise_aware_skips_layouts_already_measured():
    # With 6 layers every k >= 6 is the layout of k = 1: only 2..5 are worth running.
    search = NoiseAwareChunkSearch(step=10, range_=5, interval=10, num_layers=6)
    runs = drive(search, steady(3))
    candidates = sorted({chunk for chunk, action in runs if action != "incumbent"})
    assert candidates == [2, 3, 4, 5]
    assert search.best_chunk == 3
    # Algorithm 1 spends 15 intervals on the same job, most on copies of k = 1.
    alg = Algorithm1(step=10, range_=5)
    run_to_end(alg, lambda c: 10 * steady(3)(c if c < 6 else 1, 0)[0])
    assert alg.intervals == 15 > search.intervals


def test_ties_go_to_the_incumbent_after_max_rounds():
    search = NoiseAwareChunkSearch(step=2, range_=1, interval=4, warmup=0, max_rounds=2)
    runs = drive(search, lambda chunk, i: [1.0, 1.1, 1.0, 1.1])  # every chunk the same
    assert search.best_chunk == 1
    assert [a for c, a in runs if c == 2] == ["undecided", "rejected"]


def test_a_pause_fools_algorithm1_but_not_the_noise_aware_search():
    """One slow step (a GC pause, a neighbour's burst) in chunk 4's first interval."""

    def noisy(chunk: int, interval: int, first_of_4: list[bool]):
        times = [1.0 + abs(chunk - 4) / 100] * 10
        if chunk == 4 and first_of_4[0]:
            first_of_4[0] = False
            times[5] = 3.0
        return times

    alg = Algorithm1(step=10, range_=2)
    flag = [True]
    while (chunk := alg.next_chunk()) is not None:
        alg.record(noisy(chunk, alg.intervals, flag))
    assert alg.best_chunk != 4  # the interval sum blamed chunk 4 for the pause

    search = NoiseAwareChunkSearch(step=10, range_=2, interval=10, num_layers=50)
    flag = [True]
    drive(search, lambda c, i: noisy(c, i, flag))
    assert search.best_chunk == 4  # medians of per-step times shrug it off


def test_a_burst_over_the_incumbents_interval_does_not_crown_a_slower_candidate():
    """Chunk 1 is best; a burst of load doubles the one incumbent interval paired with chunk 2."""

    def times(chunk: int, interval: int):
        base = [1.0 + (chunk - 1) / 100] * 10
        if chunk == 1 and interval == 0:  # the first incumbent interval: under a burst
            return [2 * t for t in base]
        return base

    search = NoiseAwareChunkSearch(step=3, range_=1, interval=10, num_layers=20)
    runs = drive(search, times)
    assert search.best_chunk == 1
    # chunk 2 looked faster in round 1, then lost the replication round
    assert [a for c, a in runs if c == 2] == ["undecided", "rejected"]
    alg = Algorithm1(step=3, range_=1)
    while (chunk := alg.next_chunk()) is not None:
        alg.record(times(chunk, alg.intervals))
    assert alg.best_chunk == 2  # one interval per candidate: the burst decides


def test_rounds_too_noisy_alone_are_pooled_for_the_last_decision():
    """Chunk 2 is a little faster; one round's 4 samples cannot show it (p = 0.2), 3 pooled can."""

    def times(chunk: int, _interval: int):
        return [0.97, 0.98, 0.99, 1.02] if chunk == 2 else [0.995, 1.0, 1.01, 1.03]

    search = NoiseAwareChunkSearch(step=2, range_=1, interval=4, warmup=0, max_rounds=3)
    runs = drive(search, times)
    assert [a for c, a in runs if c == 2] == ["undecided", "undecided", "accepted"]
    assert search.best_chunk == 2


# -- chunks of whole transformer blocks ---------------------------------------------------------

# An embedding, two blocks of three layers, the final norm and the head (forward order).
UNITS = ["emb", "b0", "b0", "b0", "b1", "b1", "b1", "ln", "head"]


def test_unit_layout_holds_whole_units_from_the_output_end():
    # units: emb(1), b0(2-4), b1(5-7), ln(8), head(9); by units, chunk_layout(5, 2) is
    # {5, 4}, {3, 2}, {1}: head+ln, both blocks, then emb alone
    assert unit_layout(UNITS, 2) == [[9, 8], [7, 6, 5, 4, 3, 2], [1]]
    assert unit_layout(UNITS, 1) == [[9], [8], [7, 6, 5], [4, 3, 2], [1]]
    assert unit_layout(UNITS, 3) == [[9, 8, 7, 6, 5], [4, 3, 2], [1]]
    for k in range(1, 7):
        layout = unit_layout(UNITS, k)
        assert sorted(x for c in layout for x in c) == list(range(1, 10))
        for chunk in layout:  # a block's layers are never in two chunks
            for block in ("b0", "b1"):
                members = [x for x in chunk if UNITS[x - 1] == block]
                assert members in ([], [x for x in range(1, 10) if UNITS[x - 1] == block][::-1])


def test_unit_layout_of_single_layer_units_is_the_papers():
    names = [f"l{i}" for i in range(7)]
    for k in (1, 2, 3, 7):
        assert unit_layout(names, k) == chunk_layout(7, k)


def test_as_layout_takes_a_chunk_size_or_checks_a_layout():
    assert as_layout(4, 2) == chunk_layout(4, 2)
    assert as_layout(4, [[4, 3], [2, 1]]) == [[4, 3], [2, 1]]
    with pytest.raises(ValueError, match="each of the 4 layers once"):
        as_layout(4, [[4, 3], [2]])
