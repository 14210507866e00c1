"""Calibration on the measured truth, and a diagnosis that starts from it."""

from __future__ import annotations

import re

import pytest

from tunekit.observe.truth import PART_LABELS, StepTruth
from tunekit.plugins.overlap_chunking import calibrated as calibration
from tunekit.plugins.overlap_chunking.explain import diagnosis_text, expected_gain
from tunekit.plugins.overlap_chunking.model import LayerCost, StepCosts, predict_ddp
from tunekit.plugins.overlap_chunking.plugin import OverlapChunking
from tunekit.plugins.overlap_chunking.search import is_default_ddp, rank_settings
from tunekit.testing import synthetic_breakdown, synthetic_observation


def six_layers() -> StepCosts:
    """Six layers of uneven times and sizes; all-reduce 1 s per 1000 B plus 0.05 s."""
    layers = tuple(
        LayerCost(f"l{i}", fwd, bwd, (nbytes,))
        for i, (fwd, bwd, nbytes) in enumerate(
            [
                (1.0, 2.0, 200),
                (0.5, 1.0, 0),
                (2.0, 3.0, 400),
                (1.0, 1.5, 800),
                (0.2, 0.4, 0),
                (0.5, 1.0, 1600),
            ]
        )
    )
    return StepCosts(
        layers,
        1e-3,
        0.1,
        2,
        lambda n: 0.05 + n / 1000,
        lambda n: 0.05 + n / 2000,
        comm_cpu_share=0.5,
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
    [
        (0.5, 1.0, 0.0, 1.0),
        (3.0, 20.0, 0.0, 1.0),
        (1.0, 2.0, 2.0, 1.0),
        (1.0, 8.0, 0.0, 0.6),
        (2.0, 3.0, 0.5, 1.3),
    ],
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
    # The gain is bounded by what is there to recover: the measured exposure.
    bound = diag.details["gain_bound"]
    assert bound == pytest.approx(truth.fraction("comm_exposed"))
    assert 0 <= diag.expected_gain <= bound
    assert "(at most the measured 13% exposed)" in diag.summary


def test_a_raw_model_that_contradicts_the_measurement_is_reconciled_in_the_text(tuner, profiled):
    diag = tuner.diagnose(profiled)
    raw = diag.details["raw_model_exposed_s"]
    measured = profiled.truth.parts_s["comm_exposed"]
    # A 1 GB/s link leaves a ~5 MiB model next to nothing exposed; 52 ms were measured.
    assert raw < 0.25 * measured
    assert (
        f"Uncalibrated, the model left {raw * 1e3:.1f} ms exposed against 52.0 ms measured"
        in diag.summary
    )
    fit = diag.details["calibration"]
    assert f"collectives x{fit['comm_scale']:.1f} their probe time" in diag.summary
    assert fit["peer_delay_s"] > 0
    assert (
        f"the peer rank posts the step's last collective {fit['peer_delay_s'] * 1e3:.1f} ms later"
        in (diag.summary)
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


# -- every part share the diagnosis quotes is the measured one -------------------------------


def quoted_shares(text: str) -> dict[str, list[int]]:
    """Every "<part> N%" (or "<part> ~N%") in ``text``: how a share of a step part is written
    (the same pattern as tests/integration/test_report_figures.py)."""
    found: dict[str, list[int]] = {}
    for part, label in PART_LABELS.items():
        for m in re.finditer(rf"{label}\s*(?:is|of|:)?\s*~?\s*(\d+(?:\.\d+)?)%", text):
            found.setdefault(part, []).append(round(float(m.group(1))))
    return found


def assert_quotes_only_measured_shares(summary: str, truth: StepTruth) -> None:
    shares = quoted_shares(summary)
    assert "comm_exposed" in shares, summary
    for part, quoted in shares.items():
        assert quoted == [round(100 * truth.fraction(part))] * len(quoted), summary


@pytest.mark.parametrize(
    ("exposed", "comm_total"),
    # Exposure the raw model contradicts (13%, 60%), and one it nearly agrees with (1%).
    [(0.13, 0.3), (0.01, 0.02), (0.60, 0.7)],
)
def test_every_share_quoted_is_measured_and_the_gain_is_at_most_the_exposure(
    tuner, exposed, comm_total
):
    fractions = {
        "compute": 0.87 - exposed,
        "comm_exposed": exposed,
        "data": 0.02,
        "optimizer": 0.03,
        "idle": 0.08,
    }
    breakdown = synthetic_breakdown(STEP_S, fractions, comm_total_s=comm_total * STEP_S)
    obs = synthetic_observation("example:cnn", step_s=STEP_S, breakdown=breakdown)
    diag = tuner.diagnose(obs)
    assert_quotes_only_measured_shares(diag.summary, obs.truth)
    assert 0 <= diag.expected_gain <= obs.truth.fraction("comm_exposed") + 1e-12
    assert f"at most the measured {exposed:.0%} exposed" in diag.summary


def test_a_compute_only_fit_on_a_profiled_baseline_labels_its_exposure_as_the_models():
    """When the joint fit is not possible the model keeps its own exposure; the text
    quotes the measured share and writes the model's as "Model (...): X ms left exposed"."""
    costs = six_layers()
    made = truth_of(costs.calibrated(1.5, 1.0, other_s=0.4))
    parts = dict(made.parts_s)
    parts["compute"] -= 0.3 * made.step_s
    parts["comm_exposed"] += 0.3 * made.step_s  # far more exposed than the model shows
    truth = StepTruth(made.step_s, parts, comm_total_s=parts["comm_exposed"])
    raw = per_layer_buckets(costs)
    fit = calibration._fit_compute_only(costs, truth, per_layer_buckets, raw, "for the test")
    assert fit.method == calibration.COMPUTE_ONLY
    best = next(s for s in rank_settings(fit.costs) if not is_default_ddp(s.knobs))
    gain, bound = expected_gain(fit, best.prediction)
    summary = diagnosis_text(fit, best, gain, bound, grad_mib=1.0)
    assert summary.startswith(truth.phrase("comm_exposed"))
    assert_quotes_only_measured_shares(summary, truth)
    assert f"{fit.baseline.blocked_s * 1e3:.1f} ms left exposed" in summary
    assert bound == pytest.approx(truth.fraction("comm_exposed"))
    assert f"(at most the measured {bound:.0%} exposed" in summary


def test_a_predicted_gain_beyond_the_exposure_is_explained_not_expected():
    """The model also counts CPU work of hidden communication it no longer charges to
    compute; the measured breakdown cannot confirm that, so the gain stops at the exposure."""
    costs = six_layers()
    made = truth_of(costs)
    parts = dict(made.parts_s)
    moved = 0.8 * parts["comm_exposed"]  # measured as compute: little left exposed
    parts["comm_exposed"] -= moved
    parts["compute"] += moved
    truth = StepTruth(made.step_s, parts, comm_total_s=made.comm_total_s - moved)
    fit = calibration.fit(costs, truth, per_layer_buckets)
    best = rank_settings(fit.costs)[0]
    predicted = (truth.step_s - best.prediction.step_s) / truth.step_s
    gain, bound = expected_gain(fit, best.prediction)
    assert bound == pytest.approx(truth.fraction("comm_exposed"))
    assert predicted > bound + calibration.NOISE_SHARE
    assert gain == pytest.approx(bound)
    summary = diagnosis_text(fit, best, gain, bound, grad_mib=1.0)
    assert (
        f"should recover ~{bound:.0%} of the step (at most the measured {bound:.0%} exposed)"
        in summary
    )
    assert f"model: {predicted:.0%} shorter" in summary
    assert_quotes_only_measured_shares(summary, truth)
