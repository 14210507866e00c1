"""The views the screens render, built from the core's own formats (no Textual, no processes)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from tunekit.config import TuningConfig
from tunekit.events import Decided, StudyStarted, TrialFinished, TrialStarted
from tunekit.observe.telemetry import TelemetrySampler
from tunekit.plugin_loading import load_all
from tunekit.runtime.live_metrics import MetricsTail, live_baseline
from tunekit.tui.formatting import describe_config, ms, pct, rate, size
from tunekit.tui.state import (
    HISTORY,
    BaselineView,
    StudyView,
    TunerView,
    best_target,
    candidate_view,
    fold_study,
    hotspots,
    live_view,
    profile_from_observed,
    profile_from_report,
    trial_target,
    tuner_views,
)
from tunekit.tui.widgets.breakdown import bar_widths


def test_live_view_from_a_real_host_sampler():
    sampler = TelemetrySampler({0: os.getpid()}, nvml=False, pyspy=False)
    sampler.sample_once()
    deadline = time.perf_counter() + 0.05
    while time.perf_counter() < deadline:  # some CPU for the second sample to measure
        sum(range(1000))
    sampler.sample_once()
    view = live_view(
        "r1",
        "example:cnn",
        {"status": "running", "step": 3},
        [],
        sampler.series.to_dict(),
        sampler.static(),
        sampler.notices,
    )
    (rank,) = view.ranks
    assert rank.rank == 0 and rank.pid == os.getpid()
    assert len(rank.cpu_pct) == 1  # the first sample only starts the counter
    assert rank.rss_bytes > 10 * 2**20
    assert len(view.system_cpu) == 2
    assert view.gpu is False and view.devices == ()


def test_nvml_counters_become_rates_and_history_is_bounded(fixed):
    metrics = fixed.metrics(HISTORY + 30)
    view = live_view(
        "r1",
        "w",
        fixed.status(HISTORY + 30),
        metrics,
        {"nvml": fixed.nvml_series(5)},
        {"nvml": {"devices": [{"index": 0, "name": "A100"}]}},
    )
    assert len(view.step_ms) == HISTORY
    assert view.step_ms[-1] == pytest.approx(metrics[-1]["step_s"] * 1e3)
    gpu0 = view.devices[0]
    assert gpu0.name == "A100" and len(gpu0.util_pct) == 5
    assert gpu0.nvlink_tx == pytest.approx([40 * 2**30] * 4)  # 40 GiB more each second
    assert gpu0.mem_total == 40 * 2**30
    assert view.devices[1].name == ""  # no static entry: no name, still shown


def test_metrics_tail_reads_new_lines_only_and_survives_truncation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path, keep=3)
    assert tail.read() == []
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(4)) + '{"step": 4')
    assert [m["step"] for m in tail.read()] == [1, 2, 3]  # the cut line waits
    with open(path, "a") as f:
        f.write(', "loss": 1}\n')
    assert [m["step"] for m in tail.read()] == [2, 3, 4]
    path.write_text(json.dumps({"step": 0}) + "\n")  # a resume rewrote it
    assert [m["step"] for m in tail.read()] == [0]


def test_the_live_baseline_is_the_trailing_run_of_untuned_steps(fixed):
    base = fixed.metrics(30)
    tuned = fixed.metrics(30, fixed.BUCKETS)
    m = live_baseline(base, world_size=2)
    assert m is not None and len(m.step_s) == 27  # three warm-up steps left out
    assert m.samples_per_s == pytest.approx(64 / m.median_s)
    assert live_baseline(base + tuned, world_size=2) is None  # the job runs another config now
    assert live_baseline(base, world_size=4) is None
    assert live_baseline(base[:10], world_size=2) is None  # too few steps


def test_fold_study_follows_a_whole_tuning(fixed):
    study = StudyView()
    for ev, config in fixed.tuning_events(["overlap_chunking", "batch_ps_sizing"]):
        study = fold_study(study, ev, config)
    assert study.state == "finished" and study.study_id == 7 and study.current is None
    assert [(t.seq, t.status) for t in study.trials] == [
        (0, "ok"),
        (1, "ok"),
        (2, "crash"),
        (3, "ok"),
    ]
    assert study.trials[2].error == "RuntimeError: out of memory on rank 1"
    assert (
        study.best.seq == 1 and study.baseline_median_s == 0.232
    )  # the decision's pooled baseline
    assert study.observed["baseline_median_s"] == 0.231
    target = best_target(study)
    assert target.config == fixed.BUCKETS and target.significant


def test_without_a_winner_the_fastest_measured_candidate_is_offered_as_not_significant(fixed):
    study = fold_study(StudyView(), StudyStarted(1, "w", 2, "hw", False))
    assert best_target(study) is None
    study = fold_study(study, TrialStarted(1, 0, "baseline", None, "baseline", None, 1, 3))
    assert study.current == 1 and study.trials[0].status == "running"
    study = fold_study(
        study,
        TrialFinished(
            1, 0, "baseline", None, "baseline", "ok", 0.200, 0.01, None, samples_per_s=320.0
        ),
        fixed.BASE,
    )
    for tid, med, cfg in ((2, 0.198, fixed.BUCKETS), (3, 0.205, fixed.TWO_CHUNK)):
        study = fold_study(
            study,
            TrialFinished(
                tid,
                tid - 1,
                "candidate",
                "overlap_chunking",
                f"c{tid}",
                "ok",
                med,
                0.02,
                0.19,
                samples_per_s=64 / med,
            ),
            cfg,
        )
    assert best_target(study).label.startswith("best so far of study 1: fastest candidate c2")
    study = fold_study(
        study,
        Decided(
            {
                "winner": "baseline",
                "baseline_median_s": 0.2,
                "reason": "no candidate beat the baseline beyond noise",
                "winner_config": fixed.BASE,
            }
        ),
    )
    target = best_target(study)
    assert target.config == fixed.BUCKETS and not target.significant
    assert (
        target.label
        == "the decision of study 1 kept the baseline; fastest candidate c2, 1.01x the baseline's"
        " samples/s"
    )
    assert trial_target(study.trials[2]).label == "trial 2: c3"


def test_tuner_views_of_the_installed_plugins():
    records = load_all()
    views = tuner_views(records, enabled=["overlap_chunking"])
    by_name = {v.name: v for v in views}
    assert "overlap_chunking" in by_name and by_name["overlap_chunking"].aspect == "grad_sync"
    assert by_name["overlap_chunking"].title
    assert [v.name for v in views if v.enabled] == ["overlap_chunking"]
    assert all(v.enabled == v.loaded for v in tuner_views(records))


def test_a_candidate_is_described_without_its_default_knobs():
    tuner = {r.name: r.tuner for r in load_all() if r.ok}["overlap_chunking"]
    knobs = tuner.validate({"bucket_cap_mb": 8})
    view = candidate_view(
        "overlap_chunking",
        {"knobs": knobs, "predicted_step_s": 0.2, "rationale": "r"},
        tuner.defaults(),
    )
    assert view.description == "overlap_chunking(bucket_cap_mb=8.0)"
    assert TuningConfig.from_dict(dict(view.config)).plugins["overlap_chunking"] == knobs


def test_profile_views_from_a_report_and_from_a_study(fixed):
    view = profile_from_report(fixed.profile_report(), fixed.pyspy_series())
    assert sum(f for _, _, f in view.parts) == pytest.approx(1.0)
    assert view.overlap_R == 40.0 and len(view.layers) == 6
    assert view.layers[0].flops == pytest.approx(1e9 * 0.0354)
    assert [h.rank for h in view.hotspots] == ["0", "1"]
    assert dict(view.hotspots[1].categories) == pytest.approx({"native": 0.5, "idle": 0.5})
    summary = next(
        ev for ev, _ in fixed.tuning_events([]) if type(ev).__name__ == "Observed"
    ).summary
    observed = profile_from_observed(summary)
    assert observed.source.startswith("baseline") and observed.measured_step_s == 0.231
    assert [h.rank for h in observed.hotspots] == ["0", "1"]
    assert dict(observed.hotspots[0].categories) == pytest.approx({"native": 0.8, "python": 0.2})


def test_hot_spots_are_summarised_rank_by_rank(fixed):
    (r0, r1) = hotspots(fixed.pyspy_series())
    assert r0.samples == 36 and r1.samples == 36
    assert r0.top[0] == ("_conv_forward (conv.py:10)", pytest.approx(24 / 36))
    assert r0.flags == ("optimizer step: 33% of stack samples",)


@pytest.mark.parametrize("width", [10, 37, 118])
def test_the_breakdown_bar_fills_its_width(width):
    cells = bar_widths([0.66, 0.24, 0.01, 0.01, 0.08], width)
    assert sum(cells) == width and cells[0] > cells[1] > cells[4]


def test_formatting():
    assert ms(0.2318) == "231.8 ms" and ms(None) == "—"
    assert pct(0.314) == "31%"
    assert size(1536) == "1.5 KiB" and size(12) == "12 B" and size(3 * 2**30) == "3.0 GiB"
    assert rate(2**20) == "1.0 MiB/s"
    assert describe_config({"plugins": {}}) == "baseline"
    assert describe_config({"plugins": {"x": {"a": 1}}}) == "x(a=1)"


def test_the_best_candidate_is_the_one_with_most_samples_per_second_not_the_shortest_step():
    """Issue 19: "best so far" was judged per step beside a per-sample decision."""
    study = StudyView()
    rows = [
        (1, "baseline", None, "baseline", 0.200, 64 / 0.200),
        (2, "candidate", "overlap_chunking", "short", 0.190, 64 / 0.190),
        (3, "candidate", "batch_ps_sizing", "big batch", 0.340, 128 / 0.340),
    ]
    for tid, role, plugin, desc, med, per_s in rows:
        ev = TrialFinished(
            tid, tid - 1, role, plugin, desc, "ok", med, 0.01, None, samples_per_s=per_s
        )
        study = fold_study(study, ev, {})
    assert study.best.description == "big batch"
    assert study.speedup(study.best) == pytest.approx((128 / 0.340) / (64 / 0.200))


def test_predictions_are_shown_against_the_jobs_measured_baseline():
    """Issue 19: "best predicted" mixed baselines; now samples/s over the job's own."""
    base = BaselineView(64, 0.200, "the live job's last 40 untuned steps")
    step = candidate_view("overlap_chunking", {"knobs": {}, "predicted_step_s": 0.180})
    batch = candidate_view(
        "batch_ps_sizing",
        {"knobs": {"batch_size": 64}, "predicted_step_s": 0.300, "global_batch": 128},
    )
    assert step.samples_per_s(base) == pytest.approx(64 / 0.180)
    assert batch.speedup(base) == pytest.approx((128 / 0.300) / 320)
    tuner = TunerView("t", candidates=(step, batch))
    assert tuner.best(base) is batch  # more samples/s, though a longer step
    assert step.speedup(BaselineView(64, None, "models alone")) is None  # no measured baseline


def test_a_tuning_that_has_not_started_a_trial_says_no_trial_count():
    """Issue 19: "trial 0/0" while the tuning observed and planned."""
    from tunekit.tui.screens.tuners import tune_line

    starting = StudyView(state="running", message="observing the workload")
    line = tune_line(starting, "2 trial(s)", 1).plain
    assert "trial 0" not in line and "observing the workload" in line
    running = dataclasses.replace(starting, index=3, total=8)
    assert "trial 3 of 8" in tune_line(running, "2 trial(s)", 1).plain


def test_layers_are_named_as_the_model_names_them(fixed):
    """Issue 35: layers were named `_3`, `_6` (the traced nodes' names)."""
    report = fixed.profile_report()
    for t in report["layer_profile"]["layers"]:
        t["name"] = "_" + t["name"].rsplit(".", 1)[-1]  # as fx names a bare Sequential's
    report["layer_labels"] = {"_3": "3 Conv2d", "_0": "0 Conv2d"}
    names = [row.name for row in profile_from_report(report).layers]
    assert names[:2] == ["0 Conv2d", "3 Conv2d"] and "_6" in names  # no label: its own name
    observed = profile_from_observed(
        {"top_layers": [{"name": "_3", "label": "3 Conv2d", "kind": "conv", "forward_s": 0.01,
                         "backward_s": 0.02}]}
    )  # fmt: skip
    assert [row.name for row in observed.layers] == ["3 Conv2d"]


def test_applies_and_rollbacks_are_marked_where_they_fall(fixed):
    """Issue 35: no mark at an apply or a rollback, and one line over batch 32 and batch 64."""
    changes = [(45, fixed.BUCKETS), (52, fixed.BASE)]
    events = [
        {"kind": "applied", "step": 45},
        {"kind": "paused", "step": 47},
        {"kind": "rolled_back", "step": 52},
        {"kind": "applied", "step": 3},  # before the window shown: not marked
    ]
    view = live_view(
        "r", "w", fixed.status(60), fixed.metrics(60, fixed.BASE, changes)[10:], {},
        events=events, applied=0,
    )  # fmt: skip
    assert view.changes == ((35, "apply"), (42, "rollback"))  # indices into the 50 steps shown
    assert view.step_configs[:35] == (0,) * 35 and view.step_configs[35:42] == (1,) * 7
    assert view.step_configs[42:] == (0,) * 8  # back to the first config: its colour again


def test_the_time_left_follows_the_trials_that_ran(fixed):
    """Issue 35: no estimate of a tuning's time left. The mean wall time of the trials that
    ran, times the trials to come, less what the one in flight has done."""
    study = fold_study(StudyView(), StudyStarted(1, "w", 2, "hw", False), now=0.0)
    study = fold_study(study, TrialStarted(1, 0, "baseline", None, "baseline", None, 1, 1), now=0.0)
    assert study.time_left_s(now=5.0) is None  # nothing ran yet: no guess
    study = fold_study(
        study,
        TrialFinished(1, 0, "baseline", None, "baseline", "ok", 0.2, 0.01, None),
        now=40.0,
    )
    study = fold_study(study, TrialStarted(2, 1, "candidate", "x", "c", 0.19, 2, 4), now=40.0)
    # 40 s per trial: 2 to come after this one, which has run 10 of its 40 s.
    assert study.time_left_s(now=50.0) == pytest.approx(2 * 40 + 30)
    assert study.time_left_s(now=100.0) == pytest.approx(2 * 40 + 4)  # overdue: a little left
    skipped = TrialFinished(3, 2, "candidate", "x", "d", "skipped", None, None, None)
    study = fold_study(study, skipped, now=100.0)  # over, without counting as a trial's time
    assert [t.wall_s for t in study.trials] == [40.0, None, None]


def test_a_cancelled_tuning_leaves_no_trial_running(fixed):
    from tunekit.tui.state import end_study

    study = fold_study(StudyView(), StudyStarted(1, "w", 2, "hw", False))
    study = fold_study(study, TrialStarted(1, 0, "baseline", None, "baseline", None, 1, 1))
    ended = end_study(study, "cancelled", "cancelled")
    assert [t.status for t in ended.trials] == ["cancelled"]
    assert ended.current is None and ended.done == 1 and not ended.running


def test_the_tuners_diagnose_one_after_the_other_during_a_tuning():
    """Issue 35: "…" was the only sign of progress while the tuners diagnosed."""
    from tunekit.events import Diagnosed, Observed, Planned, PluginProblem
    from tunekit.tui.state import fold_tuners

    views = (TunerView("a"), TunerView("b"), TunerView("c", enabled=False), TunerView("d"))

    def states(vs):
        return [(v.name, v.state, v.activity) for v in vs]

    views = fold_tuners(views, StudyStarted(1, "w", 2, "hw", False))
    assert [v.state for v in views] == ["waiting", "waiting", "idle", "waiting"]
    views = fold_tuners(views, TrialStarted(1, 0, "baseline", None, "baseline", None, 1, 1))
    assert [v.state for v in views] == ["waiting", "waiting", "idle", "waiting"]
    views = fold_tuners(views, Observed({}))
    assert states(views)[0] == ("a", "diagnosing", "diagnosing")
    views = fold_tuners(views, Diagnosed("a", True, "x; y", 0.1))
    assert states(views)[0] == ("a", "diagnosing", "planning its candidates")
    views = fold_tuners(views, Planned("a", []))
    assert states(views)[:2] == [("a", "diagnosed", ""), ("b", "diagnosing", "diagnosing")]
    views = fold_tuners(views, PluginProblem("b", "", "diagnose failed", "boom"))
    assert [v.state for v in views] == ["diagnosed", "failed", "idle", "diagnosing"]
    views = fold_tuners(views, Diagnosed("d", False, "no", None))
    assert [v.state for v in views] == ["diagnosed", "failed", "idle", "diagnosed"]
    assert views[3].headline == "does not apply · no"


def test_a_tuner_that_said_it_does_not_apply_and_won_is_explained(fixed):
    """Issue 35: batch_ps_sizing "does not apply (no batch is predicted to beat batch 32)",
    then won the tuning at 1.36x without a word of why."""
    from tunekit.events import Decided, StudyStarted, TrialFinished, TrialStarted
    from tunekit.tui.screens.trials import best_text
    from tunekit.tui.state import StudyView, TunerView, fold_study

    study = fold_study(StudyView(), StudyStarted(1, "w", 2, "hw", False))
    for ev in (
        TrialStarted(1, 0, "baseline", None, "baseline", None, 1, 2),
        TrialFinished(1, 0, "baseline", None, "baseline", "ok", 0.2, 0.01, None, samples_per_s=320.0),
        TrialStarted(2, 1, "search", "batch_ps_sizing", "batch search", None, 2, 2),
        TrialFinished(2, 1, "search", "batch_ps_sizing", "batch_size=64", "ok", 0.3, 0.01, None,
                      samples_per_s=435.0),
        Decided({"winner": "batch_ps_sizing(batch_size=64)", "winner_trial": 2, "speedup": 1.36,
                 "reason": "36% more samples/s"}),
    ):  # fmt: skip
        study = fold_study(study, ev)
    said_no = TunerView("batch_ps_sizing", applies=False, state="diagnosed", summary="no")
    text = str(best_text(study, (said_no,)))
    assert "batch_ps_sizing's model said it does not apply; its in-job search measured" in text
    said_yes = dataclasses.replace(said_no, applies=True)
    assert "does not apply" not in str(best_text(study, (said_yes,)))
