"""Every screen as an SVG snapshot, over fixed data (update with ``pytest --snapshot-update``).

At 120×36, and the screens whose layout changes with the terminal at 80×24 (one column,
fewer table columns) and at 200×60 (taller charts, whole configs)."""

from __future__ import annotations

import pytest

from tunekit.tui.screens.confirm import ConfirmScreen
from tunekit.tui.screens.live import DevicePanel
from tunekit.tui.screens.tuners import TunerTable

SIZE = (120, 36)


@pytest.fixture
def shot(snap_compare, wait_for_app):
    """``shot(app, steps)``: run ``steps(pilot)``, settle, drop the toasts, compare."""

    def compare(app, steps=None, size=SIZE) -> bool:
        async def run_before(pilot) -> None:
            await wait_for_app(pilot, lambda: app.live_view.step == 60 and app.tuner_views)
            if steps is not None:
                await steps(pilot)
            await pilot.pause(0.2)
            # Everything settled but a tuning the test holds mid-way on purpose.
            busy = [w for w in app.workers if w.group not in ("tune", "poll")]
            if busy:  # (an empty list would mean "all of them")
                await app.workers.wait_for_complete(busy)
            app.clear_notifications()  # toasts time out: they would make the picture depend on the clock
            await pilot.pause(0.1)

        return snap_compare(app, terminal_size=size, run_before=run_before)

    return compare


def test_live(shot, app_factory, wait_for_app):
    app = app_factory()

    async def steps(pilot):
        await wait_for_app(pilot, lambda: len(app.screen.query(DevicePanel)) == 2)

    assert shot(app, steps)


def test_live_without_a_gpu(shot, app_factory, backend_factory):
    assert shot(app_factory(backend_factory(gpu=False)))


def test_profile(shot, app_factory, wait_for_app):
    app = app_factory()

    async def steps(pilot):
        await pilot.press("2", "p")
        await wait_for_app(pilot, lambda: app.profile_view is not None and not app.profile_stage)

    assert shot(app, steps)


@pytest.mark.parametrize("size", [SIZE, (80, 24)])
def test_tuners_after_diagnosis(shot, app_factory, wait_for_app, diagnosis_over, size):
    app = app_factory()

    async def steps(pilot):
        await pilot.press("3", "d")
        await wait_for_app(pilot, lambda: diagnosis_over(app))
        app.screen.query_one(TunerTable).focus()
        await pilot.press("down", "down", "down")

    assert shot(app, steps, size)


def test_trials_running(shot, app_factory, backend_factory, wait_for_app, fixed):
    backend = backend_factory()
    events = [
        type(ev).__name__
        for ev, _ in fixed.tuning_events(["batch_ps_sizing", "cgdp", "overlap_chunking"])
    ]
    backend.pause_after = (
        len(events) - events[::-1].index("TrialProgress") - 1
    )  # the last trial, a quarter in
    app = app_factory(backend)

    async def steps(pilot):
        await pilot.press("t", "4")
        await wait_for_app(pilot, lambda: app.study_view.index == 4 and app.study_view.step == 4)

    try:
        assert shot(app, steps)
    finally:
        backend.resume.set()


def test_trials_finished(shot, app_factory, wait_for_app):
    app = app_factory()

    async def steps(pilot):
        await pilot.press("t", "4")
        await wait_for_app(pilot, lambda: app.study_view.state == "finished")

    assert shot(app, steps)


def test_apply_confirmation(shot, app_factory, wait_for_app):
    app = app_factory()

    async def steps(pilot):
        await pilot.press("t")
        await wait_for_app(pilot, lambda: app.study_view.state == "finished")
        # Before the modal: toasts under it stay drawn, and whether they had expired
        # would depend on the clock.
        app.clear_notifications()
        await pilot.press("5", "a")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))

    assert shot(app, steps)


def test_apply_kept(shot, app_factory, wait_for_app, fixed):
    app = app_factory()

    async def steps(pilot):
        await pilot.press("t")
        await wait_for_app(pilot, lambda: app.study_view.state == "finished")
        # Before the modal: toasts under it stay drawn, and whether they had expired
        # would depend on the clock.
        app.clear_notifications()
        await pilot.press("5", "a")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(
            pilot, lambda: app.apply_view.state == "kept" and app.live_view.config == fixed.BUCKETS
        )

    assert shot(app, steps)


def test_help(shot, app_factory):
    async def steps(pilot):
        await pilot.press("question_mark")

    assert shot(app_factory(), steps)


async def finished_tuning(app, pilot, wait_for_app) -> None:
    await pilot.press("t")
    await wait_for_app(pilot, lambda: app.study_view.state == "finished")


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_trials_finished_at(shot, app_factory, wait_for_app, size):
    app = app_factory()

    async def steps(pilot):
        await finished_tuning(app, pilot, wait_for_app)
        await pilot.press("4")

    assert shot(app, steps, size)


def test_live_at_80x24(shot, app_factory, backend_factory):
    assert shot(app_factory(backend_factory(gpu=False)), size=(80, 24))


def test_live_after_an_apply_and_a_rollback_at_200x60(shot, app_factory, wait_for_app, fixed):
    """The marks (▲ apply, ↺ rollback) and a colour per config on the step-time chart."""
    app = app_factory()

    async def steps(pilot):
        await finished_tuning(app, pilot, wait_for_app)
        app.clear_notifications()
        await pilot.press("5", "a")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(pilot, lambda: app.apply_view.state == "kept")
        await pilot.press("r")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(pilot, lambda: len(app.live_view.changes) == 2)
        await pilot.press("1")
        await wait_for_app(pilot, lambda: len(app.screen.query(DevicePanel)) == 2)

    assert shot(app, steps, (200, 60))
