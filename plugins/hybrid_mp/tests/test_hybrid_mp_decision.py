"""The hybrid decision: Eq. 3, 5 and 6 on the paper's worked numbers (NOTES.md §2)."""

from __future__ import annotations

import pytest

from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.model import (
    EpochTable,
    decide,
    dp_speedup,
    eq6_threshold,
    hybrid_speedup,
    implied_epoch_ratio,
    modelled_scaling_efficiency,
)

# Inception-V3, Figure 4 (128 GPUs: 12 epochs, inferred); SU^2 = 1.32 (Table 1); SE = 1.
INCEPTION_E = EpochTable({32: 4, 64: 7, 128: 12, 256: 23})
SU2 = 1.32


@pytest.mark.parametrize(("devices", "ratio"), [(64, 1.155), (128, 1.131), (256, 1.265)])
def test_inception_hybrid_over_dp(devices, ratio):
    hybrid = hybrid_speedup(devices // 2, 2, SU2, INCEPTION_E)
    dp = dp_speedup(devices, INCEPTION_E)
    assert hybrid / dp == pytest.approx(ratio, abs=5e-4)


def test_eq6_threshold_32_to_64_gpus():
    # 2 x 4/7 = 1.143 < 1.32: use the extra 32 GPUs for 2-way model parallelism
    thr = eq6_threshold(32, 2, INCEPTION_E)
    assert thr == pytest.approx(8 / 7)
    assert round(thr, 3) == 1.143
    assert thr < SU2


def test_decision_at_256_gpus_picks_the_hybrid_by_26_5_percent():
    d = decide(256, {2: SU2}, INCEPTION_E)
    assert (d.best.dp, d.best.mp) == (128, 2)
    row = next(r for r in d.rows if r.mp == 2)
    assert row.threshold == pytest.approx(2 * 12 / 23)
    assert row.note == "hybrid wins (Eq. 6)"
    dp256 = next(r for r in d.rows if r.mp == 1 and r.dp == 256)
    assert row.speedup / dp256.speedup == pytest.approx(1.265, abs=5e-4)


def test_biglstm_beats_its_best_dp_scale_by_1_22():
    # E_32 / E_16 = 3.2; SU^2 = 1.22 (pipeline); 32 GPUs; best DP scale is 16 GPUs
    epochs = EpochTable({16: 1.0, 32: 3.2})
    assert eq6_threshold(16, 2, epochs) == pytest.approx(0.625)
    d = decide(32, {2: 1.22}, epochs)
    assert (d.best.dp, d.best.mp) == (16, 2)
    assert d.best_dp.dp == 16
    assert d.gain_over_dp == pytest.approx(1.22)


def test_gnmt_implied_epoch_ratio():
    # an 8 % gain at 256 GPUs with SU^2 = 1.15 needs E_256 / E_128 = 1.08 x 2 / 1.15
    assert implied_epoch_ratio(1.15, 2, 0.08) == pytest.approx(1.878, abs=5e-4)
    epochs = EpochTable({128: 1.0, 256: implied_epoch_ratio(1.15, 2, 0.08)})
    d = decide(256, {2: 1.15}, epochs)
    assert d.best.mp == 2
    assert d.best.speedup / next(r for r in d.rows if r.dp == 256).speedup == pytest.approx(1.08)


def test_dp_wins_when_epochs_do_not_grow():
    d = decide(8, {2: 1.3, 4: 1.5}, EpochTable({1: 1, 2: 1, 4: 1, 8: 1}))
    assert (d.best.dp, d.best.mp) == (8, 1)
    assert {(r.dp, r.mp) for r in d.rows} >= {(4, 2), (2, 4), (8, 1)}


def test_scaling_efficiency_enters_eq6():
    epochs = EpochTable({32: 4, 64: 4})
    se = {32: 0.9, 64: 0.6}.get
    assert eq6_threshold(32, 2, epochs, se) == pytest.approx(2 * 0.6 / 0.9)
    modelled = modelled_scaling_efficiency(1.0, 100.0, lambda nbytes, n: nbytes / 100 * (n - 1) / n)
    assert modelled(1) == 1.0
    assert modelled(2) == pytest.approx(1 / 1.5)


def test_epoch_table_interpolates_in_log_space_and_refuses_extrapolation():
    t = EpochTable({32: 4, 128: 16})
    assert t(64) == pytest.approx(8.0)  # geometric midpoint
    assert t.e1 == 4  # the first entry stands in for E_1
    with pytest.raises(ConfigError, match="covers N = 32..128"):
        t(256)
    with pytest.raises(ConfigError, match="positive"):
        EpochTable({4: 0})
    with pytest.raises(ConfigError, match="positive integer"):
        EpochTable({0: 1})
