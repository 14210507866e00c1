"""Step time against the batch: the measured fit, its calibration on the baseline, and what the plan says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tunekit.errors import ConfigError
from tunekit.observe.step_timing import PARTS_TIMED, StepTiming, time_steps
from tunekit.observe.truth import StepTruth
from tunekit.plugins.batch_ps_sizing.model import StepTimeFit
from tunekit.plugins.batch_ps_sizing.plugin import BatchPsSizing
from tunekit.plugins.batch_ps_sizing.predict import MAX_EXTRAPOLATION, BatchStepModel
from tunekit.testing import synthetic_observation, tiny_workload
from tunekit.workload import Workload

# -- the fit ------------------------------------------------------------------------------


def test_fit_recovers_a_known_line():
    fixed, per_sample = 0.012, 0.0021
    fit = StepTimeFit.fit({b: [fixed + per_sample * b] for b in (8, 16, 32, 64)})
    assert fit.form == "line"
    assert fit.fixed_s == pytest.approx(fixed, rel=1e-6)
    assert fit.per_sample_s == pytest.approx(per_sample, rel=1e-6)
    assert fit.residual == pytest.approx(0.0, abs=1e-9)
    assert fit.seconds(256) == pytest.approx(fixed + per_sample * 256, rel=1e-6)


def test_fit_from_noisy_repeats_takes_medians_and_measures_their_noise():
    line = {b: 0.01 + 0.002 * b for b in (8, 16, 32, 64)}
    # One outlier repeat per batch (a busy neighbour): the medians ignore it.
    fit = StepTimeFit.fit({b: [t, t * 1.01, t * 3.0] for b, t in line.items()})
    assert fit.form == "line"
    assert fit.per_sample_s == pytest.approx(0.002, rel=0.02)
    assert fit.noise > 0


def test_two_points_suffice_and_a_bigger_batch_always_costs_more():
    # Noise made the larger batch look faster: the per-sample floor keeps the
    # prediction strictly increasing instead of flat (or falling).
    fit = StepTimeFit.fit({8: [0.040], 32: [0.038]})
    steps = [fit.seconds(b) for b in (8, 32, 64, 128, 256)]
    assert all(later > earlier for earlier, later in zip(steps, steps[1:], strict=False))
    assert fit.per_sample_s > 0


def test_measured_points_are_never_predicted_equal_for_different_batches():
    fit = StepTimeFit.fit({8: [0.02], 16: [0.03], 32: [0.05]})
    assert fit.seconds(64) < fit.seconds(128) < fit.seconds(256)


def test_a_cache_knee_is_fitted_with_a_steeper_slope_above_it():
    # 1 ms/sample up to batch 64, 3 ms/sample past it (activations left the cache).
    def true(b):
        return 0.005 + 0.001 * b + 0.002 * max(0, b - 64)

    batches = (8, 16, 32, 64, 128, 256)
    fit = StepTimeFit.fit({b: [true(b)] for b in batches})
    assert fit.form == "convex" and fit.knots == (64,)
    assert fit.line_residual > 0.03  # the line check failed, which is why
    for b in batches:
        assert fit.seconds(b) == pytest.approx(true(b), rel=1e-3)
    assert fit.marginal_s(200) == pytest.approx(0.003, rel=1e-3)
    assert "past 64" in fit.describe()


def test_extrapolation_is_measured_from_the_largest_timed_batch():
    fit = StepTimeFit.fit({8: [0.02], 32: [0.05]})
    assert fit.measured_range == (8, 32)
    assert fit.extrapolation(16) == 1.0 and fit.extrapolation(32) == 1.0
    assert fit.extrapolation(128) == 4.0


def test_fit_refuses_one_batch():
    with pytest.raises(ConfigError):
        StepTimeFit.fit({8: [0.02, 0.021]})


# -- calibration on the measured baseline --------------------------------------------------


def _timing(compute, data=lambda b: 1e-5 * b, optimizer=0.004, batches=(8, 16, 32)) -> StepTiming:
    return StepTiming(
        1,
        {
            b: [{"data": data(b), "compute": compute(b), "optimizer": optimizer}] * 3
            for b in batches
        },
    )


def _truth(step=0.100) -> StepTruth:
    parts = {
        "compute": 0.060,
        "comm_exposed": 0.025,
        "data": 0.002,
        "optimizer": 0.008,
        "idle": 0.005,
    }
    return StepTruth(step, {p: v * step / 0.1 for p, v in parts.items()})


def test_calibrated_model_reproduces_the_measured_baseline():
    model = BatchStepModel.build(16, _timing(lambda b: 0.004 + 0.001 * b), _truth(), 0.004)
    assert model.step_s(16) == pytest.approx(0.100, rel=1e-9)
    assert model.calibration.reproduces_baseline() == pytest.approx(0.100, rel=1e-9)
    assert sum(model.parts_s(16).values()) == pytest.approx(0.100, rel=1e-9)


def test_only_compute_and_data_scale_with_the_batch():
    # Here compute is 20 ms at batch 16 (4 + 16 x 1); measured it is 60 ms: x3.
    model = BatchStepModel.build(16, _timing(lambda b: 0.004 + 0.001 * b), _truth(), 0.004)
    parts = model.parts_s(32)
    truth = _truth()
    for fixed in ("comm_exposed", "optimizer", "idle"):
        assert parts[fixed] == pytest.approx(truth.parts_s[fixed])
    # compute(32) = 60 ms x (4 + 32) / (4 + 16) = 108 ms.
    assert parts["compute"] == pytest.approx(0.108, rel=1e-6)
    assert parts["data"] > truth.parts_s["data"]
    assert model.step_s(32) == pytest.approx(sum(parts.values()), rel=1e-9)
    assert model.step_s(16) < model.step_s(32) < model.step_s(64)


def test_accumulated_micro_batches_each_run_the_scaling_parts():
    # The job runs 4 micro-batches of 16 per step: its measured compute (60 ms) is 4 passes
    # of the fitted 20 ms, so the machine's scale is 60 / 80; one pass of 64 costs 68 ms fitted.
    model = BatchStepModel.build(
        16, _timing(lambda b: 0.004 + 0.001 * b), _truth(), 0.004, accumulation=4
    )
    assert model.step_s(16) == pytest.approx(0.100, rel=1e-9)  # the baseline, reproduced
    assert model.calibration.scales["compute"] == pytest.approx(0.060 / (4 * 0.020))
    # 64 x 1 against 16 x 4: the same samples, three passes' fixed 4 ms saved (scaled)
    parts = model.parts_s(64, accumulation=1)
    assert parts["compute"] == pytest.approx(0.060 / 0.080 * 0.068, rel=1e-6)
    assert model.step_s(64, 1) < model.step_s(16) < model.step_s(32)
    low, high = model.range_s(64, 1)
    assert low < model.step_s(64, 1) < high


def test_range_holds_the_prediction_and_widens_when_extrapolating():
    model = BatchStepModel.build(16, _timing(lambda b: 0.004 + 0.001 * b), _truth(), 0.004)
    widths = {}
    for b in (32, 64):
        low, high = model.range_s(b)
        assert low < model.step_s(b) < high
        widths[b] = (high - low) / model.step_s(b)
    assert model.extrapolation(32) == 1.0 and model.extrapolation(64) == 2.0
    assert widths[64] > widths[32]
    assert model.predictable(64) and not model.predictable(int(32 * MAX_EXTRAPOLATION) + 1)


# -- through the tuner ----------------------------------------------------------------------

FRACTIONS = {"compute": 0.74, "comm_exposed": 0.13, "data": 0.01, "optimizer": 0.09, "idle": 0.03}


@pytest.fixture(scope="module")
def cnn():
    """example:cnn (batch 32, range 8-256) observed with a measured, profiled 2-rank baseline."""
    obs = synthetic_observation("example:cnn", step_s=0.15, breakdown=FRACTIONS)
    tuner = BatchPsSizing(measure_budget_s=30.0)
    return obs, tuner, tuner.diagnose(obs), tuner.plan(obs, 8)


def test_tuner_reproduces_the_measured_baseline(cnn):
    obs, tuner, _, _ = cnn
    a = tuner.analyse(obs)
    assert a.predicted_step_s(32) == pytest.approx(obs.truth.step_s, rel=1e-9)
    assert a.predictions[32]["samples_per_s"] == pytest.approx(64 / obs.truth.step_s)


def test_diagnosis_starts_from_the_measured_truth(cnn):
    obs, tuner, diag, _ = cnn
    truth = obs.truth
    for part in ("comm_exposed", "optimizer", "idle", "compute"):
        assert truth.phrase(part) in diag.summary
    assert diag.summary.index(truth.phrase("comm_exposed")) < diag.summary.index("model:")
    assert "do not grow with the batch" in diag.summary
    # Lemma 3.1's R_O is the truth's: everything but compute, over compute.
    r_o = (truth.step_s - truth.parts_s["compute"]) / truth.parts_s["compute"]
    assert diag.details["lemma31"]["overhead_ratio"] == pytest.approx(r_o)
    assert f"R_O = {r_o:.3f}" in diag.summary


def test_gain_is_in_samples_per_second_against_the_measured_baseline(cnn):
    obs, tuner, diag, plan = cnn
    measured = 64 / obs.truth.step_s  # samples/s of the measured baseline, 2 ranks x 32
    if not plan:
        assert diag.expected_gain == 0.0 and not diag.applies
        return
    first = plan[0].details["samples_per_s"]
    assert first == pytest.approx(plan[0].global_batch / plan[0].predicted_step_s)
    assert diag.applies
    assert diag.expected_gain == pytest.approx(1 - measured / first)
    assert (
        f"{first / measured - 1:+.0%} samples/s over the measured {measured:,.0f}" in diag.summary
    )


def test_candidates_carry_global_batch_and_range_and_bigger_batches_take_longer(cnn):
    obs, tuner, _, plan = cnn
    a = tuner.analyse(obs)
    ordered = sorted(a.predictions)
    steps = [a.predictions[b]["step_s"] for b in ordered]
    assert all(later > earlier for earlier, later in zip(steps, steps[1:], strict=False))
    for cand in plan:
        b = cand.knobs["batch_size"]
        assert cand.global_batch == 2 * b
        low, high = cand.predicted_range_s
        assert low < cand.predicted_step_s < high
        assert cand.predicted_step_s == pytest.approx(a.predictions[b]["step_s"])


def test_batches_far_beyond_the_timed_ones_are_not_proposed():
    """With no measuring budget only the required batches are timed (8, 16 and 32):
    64 is a flagged extrapolation, 128 and 256 get no prediction and no candidate."""
    obs = synthetic_observation("example:cnn", step_s=0.15, breakdown=FRACTIONS)
    tuner = BatchPsSizing(measure_budget_s=0.0, timed_repeats=2)
    diag = tuner.diagnose(obs)
    a = tuner.analyse(obs)
    assert a.steps.fits["compute"].measured_range == (8, 32)
    assert set(a.unpredicted) == {128, 256}
    assert "no prediction for batch 128, 256" in diag.summary
    assert a.predictions[64]["extrapolation"] == 2.0
    plan = tuner.plan(obs, 8)
    assert all(c.knobs["batch_size"] <= 64 for c in plan)
    for cand in plan:
        if cand.knobs["batch_size"] == 64:
            assert "extrapolated 2.0x beyond the largest timed batch, 32" in cand.rationale


# -- timing ---------------------------------------------------------------------------------


class _AllocatorLimit(torch.nn.Module):
    """A linear layer whose input above ``limit`` samples fails as the CPU allocator does."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise RuntimeError(
                f"DefaultCPUAllocator: can't allocate memory: you tried {x.shape[0]}"
            )
        return self.fc(x)


def test_timing_rounds_cover_every_kept_batch_and_an_out_of_memory_ends_the_climb():
    base = tiny_workload()
    w = Workload(
        name="limited",
        model=lambda: _AllocatorLimit(32),
        make_batch=base.make_batch,
        batch_size=8,
        batch_range=(2, 128),
    )
    timing = time_steps(w, (4, 8, 16, 32, 64, 128), repeats=3)
    assert sorted(timing.samples) == [4, 8, 16, 32]
    assert all(
        len(rows) == 3 and set(rows[0]) == set(PARTS_TIMED) for rows in timing.samples.values()
    )
    assert set(timing.skipped) == {64, 128} and "out of memory" in timing.skipped[64]


def test_timing_stops_climbing_at_the_budget_but_keeps_the_required_batches():
    timing = time_steps(
        tiny_workload(), (2, 4, 8, 16, 32, 64), repeats=2, budget_s=0.0, required=(8, 4)
    )
    assert sorted(timing.samples) == [2, 4, 8]
    assert set(timing.skipped) == {16, 32, 64}
    assert "measuring budget" in timing.skipped[16]
    assert all(len(rows) == 2 for rows in timing.samples.values())


def test_candidates_count_samples_as_the_observation_counts_the_baseline():
    """Ranked per sample against ``obs.global_batch``: with micro-batches (accumulation 2)
    a candidate's global batch is the baseline's scaled by the batch, on the same scale."""
    w = dataclasses.replace(tiny_workload(), accumulation=2)
    obs = synthetic_observation(w, step_s=0.02, breakdown=FRACTIONS)
    tuner = BatchPsSizing(measure_budget_s=5.0)
    a = tuner.analyse(obs)
    base = a.predictions[w.batch_size]
    assert base["samples_per_s"] == pytest.approx(obs.global_batch / obs.truth.step_s)
    plan = tuner.plan(obs, 8)
    assert plan, "a tiny MLP's step is mostly per-step overhead: larger batches pay"
    for cand in plan:
        b = cand.knobs["batch_size"]
        if cand.details.get("trade"):  # fewer, larger micro-batches: the same samples
            assert b * cand.knobs["accumulation"] == w.batch_size * w.accumulation
            assert cand.global_batch == obs.global_batch
        else:
            assert cand.global_batch == obs.global_batch * b // w.batch_size
        assert cand.details["samples_per_s"] == pytest.approx(
            cand.global_batch / cand.predicted_step_s
        )


def test_a_job_that_accumulates_is_offered_larger_micro_batches_at_the_same_samples_per_step():
    # 4 micro-batches of 4: a tiny MLP's pass is mostly fixed overhead, so one pass of 16
    # (which fits: the CPU has memory to spare) trains the same 16 samples per rank faster.
    w = dataclasses.replace(tiny_workload(), batch_size=4, accumulation=4, batch_range=(2, 64))
    obs = synthetic_observation(w, step_s=0.02, breakdown=FRACTIONS)
    tuner = BatchPsSizing(measure_budget_s=5.0)
    a = tuner.analyse(obs)
    assert set(a.trades) == {1, 2}  # 16 x 1 and 8 x 2
    assert a.trades[1]["batch"] == 16 and a.trades[2]["batch"] == 8
    assert a.trades[1]["step_s"] < a.trades[2]["step_s"] < a.predictions[4]["step_s"]
    plan = tuner.plan(obs, 8)
    trades = [c for c in plan if c.details.get("trade")]
    assert [c.knobs for c in trades[:1]] == [{"batch_size": 16, "accumulation": 1}]
    assert plan[0] is trades[0]  # the same update, faster: tried first
    assert all(c.global_batch == obs.global_batch for c in trades)
    assert "the same 32 samples per step" in trades[0].rationale
    diag = tuner.diagnose(obs)
    assert diag.applies and "16/rank x 1 micro-batch (now 4 x 4" in diag.summary
    assert tuner.snippet(trades[0].knobs) == (
        "batch_size = 16  # per rank; scale the learning rate by your rule\n"
        "accumulation = 1  # micro-batches per optimizer step (loss / accumulation each)"
    )


def test_a_job_without_accumulation_or_batch_range_gets_no_trade():
    for w in (
        tiny_workload(),
        dataclasses.replace(tiny_workload(), accumulation=4, batch_range=None),
    ):
        obs = synthetic_observation(w, step_s=0.02, breakdown=FRACTIONS)
        assert BatchPsSizing(measure_budget_s=5.0).analyse(obs).trades == {}
