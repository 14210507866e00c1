"""The measured truth, calibration to it, and the feedback that corrects predictions from trials."""

from __future__ import annotations

import math
import sqlite3

import pytest

from tunekit.costmodel import BACKWARD_FLOPS_RATIO, Calibration, ComputeRate, training_flops
from tunekit.observe.observation import Measurement
from tunekit.observe.truth import PART_LABELS, StepTruth
from tunekit.store import Store
from tunekit.testing import synthetic_breakdown
from tunekit.trials.feedback import (
    Corrector,
    Outcome,
    PoolEntry,
    choose_next,
    rank_pool,
    relative_error,
)

FRACTIONS = {"compute": 0.6, "comm_exposed": 0.2, "data": 0.05, "optimizer": 0.1, "idle": 0.05}


def measurement(median_s: float, spread_s: float = 0.002) -> Measurement:
    return Measurement([median_s] * 5, median_s, spread_s, 64 / median_s)


# -- the truth ------------------------------------------------------------------------------


def test_truth_scales_the_profiled_parts_to_the_measured_step():
    # Under the profiler the step took 50 ms; the measured median is 40 ms.
    bd = synthetic_breakdown(0.050, FRACTIONS)
    truth = StepTruth.of(measurement(0.040), bd)
    assert truth.step_s == 0.040
    assert sum(truth.parts_s.values()) == pytest.approx(0.040)
    assert truth.fraction("comm_exposed") == pytest.approx(0.2, rel=1e-6)
    assert truth.profiled_step_s == pytest.approx(0.050)
    assert (
        truth.phrase("comm_exposed") == "exposed communication 20% of the step (8.0 ms, measured)"
    )
    assert "compute 60%" in truth.describe()
    assert StepTruth.from_dict(truth.to_dict()) == truth


def test_truth_without_a_breakdown_has_only_the_step():
    truth = StepTruth.of(measurement(0.040), None)
    assert not truth.profiled and truth.part("compute") is None
    assert "unknown" in truth.phrase("compute")
    assert StepTruth.of(None, None) is None
    with pytest.raises(KeyError, match="unknown step part"):
        truth.part("update")


# -- compute from FLOPs ------------------------------------------------------------------------


def test_compute_rate_measured_and_assumed():
    rate = ComputeRate.measured(forward_flops_per_rank=1e9, compute_s=0.1)
    assert rate.flops_per_s == pytest.approx(training_flops(1e9) / 0.1)
    fwd, bwd = rate.forward_backward_s(1e9)
    assert fwd + bwd == pytest.approx(0.1) and bwd == pytest.approx(BACKWARD_FLOPS_RATIO * fwd)
    assert ComputeRate.measured(0, 0.1) is None
    assumed = ComputeRate.assumed(10e12, 0.4)
    assert assumed.seconds(4e12) == pytest.approx(1.0) and "40% of 10 TFLOP/s" in assumed.source
    with pytest.raises(ValueError):
        ComputeRate.assumed(10e12, 1.5)


# -- calibration -----------------------------------------------------------------------------


def truth_40ms() -> StepTruth:
    bd = synthetic_breakdown(0.040, FRACTIONS)
    return StepTruth.of(measurement(0.040), bd)


def test_a_calibrated_model_reproduces_the_baseline_it_was_calibrated_on():
    truth = truth_40ms()
    # The model thinks compute is 12 ms (layers timed alone) and exposed comm 4 ms.
    cal = Calibration.fit(truth, {"compute": 0.012, "comm_exposed": 0.004})
    assert cal.reproduces_baseline() == pytest.approx(truth.step_s)
    assert cal.scales["compute"] == pytest.approx(0.024 / 0.012)
    assert cal.scales["comm_exposed"] == pytest.approx(0.008 / 0.004)
    # Halving the model's exposed communication saves half the measured 8 ms.
    assert cal.predict({"comm_exposed": 0.002}) == pytest.approx(0.040 - 0.004)
    # A change in compute is scaled the same way.
    assert cal.predict({"compute": 0.006, "comm_exposed": 0.004}) == pytest.approx(0.040 - 0.012)
    low, high = cal.predicted_range(0.036, spread_s=0.004)
    assert low == pytest.approx(0.036 * 0.95) and high == pytest.approx(0.036 * 1.05)


def test_calibration_refuses_factors_it_cannot_justify():
    truth = truth_40ms()
    cal = Calibration.fit(truth, {"compute": 0.024 / 30, "comm_exposed": 0.0})
    assert cal.scales == {"compute": 1.0, "comm_exposed": 1.0}
    assert any("outside what calibration can fix" in n for n in cal.notes)
    with pytest.raises(KeyError, match="no baseline figure"):
        cal.predict({"data": 0.001})
    unprofiled = Calibration.fit(StepTruth.of(measurement(0.04), None), {"compute": 0.01})
    assert unprofiled.scales == {"compute": 1.0} and "not profiled" in unprofiled.notes[0]


# -- feedback ---------------------------------------------------------------------------------


def test_no_trials_means_the_raw_model():
    c = Corrector(0.100)
    assert c.corrected("overlap_chunking", 0.080) == pytest.approx(0.080)
    assert c.corrected("x", None) is None


def test_a_tuners_trials_correct_its_own_predictions_only():
    # overlap_chunking's candidates ran 25% slower than predicted, twice.
    c = Corrector(
        0.100,
        [Outcome("overlap_chunking", 0.080, 0.100), Outcome("overlap_chunking", 0.090, 0.1125)],
    )
    fit = c.residual("overlap_chunking")
    assert fit.trials == 2
    corrected = c.corrected("overlap_chunking", 0.085)
    assert 0.085 * 1.15 < corrected < 0.085 * 1.3  # moved most of the way to the measured bias
    assert c.corrected("cgdp", 0.085) == pytest.approx(0.085)  # another tuner is left alone


def test_the_slope_learns_that_a_model_exaggerates_changes():
    # Predicted changes of -40% and +40% materialised as -10% and +10%.
    outcomes = [
        Outcome("layer_split", 0.060, 0.090),
        Outcome("layer_split", 0.140, 0.110),
        Outcome("layer_split", 0.070, 0.092),
        Outcome("layer_split", 0.130, 0.108),
    ]
    fit = Corrector(0.100, outcomes).residual("layer_split")
    assert 0.0 < fit.slope < 0.5 and abs(fit.bias) < 0.05


def test_scripted_trial_results_change_the_order_of_what_runs_next():
    base, batch = 0.100, 64
    pool = [
        PoolEntry("a", {"a": 1}, "a1", 0.070, None),  # 30% predicted gain
        PoolEntry("a", {"a": 2}, "a2", 0.075, None),
        PoolEntry("b", {"b": 1}, "b1", 0.080, None),  # 20%
        PoolEntry("b", {"b": 2}, "b2", 0.085, None),
        PoolEntry("c", {"c": 1}, "c1", 0.190, 128),  # per sample: 0.095/64 -> 5% gain
        PoolEntry("d", {"d": 1}, "d1", None, None),  # no prediction
    ]
    raw = rank_pool(pool, Corrector(base), batch)
    first, _ = choose_next(raw, set(), 6, 0.01)
    assert [r.entry.config_id for r in first] == ["a1", "b1", "c1", "d1", "a2", "b2"]
    assert next(r for r in raw if r.entry.config_id == "c1").gain == pytest.approx(0.05)
    # Under a time budget, which may hold a trial or two, by gain alone: a's second (25%) goes
    # before b's best (20%); one too long for the budget gives its place to the next best.
    first, _ = choose_next(raw, set(), 6, 0.01, by_gain=True)
    assert [r.entry.config_id for r in first] == ["a1", "a2", "b1", "b2", "c1", "d1"]

    # a1 ran: no gain at all; a's other candidate is now predicted no better than the baseline.
    after = Corrector(base, [Outcome("a", 0.070, 0.101)])
    ranked = rank_pool([e for e in pool if e.config_id != "a1"], after, batch)
    chosen, dropped = choose_next(ranked, {"a"}, 5, 0.01)
    order = [r.entry.config_id for r in chosen]
    assert order.index("b1") < order.index("c1") < order.index("d1")
    assert "a2" not in order and [r.entry.config_id for r in dropped] == ["a2"]


def test_relative_error():
    assert relative_error(0.12, 0.10) == pytest.approx(0.2)
    assert relative_error(None, 0.10) is None and relative_error(0.1, None) is None


# -- the store keeps raw and corrected predictions ------------------------------------------------


def test_a_schema_1_store_gains_the_corrected_column_and_keeps_its_trials(tmp_path):
    path = tmp_path / "tunekit.db"
    store = Store(path)
    sid = store.create_study(
        key="k", workload="w", graph_hash="g", hw_fingerprint="h", nproc=2, settings={}
    )
    store.add_trial(
        sid, seq=0, role="baseline", plugin=None, config_id="c", config={}, predicted_s=None
    )
    store.close()
    conn = sqlite3.connect(path)  # what tunekit with schema 1 wrote: no corrected_s column
    conn.execute("ALTER TABLE trials DROP COLUMN corrected_s")
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    store = Store(path)
    assert store.trials(sid)[0].corrected_s is None and store.trials(sid)[0].role == "baseline"
    store.add_trial(
        sid,
        seq=1,
        role="candidate",
        plugin="a",
        config_id="x",
        config={},
        predicted_s=0.1,
        corrected_s=0.12,
    )
    assert store.trials(sid)[1].corrected_s == 0.12
    store.close()


def test_replacing_pending_candidates_keeps_slots_and_drops_repeated_baselines(tmp_path):
    store = Store(tmp_path / "tunekit.db")
    sid = store.create_study(
        key="k", workload="w", graph_hash="g", hw_fingerprint="h", nproc=2, settings={}
    )
    roles = ["baseline", "candidate", "candidate", "baseline", "candidate", "baseline"]
    for seq, role in enumerate(roles):
        store.add_trial(
            sid,
            seq=seq,
            role=role,
            plugin="a" if role == "candidate" else None,
            config_id=f"c{seq}",
            config={},
            predicted_s=0.1,
        )
    store.finish_trial(store.trials(sid)[0].id, status="ok", median_s=0.1)
    store.finish_trial(store.trials(sid)[1].id, status="ok", median_s=0.1)
    # Two candidates left to run in slots 2 and 4; only one is still worth a trial.
    store.replace_pending_candidates(
        sid,
        [
            {
                "plugin": "b",
                "config_id": "new",
                "config": {"b": {}},
                "predicted_s": 0.08,
                "corrected_s": 0.09,
            }
        ],
    )
    rows = store.trials(sid)
    assert [(r.seq, r.role, r.config_id) for r in rows] == [
        (0, "baseline", "c0"),
        (1, "candidate", "c1"),
        (2, "candidate", "new"),
        (3, "baseline", "c3"),
    ]
    assert rows[2].corrected_s == 0.09 and rows[2].status == "pending"
    store.close()


def test_part_labels_cover_every_part():
    from tunekit.observe.breakdown import PARTS

    assert set(PART_LABELS) == set(PARTS) and all(isinstance(v, str) for v in PART_LABELS.values())
    assert math.isclose(sum(truth_40ms().to_dict()["fractions"].values()), 1.0)
