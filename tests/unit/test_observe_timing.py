"""Robust timing primitives: medians with bootstrap intervals, interval fits, interleaved rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tunekit.hardware import GB, CollectiveFit
from tunekit.observe.timing import (
    Estimate,
    copy_timings,
    fit_samples,
    median_interval,
    timed_rounds,
)

LAT, BW = 50e-6, 2.0 * GB
SIZES = tuple(4096 * 4**i for i in range(6))  # 4 KiB .. 4 MiB


def _noisy_samples(rng: np.random.Generator, repeats: int = 9) -> dict[int, list[float]]:
    """Timings of a 50 us + bytes / 2 GB/s link with 5 % multiplicative noise."""
    return {n: list((LAT + n / BW) * (1 + 0.05 * rng.standard_normal(repeats))) for n in SIZES}


def test_median_interval_shrugs_off_one_50x_outlier():
    rng = np.random.default_rng(1)
    clean = list(1e-3 * (1 + 0.05 * rng.standard_normal(9)))
    spiked = clean[:-1] + [50e-3]  # one sample 50 times slower: a descheduled rank
    a, b = median_interval(clean), median_interval(spiked)
    assert b.value == pytest.approx(a.value, rel=0.05)
    assert np.mean(spiked) > 5 * np.mean(clean)  # what a mean would have reported
    assert b.low <= b.value <= b.high < 2e-3  # the outlier is outside the interval, too
    assert a.low < a.value < a.high and a.high - a.low < 0.2e-3


def test_median_interval_is_deterministic_and_degenerate_without_spread():
    xs = [3.0, 1.0, 2.0, 5.0, 4.0]
    assert median_interval(xs) == median_interval(list(reversed(xs)))
    assert median_interval([2.0]) == Estimate(2.0, 2.0, 2.0)
    assert median_interval([2.0, 2.0, 2.0]) == Estimate.exact(2.0)
    with pytest.raises(ValueError):
        median_interval([])


def test_estimate_inverse_turns_a_time_into_a_rate_and_swaps_its_ends():
    t = Estimate(2.0, 1.0, 4.0)
    assert t.inverse(8.0) == Estimate(4.0, 2.0, 8.0)
    assert t.straddles(3.0) and t.straddles(1.0)
    assert not t.straddles(0.5)  # all of it is above
    assert not t.straddles(4.0) and not t.straddles(5.0)  # none of it is above
    assert not Estimate.exact(2.0).straddles(2.0)  # no interval: the value decides
    assert Estimate.from_dict(t.to_dict()) == t


def test_fit_samples_recovers_the_line_with_an_interval_that_holds_it():
    fit = fit_samples(_noisy_samples(np.random.default_rng(2)), "gloo", "p2p", 2)
    assert fit.bandwidth == pytest.approx(BW, rel=0.1)
    assert fit.latency == pytest.approx(LAT, rel=0.2)
    low, high = fit.bandwidth_interval
    assert low <= BW <= high and low <= fit.bandwidth <= high
    assert high / low < 1.3  # 5 % noise, 9 repeats: a tight interval
    lat_low, lat_high = fit.latency_interval
    assert lat_low <= fit.latency <= lat_high


@pytest.mark.parametrize("size", [SIZES[0], SIZES[-1]])
def test_one_50x_outlier_barely_moves_the_fit_or_its_interval(size):
    samples = _noisy_samples(np.random.default_rng(3))
    clean = fit_samples(samples, "gloo", "all_reduce", 2)
    samples[size] = samples[size][:-1] + [50 * samples[size][0]]
    spiked = fit_samples(samples, "gloo", "all_reduce", 2)
    assert spiked.bandwidth == pytest.approx(clean.bandwidth, rel=0.05)
    assert spiked.latency == pytest.approx(clean.latency, rel=0.1)
    assert spiked.residual == pytest.approx(clean.residual, abs=0.02)
    low, high = spiked.bandwidth_interval
    assert 0.8 * BW < low <= BW <= high < 1.25 * BW


def test_fit_samples_without_repeats_has_no_interval():
    fit = fit_samples({n: [LAT + n / BW] for n in SIZES}, "gloo", "p2p", 2)
    assert fit.bandwidth == pytest.approx(BW) and fit.bandwidth_interval is None
    assert fit.bandwidth_bounds() == (fit.bandwidth, fit.bandwidth)
    with pytest.raises(ValueError):
        fit_samples({4096: [1e-4, 2e-4]}, "gloo", "p2p", 2)  # one size: no line


def test_fit_ends_and_hardware_ends():
    fit = CollectiveFit("gloo", "all_reduce", 2, 1e-4, 2 * GB, 0.1, (5e-5, 2e-4), (1 * GB, 3 * GB))
    slow, fast = fit.at_end("slow"), fit.at_end("fast")
    assert (slow.latency, slow.bandwidth) == (2e-4, 1 * GB)
    assert (fast.latency, fast.bandwidth) == (5e-5, 3 * GB)
    assert slow.time(1e6) > fit.time(1e6) > fast.time(1e6)
    plain = CollectiveFit("gloo", "p2p", 2, 1e-4, 2 * GB)
    assert plain.at_end("slow") == plain == plain.at_end("fast")
    with pytest.raises(ValueError):
        fit.at_end("median")


def test_timed_rounds_interleaves_sizes_and_drops_warmup():
    calls: list[str] = []
    times = timed_rounds(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        repeats=3,
        warmup=2,
        before=lambda: calls.append("|"),
    )
    assert calls == ["|", "a", "|", "b"] * 5  # round-robin, warm-up rounds included in the run
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    with pytest.raises(ValueError):
        timed_rounds({"a": lambda: None}, repeats=0)


def test_host_copy_timings_on_one_thread_leave_the_thread_count_alone():
    before = torch.get_num_threads()
    times = copy_timings((1 << 16, 1 << 20), repeats=4, warmup=1)
    assert torch.get_num_threads() == before
    assert sorted(times) == [1 << 16, 1 << 20] and all(len(v) == 4 for v in times.values())
    fit = fit_samples(times, "cpu", "memcpy", 1)
    assert fit.bandwidth > 0.05 * GB
    with pytest.raises(ValueError):
        copy_timings((1 << 16,), repeats=1, direction="sideways")
