"""Apply screen: current vs best side by side, apply with confirmation, the watch verdict, roll back."""

from __future__ import annotations

import pytest

from tunekit.tui.screens.apply import ApplyScreen
from tunekit.tui.screens.confirm import ConfirmScreen
from tunekit.tui.screens.trials import TrialTable

pytestmark = pytest.mark.asyncio


async def tuned(app, pilot, wait_for_app):
    await wait_for_app(pilot, lambda: app.tuner_views)
    await pilot.press("t")
    await wait_for_app(pilot, lambda: app.study_view.state == "finished")


async def apply_screen(app, pilot, wait_for_app) -> ApplyScreen:
    """After a finished tuning: the apply screen, drawn."""
    await tuned(app, pilot, wait_for_app)
    await pilot.press("5")
    await wait_for_app(pilot, lambda: isinstance(app.screen, ApplyScreen))
    await pilot.pause(0.05)
    return app.screen


async def test_apply_the_best_config_with_confirmation_then_roll_back(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    backend = backend_factory()
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await apply_screen(app, pilot, wait_for_app)
        assert (
            "winner of study 7 overlap_chunking(bucket_cap_mb=4.0) (1.11x the baseline's samples/s)"
            in text_of(screen.query_one("#apply-line"))
        )
        assert "baseline" in text_of(screen.query_one("#current"))
        assert "bucket_cap_mb = 4.0" in text_of(screen.query_one("#target"))

        await pilot.press("a")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("n")  # changed my mind
        await wait_for_app(pilot, lambda: isinstance(app.screen, ApplyScreen))
        assert backend.applied == [] and app.apply_view.state == "idle"

        await pilot.press("a")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(
            pilot, lambda: app.apply_view.state == "kept" and app.live_view.config == fixed.BUCKETS
        )
        await pilot.pause(0.1)
        assert backend.applied == [fixed.BUCKETS]
        assert screen.has_class("-kept")
        result = text_of(screen.query_one("#apply-result"))
        assert (
            "kept" in result
            and "before 277 samples/s → after 302 samples/s" in result
            and "1.09x the samples/s of before" in result
        )
        assert "overlap_chunking" in text_of(screen.query_one("#current"))

        await pilot.press("r")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(
            pilot,
            lambda: app.apply_view.state == "rolled_back" and app.live_view.config == fixed.BASE,
        )
        await pilot.pause(0.05)
        assert screen.has_class("-rolled-back")
        # Issue 35: a rollback asked for and done was an error-coloured notification.
        (said,) = [n for n in app.notes if n.message == "rolled back at step 61"]
        assert (said.title, said.severity) == ("rolled back", "information")
        # Issue 19: it read as if the watch had rolled back a speed-up.
        watch = text_of(screen.query_one("#apply-result")).split("watch window: ")[1]
        assert watch.startswith(
            "rolled back on request, not by the watch; the watch had measured it at "
            "1.09x the samples/s of before"
        )


async def test_a_trial_picked_on_the_trials_screen_is_the_one_applied(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    backend = backend_factory()
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await tuned(app, pilot, wait_for_app)
        await pilot.press("4")
        await pilot.pause(0.05)
        app.screen.query_one(TrialTable).focus()
        await pilot.press(
            "down", "down", "enter"
        )  # trial 2, the one that crashed: its config is known
        await wait_for_app(pilot, lambda: isinstance(app.screen, ApplyScreen))
        await pilot.pause(0.05)
        line = text_of(app.screen.query_one("#apply-line"))
        assert "trial 2: batch_ps_sizing(batch_size=64)" in line
        await pilot.press("b")  # back to the best
        await pilot.pause(0.05)
        assert "winner" in text_of(app.screen.query_one("#apply-line"))

        await pilot.press("4")
        await pilot.pause(0.05)
        app.screen.query_one(TrialTable).focus()
        await pilot.press("up", "a")  # trial 1, applied straight from the table
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(pilot, lambda: app.apply_view.state == "kept")
        assert backend.applied == [fixed.BUCKETS]


async def test_nothing_to_apply_and_nothing_to_roll_back_are_said_without_asking(
    app_factory, backend_factory, wait_for_app
):
    """Issue 35: a rollback with nothing applied asked y/n, then showed a red "failed"."""
    backend = backend_factory()
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("5")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ApplyScreen))
        await pilot.pause(0.05)
        assert app.screen.has_class("-no-target")
        await pilot.press("a")
        assert any("nothing to apply yet" in n.message for n in app.notes)
        await pilot.press("r")
        await pilot.pause(0.1)
        assert isinstance(app.screen, ApplyScreen)  # no question asked
        (said,) = [n for n in app.notes if "nothing to roll back" in n.message]
        assert said.severity == "warning"
        assert app.apply_view.state == "idle" and not app.screen.has_class("-failed")
        assert app.is_running


async def test_a_rollback_the_job_refuses_is_an_error(app_factory, backend_factory, wait_for_app):
    """What the job says against a rollback it was asked for reaches the user, as an error."""
    from tunekit.errors import ControlError

    backend = backend_factory()
    backend.history.append(dict(backend.config))  # the job reports one apply to undo

    def refused():
        raise ControlError("run demo is paused: tunekit auto is measuring example:cnn")

    backend.rollback = refused
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.live_view.applied == 1)
        await pilot.press("5", "r")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(pilot, lambda: app.apply_view.state == "failed")
        (said,) = [n for n in app.notes if "is paused" in n.message]
        assert (said.title, said.severity) == ("rollback failed", "error")


async def test_the_confirmation_carries_the_decisions_caveat(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    """Issue 35: the confirm dialog dropped the decision's "too noisy" caveat."""
    backend = backend_factory()
    backend.decision_reason = (
        "11.0% more samples/s than the baseline over 2 run(s) (95% CI 1.060-1.150x); "
        "the baseline drifted between its runs (231 → 262 ms/step): "
        "too noisy to trust this winner without a rerun"
    )
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await apply_screen(app, pilot, wait_for_app)
        caveat = (
            "the baseline drifted between its runs (231 → 262 ms/step): "
            "too noisy to trust this winner without a rerun"
        )
        assert f"the decision: {caveat}" in text_of(app.screen.query_one("#apply-line"))
        await pilot.press("a")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert caveat in text_of(app.screen.query_one("#detail"))


async def test_a_new_tuning_keeps_the_last_winner_on_offer(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    """Issue 35: starting a new tuning made the last study's winner unreachable ("nothing to
    apply yet") until the new one had measured a candidate."""
    backend = backend_factory()
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await tuned(app, pilot, wait_for_app)
        enabled = ["batch_ps_sizing", "cgdp", "overlap_chunking"]  # every plugin that loads
        events = [type(ev).__name__ for ev, _ in fixed.tuning_events(enabled)]
        backend.pause_after = events.index("TrialProgress") + 1  # the new study's baseline runs
        await pilot.press("t")
        await wait_for_app(pilot, lambda: app.study_view.running and app.study_view.step == 4)
        await pilot.press("5")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ApplyScreen))
        await pilot.pause(0.05)
        assert "winner of study 7" in text_of(app.screen.query_one("#apply-line"))
        await pilot.press("a")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for_app(pilot, lambda: app.apply_view.state == "kept")
        assert backend.applied == [fixed.BUCKETS]
        backend.resume.set()
