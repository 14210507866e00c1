"""Trials screen: a tuning started from the tuners screen, its progress, trials, plot and best so far."""

from __future__ import annotations

import pytest
from textual.widgets import ProgressBar

from tunekit.tui.screens.trials import TrialsScreen, TrialTable
from tunekit.tui.widgets import TrialsPlot

pytestmark = pytest.mark.asyncio


def rows(table) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def cells(table) -> list[dict[str, str]]:
    """Each row's cells by column key (the columns drawn depend on the width)."""
    return [dict(zip(table.shown_columns, row, strict=True)) for row in rows(table)]


async def test_a_tuning_started_from_the_tuners_screen_fills_the_trials_screen(
    app_factory, wait_for_app, text_of
):
    app = app_factory()
    async with app.run_test(size=(200, 60)) as pilot:  # wide: every column
        await pilot.press("3")
        await wait_for_app(pilot, lambda: app.tuner_views)
        await pilot.press("t")
        await wait_for_app(pilot, lambda: app.study_view.state == "finished")
        await pilot.press("4")
        await wait_for_app(pilot, lambda: isinstance(app.screen, TrialsScreen))
        await pilot.pause(0.05)
        screen = app.screen
        table = cells(screen.query_one(TrialTable))
        assert [(r["#"], r["role"]) for r in table] == [
            ("0", "baseline"),
            ("1", "candidate"),
            ("2", "candidate"),
            ("3", "baseline"),
        ]
        # raw prediction, corrected by earlier trials, measured, samples/s, both errors,
        # peak memory per rank (predicted -> measured; none here), status
        keys = ("predicted", "corrected", "measured", "samples", "error", "peak", "status")
        assert [table[1][k] for k in keys] == [
            "201.0 ms",
            "207.0 ms",
            "209.0 ms ± 10.0 ms",
            "306.2",
            "4% → 1%",
            "—",
            "ok",
        ]
        assert table[2]["status"] == "crash"
        assert table[2]["note"] == "RuntimeError: out of memory on rank 1"  # whole, at 200
        assert any(n.title == "trial failed" and "out of memory" in n.message for n in app.notes)
        assert any("cgdp" in n.message for n in app.notes)  # its diagnosis failed: a notification
        # Every trial on the plot (issue 35: only candidates with a prediction were): measured
        # for all, predicted where there is one, the crashed one on the axis.
        plot = screen.query_one(TrialsPlot)
        assert [(p.seq, bool(p.measured), bool(p.predicted), p.failed) for p in plot.points] == [
            (0, True, False, False),
            (1, True, True, False),
            (2, False, False, True),
            (3, True, False, False),
        ]
        assert plot.points[1].predicted == pytest.approx(64 / 0.201)  # at its measured batch
        drawn = str(plot.render()).splitlines()
        assert drawn[-1].split() == ["0", "1", "2", "3"]  # each labelled by its number
        assert "●" in str(plot.render()) and "○" in str(plot.render()) and "✕" in str(plot.render())
        best = text_of(screen.query_one("#best"))
        # One measure, the decision's: samples/s (issue 19: a per-step ratio sat beside it)
        assert "baseline 275.9 samples/s" in best
        assert "overlap_chunking(bucket_cap_mb=4.0): 306.2 samples/s (1.11x the baseline's)" in best
        assert "decision: overlap_chunking(bucket_cap_mb=4.0)" in best
        assert "tuning finished · study 7" in text_of(screen.query_one("#study-line"))
        assert app.study_view.trial(2).config is not None  # finished trials carry their config


async def test_a_running_tuning_shows_progress_and_can_be_cancelled(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    backend = backend_factory()
    enabled = ["batch_ps_sizing", "cgdp", "overlap_chunking"]  # every plugin that loads
    events = [type(ev).__name__ for ev, _ in fixed.tuning_events(enabled)]
    backend.pause_after = events.index("TrialProgress") + 1  # the first trial is a quarter through
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("3")
        await wait_for_app(pilot, lambda: app.tuner_views)
        await pilot.press("t")
        await pilot.press("4")
        await wait_for_app(pilot, lambda: app.study_view.step == 4)
        await pilot.pause(0.05)
        screen = app.screen
        assert screen.has_class("-tuning")
        line = text_of(screen.query_one("#study-line"))
        assert "tuning running · study 7 · trial 1 of 4: baseline baseline · measure 4/16" in line
        assert screen.query_one("#trial-progress", ProgressBar).percentage == pytest.approx(0.25)
        await pilot.press("t")
        assert any("already running" in n.message for n in app.notes)
        await pilot.press("x")
        await wait_for_app(pilot, lambda: app.study_view.state == "cancelled")
        await pilot.pause(0.05)
        assert not screen.has_class("-tuning")
        assert any("tuning cancelled" in n.message for n in app.notes)
        # Issue 35: the cancelled trial said "running" and the bar stood at 100% (trial 1 of
        # 1 planned so far, counted as done once nothing was in flight).
        assert app.study_view.trial(1).status == "cancelled"
        assert cells(screen.query_one(TrialTable))[0]["status"] == "cancelled"
        assert screen.query_one("#study-progress", ProgressBar).percentage == 0
        assert screen.query_one("#trial-progress", ProgressBar).percentage == 0


async def test_a_tuning_that_fails_to_start_is_a_notification(
    app_factory, backend_factory, wait_for_app
):
    from tunekit.errors import WorkloadError

    backend = backend_factory()

    async def broken(request):
        raise WorkloadError("example:cnn: the model cannot run on a batch of 32")
        yield  # an async generator, as the real one

    backend.tune = broken
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.tuner_views)
        await pilot.press("t")
        await wait_for_app(pilot, lambda: app.study_view.state == "failed")
        assert "cannot run on a batch of 32" in app.study_view.message
        assert any("cannot run on a batch of 32" in n.message for n in app.notes)
        assert app.is_running


async def test_the_time_left_once_trials_have_run(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    """Issue 35: no estimate of how long a tuning would take."""
    backend = backend_factory()
    enabled = ["batch_ps_sizing", "cgdp", "overlap_chunking"]
    events = fixed.tuning_events(enabled)
    names = [type(ev).__name__ for ev, _ in events]
    second = [i for i, n in enumerate(names) if n == "TrialStarted"][1]
    backend.pause_after = second + 2  # trial 2 of 4 in flight, one progress event in
    app = app_factory(backend)
    clock = iter(range(0, 10_000, 30))  # each event arrives 30 s after the one before
    app.clock = lambda: float(next(clock))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.tuner_views)
        await pilot.press("t")
        await wait_for_app(pilot, lambda: app.study_view.index == 2 and app.study_view.step == 4)
        app.clock = lambda: app.study_view.trial(2).started_at + 10.0  # 10 s into trial 2
        await pilot.press("4")
        await pilot.pause(0.1)
        baseline = app.study_view.trial(1)
        per_trial = baseline.finished_at - baseline.started_at
        # two trials to come after this one, and what is left of this one
        left = 2 * per_trial + (per_trial - 10)
        assert app.study_view.time_left_s(app.clock()) == pytest.approx(left)
        from tunekit.tui.formatting import duration

        assert f"about {duration(left)} left" in text_of(app.screen.query_one("#study-line"))
        await pilot.press("3")
        await pilot.pause(0.1)
        assert f"about {duration(left)} left" in text_of(app.screen.query_one("#tune-line"))
        backend.resume.set()
