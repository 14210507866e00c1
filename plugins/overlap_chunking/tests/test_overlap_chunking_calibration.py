"""Calibration on the measured truth, and a diagnosis that starts from it."""

from __future__ import annotations

import pytest

from tunekit.observe.truth import StepTruth
from tunekit.plugins.overlap_chunking import calibration
from tunekit.plugins.overlap_chunking.model import LayerCost, StepCosts, predict_ddp
from tunekit.plugins.overlap_chunking.plugin import OverlapChunking
from tunekit.testing import synthetic_breakdown, synthetic_observation


def six_layers() -> StepCosts:
    """Six layers of uneven times and sizes; all-reduce 1 s per 1000 B plus 0.05 s."""
    layers = tuple(
        LayerCost(f"l{i}", fwd, bwd, (nbytes,))
        for i, (fwd, bwd, nbytes) in enumerate(
            [(1.0, 2.0, 200), (0.5, 1.0, 0), (2.0, 3.0, 400), (1.0, 1.5, 800), (0.2, 0.4, 0), (0.5, 1.0, 1600)]
        )
    )
    return StepCosts(
        layers, 1e-3, 0.1, 2, lambda n: 0.05 + n / 1000, lambda n: 0.05 + n / 2000, comm_cpu_share=0.5
    )


def per_layer_buckets(costs: StepCosts):
    return predict_ddp(costs, 1, 1)


def truth_of(costs: StepCosts, idle_s: float = 0.2) -> StepTruth:
    """What a profiled baseline of ``costs`` would measure (its data time split into data and idle)."""
    pred = per_layer_buckets(costs)
    parts = {
        "compute": pred.parts["compute"],
        "comm_exposed": pred.parts["comm_exposed"],
        "optimizer": pred.parts["optimizer"],
        "data": pred.parts["other"] - idle_s,
        "idle": idle_s,
    }
    # The breakdown's comm_total: communication in flight, hidden or exposed.
    return StepTruth(pred.step_s, parts, comm_total_s=pred.comm_span_s, overlap_R=pred.overlap_R)


def test_joint_fit_recovers_the_factors_the_baseline_was_made_with():
    costs = six_layers()
    truth = truth_of(costs.calibrated(1.7, 4.0, update=2.5, other_s=0.6, peer_delay_s=0.8))
    fit = calibration.fit(costs, truth, per_layer_buckets)
    assert fit.method == calibration.JOINT and not fit.notes
    assert fit.compute_scale == pytest.approx(1.7, rel=1e-3)
    assert fit.comm_scale == pytest.approx(4.0, rel=1e-3)
    assert fit.peer_delay_s == pytest.approx(0.8, rel=1e-3)
    # It reproduces the measured step AND the measured exposed communication.
    assert fit.baseline.step_s == pytest.approx(truth.step_s, rel=1e-6)
    assert fit.baseline.blocked_s == pytest.approx(truth.parts_s["comm_exposed"], rel=1e-6)
    assert fit.calibration.reproduces_baseline() == pytest.approx(truth.step_s)
    assert all(s == pytest.approx(1.0, abs=1e-6) for s in fit.calibration.scales.values())


@pytest.mark.parametrize(
    ("a", "b", "d", "exposed_share"),
    [(0.5, 1.0, 0.0, 1.0), (3.0, 20.0, 0.0, 1.0), (1.0, 2.0, 2.0, 1.0), (1.0, 8.0, 0.0, 0.6), (2.0, 3.0, 0.5, 1.3)],
)
def test_fit_reproduces_step_and_exposure(a, b, d, exposed_share):
    """Baselines made with other factors, their exposure then moved to compute or back:
    whatever the fit chooses, the calibrated model shows the measured step and exposure."""
    costs = six_layers()
    made = truth_of(costs.calibrated(a, b, other_s=0.5, peer_delay_s=d))
    parts = dict(made.parts_s)
    moved = parts["comm_exposed"] * (1 - exposed_share)
    parts["comm_exposed"] -= moved
    parts["compute"] += moved
    truth = StepTruth(made.step_s, parts, comm_total_s=made.comm_total_s - moved)
    fit = calibration.fit(costs, truth, per_layer_buckets)
    assert fit.method == calibration.JOINT
    assert fit.baseline.step_s == pytest.approx(truth.step_s, rel=1e-3)
    if not fit.notes:
        assert fit.baseline.blocked_s == pytest.approx(parts["comm_exposed"], rel=1e-3, abs=1e-6)
    else:  # it says what it could not reproduce
        assert any("cannot expose" in n or "hidden communication" in n for n in fit.notes)


def test_without_a_breakdown_one_compute_factor_is_fitted():
    costs = six_layers()
    made = per_layer_buckets(costs.scaled(2.0))
    fit = calibration.fit(costs, StepTruth(made.step_s), per_layer_buckets)
    assert fit.method == calibration.COMPUTE_ONLY
    assert fit.compute_scale == pytest.approx(2.0, rel=1e-4) and fit.comm_scale == 1.0
    assert "not profiled" in fit.notes[0] and "one compute factor" in fit.notes[0]
    assert fit.baseline.step_s == pytest.approx(made.step_s, rel=1e-6)
    assert calibration.fit(costs, None, per_layer_buckets).method == calibration.UNCALIBRATED


# -- the tuner on a profiled baseline --------------------------------------------------------

STEP_S = 0.4
MEASURED = {"compute": 0.74, "comm_exposed": 0.13, "data": 0.02, "optimizer": 0.03, "idle": 0.08}


@pytest.fixture(scope="module")
def tuner():
    return OverlapChunking()


@pytest.fixture(scope="module")
def profiled():
    breakdown = synthetic_breakdown(STEP_S, MEASURED, comm_total_s=0.3 * STEP_S)
    return synthetic_observation("example:cnn", step_s=STEP_S, breakdown=breakdown)


def test_calibrated_model_reproduces_the_measured_step_and_exposure(tuner, profiled):
    truth = profiled.truth
    diag = tuner.diagnose(profiled)
    default = diag.details["predicted_default"]
    assert default["step_s"] == pytest.approx(truth.step_s, rel=1e-3)
    assert default["exposed_s"] == pytest.approx(truth.parts_s["comm_exposed"], rel=1e-2)
    assert default["parts"]["optimizer"] == pytest.approx(truth.parts_s["optimizer"], rel=1e-6)
    assert diag.details["exposed_s"] == truth.parts_s["comm_exposed"]
    assert diag.details["calibration"]["method"] == calibration.JOINT
    # Every candidate is predicted from the same calibrated model, with a range.
    for cand in tuner.plan(profiled, 4):
        low, high = cand.predicted_range_s
        assert low < cand.predicted_step_s < high
        assert "calibrated on the measured step and exposed communication" in cand.rationale


def test_diagnosis_quotes_the_measured_truth(tuner, profiled):
    truth = profiled.truth
    diag = tuner.diagnose(profiled)
    assert diag.summary.startswith(truth.phrase("comm_exposed"))
    assert "exposed communication 13% of the step (52.0 ms, measured)" in diag.summary
    assert f"R {truth.overlap_R:.0f}" in diag.summary
    # The gain is bounded by what is there: the measured exposure plus the model's
    # CPU share of hidden communication.
    bound = diag.details["gain_bound"]
    charge = diag.details["predicted_default"]["cpu_charge_s"]
    assert bound == pytest.approx((truth.parts_s["comm_exposed"] + charge) / truth.step_s)
    assert 0 <= diag.expected_gain <= bound
    assert f"at most the measured 13% exposed plus the model's {charge / truth.step_s:.0%}" in diag.summary


def test_a_raw_model_that_contradicts_the_measurement_is_reconciled_in_the_text(tuner, profiled):
    diag = tuner.diagnose(profiled)
    raw = diag.details["raw_model_exposed_s"]
    measured = profiled.truth.parts_s["comm_exposed"]
    # A 1 GB/s link leaves a ~5 MiB model next to nothing exposed; 52 ms were measured.
    assert raw < 0.25 * measured
    assert f"Uncalibrated, the model left {raw * 1e3:.1f} ms exposed against 52.0 ms measured" in diag.summary
    fit = diag.details["calibration"]
    assert f"collectives x{fit['comm_scale']:.1f} their probe time" in diag.summary
    assert fit["peer_delay_s"] > 0
    assert f"the peer rank posts the step's last collective {fit['peer_delay_s'] * 1e3:.1f} ms later" in (
        diag.summary
    )
    # The model's split of the measured figure is labelled as the model's.
    assert "Model: of the 52.0 ms exposed" in diag.summary


def test_unprofiled_baseline_says_it_fell_back(tuner):
    obs = synthetic_observation("example:cnn", step_s=STEP_S, breakdown=False)
    diag = tuner.diagnose(obs)
    assert diag.summary.startswith("exposed communication unknown (the baseline was not profiled)")
    assert "one compute factor" in diag.summary
    assert diag.details["calibration"]["method"] == calibration.COMPUTE_ONLY
    assert diag.details["predicted_default"]["step_s"] == pytest.approx(STEP_S, rel=1e-6)
    assert all(c.predicted_range_s for c in tuner.plan(obs, 2))
