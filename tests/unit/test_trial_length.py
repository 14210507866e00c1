"""Planning a trial's length from its expected step time and the trial timeout."""

import dataclasses

import numpy as np
import pytest

from tunekit.config import TuningConfig
from tunekit.store import Store, TrialRow
from tunekit.trials.decide import BASELINE, CANDIDATE, decide
from tunekit.trials.length import (
    DEFAULT_STARTUP_S,
    HEADROOM,
    plan_length,
    startup_estimate,
    step_estimate,
    trial_length,
)
from tunekit.trials.stats import MIN_MEASURED_STEPS


def test_a_trial_that_fits_runs_as_planned():
    # 10 s start-up + 19 steps x 1.0 s x 1.5 = 38.5 s, well inside 300 s.
    length = plan_length(1.0, warmup=3, steps=16, timeout_s=300, startup_s=10)
    assert (length.warmup, length.steps) == (3, 16)
    assert not length.shortened and not length.skipped and length.reason == ""


@pytest.mark.parametrize("predicted", [None, float("nan"), 0.0])
def test_no_usable_prediction_runs_as_planned(predicted):
    length = plan_length(predicted, warmup=3, steps=16, timeout_s=5, startup_s=10)
    assert (length.warmup, length.steps, length.reason) == (3, 16, "")


def test_warm_up_gives_way_before_measured_steps():
    # (300 - 10) / (12.1 x 1.5) = 15.98: room for 15 steps; warm-up goes first, to 1.
    length = plan_length(12.1, warmup=3, steps=16, timeout_s=300, startup_s=10)
    assert (length.warmup, length.steps) == (1, 14)
    assert length.shortened and not length.skipped
    assert length.reason == (
        "predicted 12.1 s/step: shortened to 15 of 19 planned steps to fit the 300 s trial timeout "
        "(1 warm-up + 14 measured, at 1.5x the estimate, after 10 s of start-up)"
    )


def test_only_warm_up_is_cut_when_that_is_enough():
    # Room for 18 steps: one warm-up step less, every measured step kept.
    length = plan_length(1.0, warmup=3, steps=16, timeout_s=10 + 18 * HEADROOM, startup_s=10)
    assert (length.warmup, length.steps) == (2, 16)


def test_never_fewer_measured_steps_than_the_decision_needs():
    fits_four = 10 + 4 * 20.0 * HEADROOM
    length = plan_length(20.0, warmup=3, steps=16, timeout_s=fits_four, startup_s=10)
    assert (length.warmup, length.steps) == (1, MIN_MEASURED_STEPS)
    skipped = plan_length(20.0, warmup=3, steps=16, timeout_s=fits_four - 1, startup_s=10)
    assert skipped.skipped and (skipped.warmup, skipped.steps) == (0, 0)
    assert (
        skipped.skip_reason
        == skipped.reason
        == (
            "predicted 20.0 s/step: even 4 steps would exceed the 129 s trial timeout "
            "(1 warm-up + 3 measured, at 1.5x the estimate, after 10 s of start-up)"
        )
    )


def test_the_example_from_the_issue_is_skipped_with_its_reason():
    # batch 512 on AlexNet: 12.1 s/step predicted, on a machine whose trials take 250 s to start.
    length = plan_length(12.1, warmup=3, steps=16, timeout_s=300, startup_s=250)
    assert length.skipped
    assert length.reason.startswith(
        "predicted 12.1 s/step: even 4 steps would exceed the 300 s trial timeout"
    )


def test_a_plan_shorter_than_the_minimum_is_its_own_minimum():
    # --warmup 0 --steps 2: nothing to cut; it runs as asked, or not at all.
    fits_two = 10 + 2 * 10.0 * HEADROOM
    assert plan_length(10.0, warmup=0, steps=2, timeout_s=fits_two, startup_s=10).steps == 2
    skipped = plan_length(10.0, warmup=0, steps=2, timeout_s=fits_two - 1, startup_s=10)
    assert (
        skipped.skipped
        and "even 2 steps would exceed" in skipped.reason
        and "(0 warm-up + 2 measured" in skipped.reason
    )


def _row(seq, role, cfg, predicted=None, status="pending", median=None, result=None):
    config = TuningConfig(cfg)
    return TrialRow(
        id=seq,
        study_id=1,
        seq=seq,
        role=role,
        plugin=next(iter(cfg), None),
        config_id=config.config_id,
        config=config.to_dict(),
        predicted_s=predicted,
        status=status,
        median_s=median,
        spread_s=None,
        samples_per_s=None,
        result=result,
        error=None,
        started=None,
        finished=None,
    )


def test_start_up_and_step_estimates_come_from_the_study():
    base = _row(0, BASELINE, {}, status="ok", median=0.1, result={"startup_s": 7.5})
    slow = _row(1, CANDIDATE, {"p": {"x": 1}}, status="too_slow", result={"startup_s": 21.0})
    leader = _row(
        2,
        CANDIDATE,
        {"p": {"x": 2}},
        predicted=0.05,
        status="ok",
        median=4.0,
        result={"startup_s": None},
    )
    confirm = _row(3, "confirm", {"p": {"x": 2}}, predicted=0.05)
    fresh = _row(4, CANDIDATE, {"p": {"x": 3}}, predicted=2.0)
    rows = [base, slow, leader, confirm, fresh]
    assert startup_estimate([]) == DEFAULT_STARTUP_S
    assert startup_estimate(rows) == 21.0  # the slowest start-up seen
    # A config already measured goes by its measurement, not by its prediction.
    assert step_estimate(confirm, rows) == (4.0, "measured")
    assert step_estimate(fresh, rows) == (2.0, "predicted")
    # A correction only counts as one where earlier trials moved the prediction.
    same, moved = (
        dataclasses.replace(fresh, corrected_s=2.0),
        dataclasses.replace(fresh, corrected_s=3.0),
    )
    assert step_estimate(same, rows) == (2.0, "predicted")
    assert step_estimate(moved, rows) == (3.0, "predicted (corrected by earlier trials)")
    length = trial_length(confirm, rows, warmup=3, steps=16, timeout_s=60)
    assert (length.warmup, length.steps, length.startup_s) == (1, 5, 21.0)
    assert length.reason.startswith("measured 4.0 s/step: shortened to 6 of 19 planned steps")


def test_a_shortened_run_is_compared_per_sample_like_any_other():
    """Three measured steps against 16-step baselines: the decision needs no fixed step count."""
    rng = np.random.default_rng(3)
    rows = [
        _row(
            0,
            BASELINE,
            {},
            status="ok",
            median=0.1,
            result={"measurement": {"step_s": list(rng.normal(0.1, 0.001, 16))}},
        ),
        _row(
            1,
            CANDIDATE,
            {"p": {"x": 1}},
            status="ok",
            median=0.05,
            result={"measurement": {"step_s": list(rng.normal(0.05, 0.0005, MIN_MEASURED_STEPS))}},
        ),
        _row(
            2,
            BASELINE,
            {},
            status="ok",
            median=0.1,
            result={"measurement": {"step_s": list(rng.normal(0.1, 0.001, 16))}},
        ),
        _row(3, CANDIDATE, {"p": {"x": 2}}, status="skipped"),
        _row(4, CANDIDATE, {"p": {"x": 3}}, status="too_slow"),
    ]
    rows[3].error = "predicted 99.0 s/step: even 4 steps would exceed the 300 s trial timeout"
    rows[4].error = "too slow: 14.2 s per step, 9 of 19 steps done when the 300 s timeout came"
    d = decide(rows, 0.01)
    assert d["winner_config"] == TuningConfig({"p": {"x": 1}}).to_dict()
    assert d["speedup"] == pytest.approx(2.0, rel=0.05)
    by_status = {c["status"]: c for c in d["candidates"]}
    assert by_status["too_slow"]["error"].startswith("too slow: 14.2 s per step")
    assert by_status["skipped"]["error"].startswith("predicted 99.0 s/step")


def test_too_slow_is_final_and_survives_a_resume(tmp_path):
    store = Store(tmp_path / "s.db")
    sid = store.create_study(
        key="k", workload="w", graph_hash="g", hw_fingerprint="h", nproc=2, settings={}
    )
    t = store.add_trial(sid, seq=1, role=CANDIDATE, plugin="p", config_id="c", config={})
    store.start_trial(t)
    store.finish_trial(
        t, status="too_slow", error="too slow: 3.0 s per step, 7 of 19 steps done when ..."
    )
    assert store.reset_unfinished(sid) == 0  # what --resume does first
    row = store.trials(sid)[0]
    assert row.done and row.status == "too_slow"
    with pytest.raises(ValueError, match="not a final trial status"):
        store.finish_trial(t, status="slow")


def test_the_report_shows_each_trials_steps_and_why(tmp_path):
    from tunekit.report import report_data
    from tunekit.report.markdown import render_markdown
    from tunekit.trials.launcher import LaunchOptions

    store = Store(tmp_path / "s.db")
    sid = store.create_study(
        key="k", workload="w", graph_hash="g", hw_fingerprint="h", nproc=2, settings={}
    )
    short = plan_length(12.1, warmup=3, steps=16, timeout_s=300, startup_s=10)
    skip = plan_length(99.0, warmup=3, steps=16, timeout_s=300, startup_s=10)
    steps = [0.1, 0.11, 0.1]
    for seq, status, length, error in [
        (0, "ok", None, None),  # a row written before trials recorded their length
        (1, "ok", short, None),
        (2, "skipped", skip, skip.reason),
        (
            3,
            "too_slow",
            plan_length(None, 3, 16, 300),
            "too slow: 14.2 s per step, 9 of 19 steps done when ...",
        ),
    ]:
        t = store.add_trial(
            sid,
            seq=seq,
            role=BASELINE if seq == 0 else CANDIDATE,
            plugin=None,
            config_id=f"c{seq}",
            config={},
        )
        result = {"measurement": {"step_s": steps}} if status == "ok" else {}
        if length is not None:
            result["length"] = length.to_dict()
        store.finish_trial(
            t,
            status=status,
            median_s=0.1 if status == "ok" else None,
            spread_s=0.0,
            result=result,
            error=error,
        )
    md = render_markdown(report_data(store, sid, {}, LaunchOptions()))
    rows = md[md.index("## Trials") :].splitlines()
    assert any(r.startswith("| 0 | baseline | baseline | ok | — |") for r in rows)
    assert any(
        r.startswith("| 1 | candidate") and "| ok | 1+14 |" in r and short.reason in r for r in rows
    )
    assert any(
        r.startswith("| 2 | candidate") and "| skipped | — |" in r and skip.reason in r
        for r in rows
    )
    assert any(
        r.startswith("| 3 | candidate") and "| too_slow | 3+16 |" in r and "too slow: 14.2 s" in r
        for r in rows
    )
