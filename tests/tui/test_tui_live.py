"""Live screen: the job's status, step history, per-device and per-rank telemetry, its config."""

from __future__ import annotations

import pytest
from textual.command import CommandPalette

from tunekit.tui.screens.live import DevicePanel, LiveScreen
from tunekit.tui.widgets import ConfigPanel, MetricRow

pytestmark = pytest.mark.asyncio


async def test_live_shows_the_job_its_gpus_and_ranks(app_factory, wait_for_app, text_of):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(
            pilot,
            lambda: (
                app.live_view.step == 60
                and len([t for t in app.screen.query(".device-title") if text_of(t)]) == 2
            ),
        )
        screen = app.screen
        assert isinstance(screen, LiveScreen)
        line = text_of(screen.query_one("#job-line"))
        assert "running" in line and "step 60" in line and "2 rank(s)" in line
        assert not screen.has_class("-no-gpu")
        gpus = list(screen.query(DevicePanel))
        assert [text_of(g.query_one(".device-title")) for g in gpus] == [
            "GPU 0 NVIDIA A100-SXM4-40GB"
        ] * 1 + ["GPU 1 NVIDIA A100-SXM4-40GB"]
        util = gpus[0].query_one(".metric-util", MetricRow)
        assert len(util.series.values) == 30 and util.value_text.endswith("%")
        nvlink = gpus[0].query_one(".metric-nvlink-tx", MetricRow)
        assert nvlink.value_text == "40.0 GiB/s"  # cumulative counters turned into a rate
        ranks = [r for r in screen.query("#ranks MetricRow")]
        assert [r.metric_name for r in ranks] == ["rank 0 CPU", "rank 1 CPU"]
        assert "410.0 MiB" in ranks[0].value_text
        step_time = screen.query_one("#step-time", MetricRow)
        assert len(step_time.series.values) == 60
        assert "baseline" in text_of(screen.query_one("#current-config", ConfigPanel))
        assert "no config applied yet" in text_of(screen.query_one("#watch-line"))
        assert not [n for n in app.notes if "GPU" in n.message]  # a GPU: nothing to say


async def test_without_a_gpu_host_metrics_and_one_notice(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    app = app_factory(backend_factory(gpu=False))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(  # drawn, not only polled: the screen draws after the poll
            pilot,
            lambda: (
                app.live_view.ranks
                and app.tuner_views
                and len(app.screen.query("#ranks MetricRow")) == 2
                and text_of(app.screen.query_one("#no-gpu"))
            ),
        )
        screen = app.screen
        assert screen.has_class("-no-gpu")
        assert not screen.query(DevicePanel)
        assert text_of(screen.query_one("#no-gpu")) == fixed.NO_GPU
        assert len(screen.query("#ranks MetricRow")) == 2
        gpu_notes = [n for n in app.notes if "host metrics only" in n.message]
        assert len(gpu_notes) == 1
        await pilot.press("t")  # a tuning's trials find no GPU either: still said once
        await wait_for_app(pilot, lambda: app.study_view.state == "finished")
        assert len([n for n in app.notes if "host metrics only" in n.message]) == 1
        assert "host metrics only" not in app.study_view.message


async def test_a_finished_job_is_marked(app_factory, backend_factory, wait_for_app, text_of):
    backend = backend_factory()
    poll = backend.poll

    def finished():
        snap = poll()
        snap.status.update(status="crashed", error="RuntimeError: rank 1 exited")
        return snap

    backend.poll = finished
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.live_view.status == "crashed")
        await pilot.pause(0.1)
        assert app.screen.has_class("-stopped")
        assert "rank 1 exited" in text_of(app.screen.query_one("#job-line"))


async def test_an_unreadable_job_is_said_once_and_polling_goes_on(
    app_factory, backend_factory, wait_for_app
):
    backend = backend_factory()
    good = backend.poll
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 6:
            raise OSError("status.json: permission denied")
        return good()

    backend.poll = flaky
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.live_view.step == 60)
        said = [n for n in app.notes if "permission denied" in n.message]
        assert len(said) == 1 and len(calls) >= 6


async def test_a_started_job_says_it_outlives_a_closed_terminal(
    app_factory, backend_factory, wait_for_app, text_of
):
    """Issue 19: closing the terminal left the job running with no word to the user."""
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.live_view.step == 60)
        assert any(
            "If this terminal closes, the job keeps running" in n.message
            and "tunekit tui --attach demo" in n.message
            for n in app.notes
        )
        assert "a closed terminal leaves it running" in text_of(app.screen.query_one("#job-line"))


async def test_palette_screenshot_saves_a_file(
    app_factory, backend_factory, wait_for_app, tmp_path
):
    """Issue 19: Palette → Screenshot said "Failed to save screenshot" (no Downloads folder).
    Issue 35: the palette's Screenshot was still Textual's own (saving to ~/Downloads): the
    test had called the app's action directly. Now through the palette, as a user does."""
    backend = backend_factory()
    backend.screenshot_dir = lambda: tmp_path / "shots"
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.live_view.step == 60)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert titles.count("Screenshot") == 1  # ours, not Textual's beside it
        await pilot.press("ctrl+p")
        await wait_for_app(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"Screenshot")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for_app(pilot, lambda: any(n.title == "Screenshot" for n in app.notes))
        assert [n.message for n in app.notes if n.title == "Screenshot"][0].startswith(
            "Saved screenshot"
        )
        (svg,) = (tmp_path / "shots").glob("*.svg")
        assert "tunekit" in svg.read_text() and "Screenshot" not in svg.read_text()
