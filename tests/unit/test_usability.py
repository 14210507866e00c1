"""Issue 19's rough edges, piece by piece: configs from plan to apply, the budget and what a
decision says about its limits, durations and names, status throughput, report paths."""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
import pytest

from tunekit.cli.common import parse_duration, split_names
from tunekit.cli.run import read_config, throughput
from tunekit.config import TuningConfig, check_batch
from tunekit.errors import ConfigError
from tunekit.events import BUDGET_SKIP
from tunekit.orchestrator import (
    AutoSettings,
    _qualify,
    _Run,
)
from tunekit.report import from_here
from tunekit.report.data import snippet
from tunekit.store import TrialRow
from tunekit.trials.decide import BASELINE, CANDIDATE, CONFIRM, baseline_drift, decide
from tunekit.trials.launcher import LaunchOptions

# -- item 8: PLUGIN.knob=value, the form plan prints and apply/trial take ----------------


def test_pairs_read_back_as_the_config_they_came_from():
    config = TuningConfig(
        {
            "overlap_chunking": {"f": 1, "k": 9, "mode": "two_chunk"},
            "layer_split": {"plan": {"_0": "w2", "output": "n2"}},
            "batch_ps_sizing": {"batch_size": 64, "cudnn_benchmark": True, "tag": "7"},
        }
    )
    pairs = config.to_pairs()
    assert "overlap_chunking.mode=two_chunk" in pairs and 'batch_ps_sizing.tag="7"' in pairs
    assert 'layer_split.plan={"_0":"w2","output":"n2"}' in pairs
    assert TuningConfig.from_pairs(pairs) == config
    assert read_config(tuple(pairs)) == config


def test_every_config_form_apply_takes(tmp_path):
    want = TuningConfig({"overlap_chunking": {"k": 9, "mode": "two_chunk"}})
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(want.to_dict()))
    assert read_config(("overlap_chunking.k=9", "overlap_chunking.mode=two_chunk")) == want
    assert read_config((str(path),)) == want
    assert read_config(('{"overlap_chunking": {"k": 9, "mode": "two_chunk"}}',)) == want
    # What `tunekit plan` printed before issue 19, pasted: not "config file … not found".
    with pytest.raises(ConfigError, match="is a description, not a config.*PLUGIN.knob=value"):
        read_config(("overlap_chunking(f=1, k=9, mode=two_chunk)",))
    with pytest.raises(ConfigError, match="'k9' is not PLUGIN.knob=value"):
        read_config(("overlap_chunking.mode=two_chunk", "k9"))
    with pytest.raises(ConfigError, match="is not PLUGIN.knob=value"):
        TuningConfig.from_pairs(["mode=two_chunk"])


# -- item 12: the run's real batch range, checked before sending --------------------------


def test_a_batch_outside_the_runs_range_is_refused_in_one_line():
    status = {"run_id": "r1", "batch": {"size": 32, "workload": 32, "range": [8, 256]}}
    check_batch(TuningConfig({"batch_ps_sizing": {"batch_size": 64}}), status)
    check_batch(TuningConfig({"batch_ps_sizing": {"batch_size": 0}}), status)  # keeps its own
    with pytest.raises(
        ConfigError, match=r"batch_size=100000 is outside run r1's batch range \(8–256"
    ):
        check_batch(TuningConfig({"batch_ps_sizing": {"batch_size": 100000}}), status)
    fixed = {"run_id": "r2", "batch": {"size": 32, "workload": 32, "range": None}}
    with pytest.raises(ConfigError, match="the workload sets no batch_range"):
        check_batch(TuningConfig({"batch_ps_sizing": {"batch_size": 64}}), fixed)
    check_batch(
        TuningConfig({"batch_ps_sizing": {"batch_size": 64}}), {}
    )  # an older run: the job checks


def test_zero_durations_and_empty_names_are_refused_as_such():
    with pytest.raises(ValueError, match="'0s' is no time at all"):
        parse_duration("0s")
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration("soon")
    assert parse_duration("1m30s") == 90.0
    with pytest.raises(click.BadParameter, match="--plugins '' names no tuner"):
        split_names(("",))
    assert split_names(()) is None and split_names(("a, b", "c")) == ["a", "b", "c"]


# -- item 13: status throughput and its trend -----------------------------------------------


def test_status_throughput_is_of_the_current_config_with_a_trend():
    old = [{"config_id": "base", "samples_per_s": 100.0}] * 30
    now = [{"config_id": "new", "samples_per_s": 200.0 + i} for i in range(40)]
    text = throughput(old + now, "new")
    assert text.startswith(
        "219.5 samples/s (median of the last 40 step(s) of this config), trend ▁"
    )
    assert text.endswith("█ +16%")
    assert throughput(old, "new") == ""
    assert (
        throughput(now[:3], "new")
        == "201.0 samples/s (median of the last 3 step(s) of this config)"
    )


# -- item 10: the snippet's paths work from where tunekit ran -------------------------------


def test_the_snippet_names_the_config_where_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert from_here(Path("tunekit-out") / "best_config.json") == "tunekit-out/best_config.json"
    assert from_here(tmp_path / "out" / "best_config.json") == "out/best_config.json"
    elsewhere = tmp_path.parent / "elsewhere.json"
    assert from_here(elsewhere) == str(elsewhere.resolve())
    text = snippet(
        "example:cnn",
        TuningConfig(),
        {},
        LaunchOptions(nproc=2),
        config_path="tunekit-out/best_config.json",
    )
    assert "tunekit run example:cnn --nproc 2 --config tunekit-out/best_config.json" in text
    assert "tunekit apply RUN tunekit-out/best_config.json" in text


# -- items 11, 12, 15: the budget, --trials 0, a drifting baseline ---------------------------


def _row(i, role, cfg, step_s, status="ok", error=None, noise=0.005):
    steps = list(step_s * np.random.default_rng(i).normal(1, noise, 12)) if status == "ok" else []
    return TrialRow(
        id=i,
        study_id=1,
        seq=i,
        role=role,
        plugin=next(iter(cfg), None),
        config_id=TuningConfig(cfg).config_id,
        config=TuningConfig(cfg).to_dict(),
        predicted_s=None,
        status=status,
        median_s=float(np.median(steps)) if steps else None,
        spread_s=0.0,
        samples_per_s=None,
        result={"measurement": {"step_s": steps}, "ranks": [{"global_batch": 64}]}
        if steps
        else None,
        error=error,
        started=None,
        finished=None,
    )


def _timed(i, role, cfg, wall_s, status="ok", predicted_s=None):
    """A trial row as the store keeps it, with its wall time, 10 s of start-up and 3 + 12 steps
    of 0.1 s."""
    row = _row(i, role, cfg, 0.1 if status == "ok" else 0, status=status, noise=0)
    row.predicted_s = predicted_s
    if status == "ok":
        row.result.update(wall_s=wall_s, startup_s=10.0, length={"warmup": 3, "steps": 12})
    return row


def test_the_budget_keeps_room_for_the_baseline_and_a_confirmation_behind_a_candidate():
    run = _Run(AutoSettings(budget_s=60.0))
    run.started -= 20  # 20 s spent
    fast = {"p": {"x": 1}}
    rows = [
        _timed(0, BASELINE, {}, 25.0),  # 10 s start-up, 1.5 s of steps, then profiled steps
        _timed(1, CANDIDATE, fast, 0, status="pending", predicted_s=0.1),
        _timed(2, BASELINE, {}, 0, status="pending"),
    ]
    # Each trial estimated at the first one's start-up, 3 + 16 steps of 0.1 s and a second
    # after them (the first baseline's own tail is its profiling, not a trial's): the
    # candidate, the baseline closing its block, a confirmation and its baseline are
    # 4 x 12.9 s, past the 40 s left.
    assert run.walls_for(rows[1], rows) == pytest.approx([12.9] * 4)
    assert not run.fits_budget(run.walls_for(rows[1], rows))
    confirm = _timed(3, CONFIRM, fast, 0, status="pending", predicted_s=0.1)
    assert run.walls_for(confirm, rows) == pytest.approx([12.9, 12.9])
    assert run.fits_budget(run.walls_for(confirm, rows))
    assert run.fits_budget(run.walls_for(rows[2], rows))
    # A plain baseline run since: baselines are estimated at its 12 s, and a config's own
    # earlier run at its own wall; what trials take after their steps, from the plain ones.
    rows[2] = _timed(2, BASELINE, {}, 12.0)  # 0.5 s after its steps
    assert run.walls_for(confirm, rows) == pytest.approx([12.4, 12.0])
    rows.append(_timed(3, CONFIRM, fast, 9.0))
    assert run.walls_for(confirm, rows) == pytest.approx([9.0, 12.0])
    assert _Run(AutoSettings()).fits_budget([1e9])  # no budget


def test_a_decision_says_what_limited_it():
    fast = {"p": {"x": 1}}
    trials = [
        _row(0, BASELINE, {}, 0.100),
        _row(1, CANDIDATE, fast, 0.080),
        _row(2, BASELINE, {}, 0.101),
        _row(3, CANDIDATE, {"p": {"x": 2}}, 0, status="skipped", error=BUDGET_SKIP),
    ]
    decision = decide(trials, 0.01)
    notices = _qualify(decision, trials, AutoSettings(trials=None, budget_s=90.0), {})
    assert decision["winner_config"] == TuningConfig(fast).to_dict() and not notices
    assert decision["reason"].endswith(
        "; 1 planned trial(s) did not fit the 90 s budget; not confirmed by a second run (the time budget left no room)"
    )

    zero = [_row(0, BASELINE, {}, 0.1)]
    decision = decide(zero, 0.01)
    _qualify(decision, zero, AutoSettings(trials=0), {})
    assert decision["reason"].startswith("--trials 0: the baseline was measured")
    assert "proposed" not in decision["reason"]


def test_a_drifting_baseline_is_said_to_be_too_noisy_to_decide():
    # Issue 19's study: 862 -> 2122 -> 1181 ms
    trials = [
        _row(0, BASELINE, {}, 0.862, noise=0),
        _row(1, CANDIDATE, {"p": {"x": 1}}, 1.5),
        _row(2, BASELINE, {}, 2.122, noise=0),
        _row(3, BASELINE, {}, 1.181, noise=0),
    ]
    drift = baseline_drift(trials)
    assert drift["ratio"] == pytest.approx(2.122 / 0.862, rel=0.02)
    decision = decide(trials, 0.01)
    (notice,) = _qualify(decision, trials, AutoSettings(), {})
    assert notice.level == "warning" and "too noisy to decide" in notice.message
    assert "862 → 2122 → 1181 ms/step" in notice.message and "run again" in notice.message
    assert "too noisy to decide" in decision["reason"] and decision["baseline_drift"] == drift
    steady = [_row(0, BASELINE, {}, 0.100), _row(1, BASELINE, {}, 0.110)]
    assert baseline_drift(steady) is None


def test_the_decision_says_whether_measuring_more_made_it_clear_or_the_budget_ran_out():
    """Issue 35: paired rounds on a noisy machine end clear or spent, and the decision says which."""
    trials = [
        _row(0, BASELINE, {}, 0.100, noise=0),
        _row(1, CANDIDATE, {"p": {"x": 1}}, 0.08),
        _row(2, BASELINE, {}, 0.140, noise=0),
        _row(3, "confirm", {"p": {"x": 1}}, 0.08),
        _row(4, BASELINE, {}, 0.120, noise=0),
    ]
    decision = decide(trials, 0.01)
    settled = {"measured_more": {"rounds": 2, "clear": True}}
    (notice,) = _qualify(decision, trials, AutoSettings(), settled)
    assert "; clear after 2 more paired round(s) beside the baseline" in decision["reason"]
    assert notice.level == "info" and "the paired rounds settled the decision regardless" in (
        notice.message
    )
    assert "run again" not in notice.message and decision["measured_more"]["clear"]

    decision = decide(trials, 0.01)
    spent = {"measured_more": {"rounds": 1, "clear": False, "why": "p(x=1) has one run",
                               "spent": "time budget"}}  # fmt: skip
    (notice,) = _qualify(decision, trials, AutoSettings(budget_s=60.0, trials=None), spent)
    assert (
        "; still unclear after 1 more paired round(s) (p(x=1) has one run): the 60 s budget spent"
        in decision["reason"]
    )
    assert notice.level == "warning" and "too noisy to trust this winner" in notice.message


def test_budget_skips_are_one_line_not_one_each():
    from tunekit.cli.auto import _ProgressView
    from tunekit.cli.common import console
    from tunekit.events import TrialFinished

    view = _ProgressView()
    with console.capture() as out:
        for seq in range(4, 19):
            view.handle(
                TrialFinished(
                    seq, seq, CANDIDATE, "p", f"p(x={seq})", "skipped", None, None, 0.1, BUDGET_SKIP
                )
            )
        view.finish()
    lines = [ln for ln in out.get().splitlines() if ln.strip()]
    assert lines == ["skipped 15 planned trial(s) that did not fit the time budget (#4–#18)"]


def test_tables_wrap_numbers_instead_of_cutting_them():
    """Issue 19: piped output ended numbers in "…" ("154.…", "meas…")."""
    from rich.console import Console

    from tunekit.cli.common import PIPE_WIDTH, Table, _width

    table = Table(title="t")
    for col in ("config", "measured", "predicted"):
        table.add_column(col)
    table.add_row(
        "overlap_chunking(bucket_cap_mb=4.0, mode=ddp_buckets)", "154.321 ms ± 2.5 ms", "150.0 ms"
    )
    narrow = Console(width=40, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    narrow.print(table)
    text = narrow.export_text()
    assert "…" not in text
    assert "154.321" in text.replace("\n", "").replace("│", "").replace(" ", "")
    assert _width(open("/dev/null", "w")) in (PIPE_WIDTH, None)  # noqa: SIM115 (None: COLUMNS is set)


def test_the_terminal_prints_headlines_and_with_explain_the_bodies_notes_and_timings():
    """Issue 35: one line per diagnosis; -v adds its points and where the time went; a verdict
    its trials contradict gets the line that says why."""
    from tunekit.cli.auto import _ProgressView
    from tunekit.cli.common import console
    from tunekit.events import Decided, Diagnosed, StudyFinished

    summary = "exposed communication 12% of the step (4.8 ms, measured); model: chunks of 5 gain 0%"
    events = [
        Diagnosed("cgdp", True, summary, 0.0, "too close to call · 0% (−12…+11%) · x 12%"),
        Diagnosed("dataloader", False, "no DataLoader; make_batch feeds it", None, ""),
        Decided(
            {
                "winner": "cgdp(chunk_size=5)",
                "winner_trial": 3,
                "winner_config": {"plugins": {"cgdp": {"chunk_size": 5}}},
                "min_effect": 0.01,
                "baseline_median_s": 0.1,
                "winner_median_s": 0.09,
                "global_batch": 64,
                "speedup": 1.11,
                "reason": "11% more samples/s",
                "candidates": [
                    {
                        "trial_id": 3,
                        "plugin": "cgdp",
                        "role": "search",
                        "description": "cgdp(chunk_size=5)",
                        "runs": 2,
                        "config": {"plugins": {"cgdp": {"chunk_size": 5}}},
                        "comparison": {"speedup": 1.11, "significant": True},
                    }
                ],
            }
        ),
        StudyFinished(1, "cgdp(chunk_size=5)", 1.11, [{"stage": "trial 0 baseline", "wall_s": 6.0, "cpu_s": 9.5, "detail": "baseline"}]),
    ]  # fmt: skip
    for explain in (False, True):
        view = _ProgressView(explain)
        with console.capture() as out:
            for ev in events:
                view.handle(ev)
            view.finish()
        text = out.get()
        assert "  cgdp: too close to call · 0% (−12…+11%) · x 12%" in text
        # A third-party tuner that writes no headline gets one, derived.
        assert "  dataloader: does not apply · no DataLoader" in text
        assert (
            "  cgdp: won: its model expected no gain to speak of, but its in-job search found "
            "cgdp(chunk_size=5), which measured 1.11x"
        ) in text
        assert ("· model: chunks of 5 gain 0%" in text) is explain
        assert ("where the time went" in text) is explain
        if explain:
            assert "trial 0 baseline" in text and "9.5 s" in text


def test_a_decision_the_budget_left_no_room_to_measure_more_says_so():
    trials = [
        _row(0, BASELINE, {}, 0.100, noise=0.2),
        _row(1, CANDIDATE, {"p": {"x": 1}}, 0.09, noise=0.2),
        _row(2, BASELINE, {}, 0.100, noise=0.2),
    ]
    decision = decide(trials, 0.01)
    none = {"measured_more": {"rounds": 0, "clear": False, "why": "x", "spent": "time budget"}}
    _qualify(decision, trials, AutoSettings(budget_s=55.0, trials=None), none)
    assert decision["reason"].endswith(
        "; unclear (x), and the 55 s budget left no room to measure more"
    )
    # Two winners within each other's noise: the win is clear, not which of the two.
    decision = decide(trials, 0.01)
    rival = {"measured_more": {**none["measured_more"], "why": "a and b", "rival_only": True}}
    _qualify(decision, trials, AutoSettings(budget_s=55.0, trials=None), rival)
    assert decision["reason"].endswith(
        "; the win is clear, but not which of two is faster (a and b): either gains about as "
        "much (the 55 s budget left no room)"
    )


def test_a_candidate_keeps_room_for_confirming_the_leader_and_a_baseline_beside_nothing_is_skipped():
    from tunekit.orchestrator import nothing_to_interleave

    run = _Run(AutoSettings(budget_s=100.0))
    leader = _row(1, CANDIDATE, {"p": {"x": 1}}, 0.15, noise=0)  # 4x the batch: 2.7x per sample
    leader.result.update(wall_s=14.0, startup_s=10.0, length={"warmup": 3, "steps": 12})
    leader.result["ranks"] = [{"global_batch": 256}]
    rows = [
        _timed(0, BASELINE, {}, 25.0),
        leader,
        _timed(2, CANDIDATE, {"p": {"x": 2}}, 0, status="pending", predicted_s=0.1),
        _timed(3, BASELINE, {}, 0, status="pending"),
    ]
    # The next candidate (10 s start-up, 19 steps of 0.1 s, the 1.75 s the leader took after its
    # steps) keeps room for confirming the leader (its 14 s run), not itself.
    assert run.walls_for(rows[2], rows) == pytest.approx([13.65, 13.65, 14.0, 13.65])
    assert not nothing_to_interleave(rows[3], rows)
    rows[1] = _timed(1, CANDIDATE, {"p": {"x": 1}}, 0, status="skipped")
    rows[2] = _timed(2, CANDIDATE, {"p": {"x": 2}}, 0, status="skipped")
    assert nothing_to_interleave(rows[3], rows)  # both candidates skipped for time
    rows[1] = _timed(1, CANDIDATE, {"p": {"x": 1}}, 0, status="crash")
    rows[2] = _timed(2, CANDIDATE, {"p": {"x": 2}}, 0, status="oom")
    assert nothing_to_interleave(rows[3], rows)  # both failed: nothing measured to pair with
    rows[2] = _timed(2, CANDIDATE, {"p": {"x": 2}}, 0)
    assert not nothing_to_interleave(rows[3], rows)  # one measured: the baseline pairs with it
