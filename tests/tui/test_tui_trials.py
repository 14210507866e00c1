"""Trials screen: a tuning started from the tuners screen, its progress, trials, plot and best so far."""

from __future__ import annotations

import pytest
from textual.widgets import ProgressBar

from tunekit.tui.screens.trials import TrialsScreen, TrialTable
from tunekit.tui.widgets import PredictedVsMeasured

pytestmark = pytest.mark.asyncio


def rows(table) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


async def test_a_tuning_started_from_the_tuners_screen_fills_the_trials_screen(
    app_factory, wait_for_app, text_of
):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("3")
        await wait_for_app(pilot, lambda: app.tuner_views)
        await pilot.press("t")
        await wait_for_app(pilot, lambda: app.study_view.state == "finished")
        await pilot.press("4")
        await wait_for_app(pilot, lambda: isinstance(app.screen, TrialsScreen))
        await pilot.pause(0.05)
        screen = app.screen
        table = rows(screen.query_one(TrialTable))
        assert [r[:2] for r in table] == [
            ["0", "baseline"],
            ["1", "candidate"],
            ["2", "candidate"],
            ["3", "baseline"],
        ]
        # raw prediction, corrected by earlier trials, measured, samples/s, both errors,
        # peak memory per rank (predicted -> measured; none here), status
        assert table[1][3:10] == [
            "201.0 ms",
            "207.0 ms",
            "209.0 ms ± 10.0 ms",
            "306.2",
            "4% → 1%",
            "—",
            "ok",
        ]
        assert table[2][9] == "crash" and "out of memory" in table[2][10]
        assert any(n.title == "trial failed" and "out of memory" in n.message for n in app.notes)
        assert any("cgdp" in n.message for n in app.notes)  # its diagnosis failed: a notification
        plot = screen.query_one(PredictedVsMeasured)
        assert plot.points == ((0.201, 0.209, "1", "candidate"),)
        assert "1" in str(plot.render())
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
