"""The shared ping-pong and all-reduce timings on real gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest

from tunekit.observe.timing import measure_link
from tunekit.testing import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.busy_ok]

SIZES = [4096, 65536, 1 << 20, 4 << 20]


def test_shared_ping_pong_fits_the_link_between_two_real_ranks():
    fits = run_ranks(measure_link, 2, (SIZES, 5))
    assert fits[0] == fits[1]  # rank 0 timed the round trips and broadcast them
    fit = fits[0]
    assert (fit.backend, fit.op, fit.world_size) == ("gloo", "p2p", 2)
    low, high = fit.bandwidth_interval
    assert 0 < low <= fit.bandwidth <= high < np.inf
    lat_low, lat_high = fit.latency_interval
    assert 0 <= lat_low <= fit.latency <= lat_high
    # a real link: moving 4 MiB one way takes longer than 4 KiB does
    assert fit.time(SIZES[-1]) > fit.time(SIZES[0])


def test_probe_sweeps_keep_every_repeat_and_fit_with_intervals():
    from tunekit.observe.probe import probe_hardware

    res = probe_hardware(2, sizes=SIZES, repeats=4)
    ops = {s.op: s for s in res.sweeps}
    assert set(ops) == {"all_reduce", "p2p"}
    for s in res.sweeps:
        assert sorted(s.samples) == SIZES
        assert all(len(ts) == 4 and min(ts) > 0 for ts in s.samples.values())
        assert [n for n, _ in s.points] == SIZES
        assert s.points[0][1] == pytest.approx(float(np.median(s.samples[SIZES[0]])))
        low, high = s.fit.bandwidth_interval
        assert low <= s.fit.bandwidth <= high
        assert s.to_dict()["bandwidth_interval_bytes_s"] == [low, high]
    assert res.hardware.fit("all_reduce", 2) == ops["all_reduce"].fit
