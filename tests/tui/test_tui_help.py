"""Help screen, the command palette and the footer: every main action has a key and a name."""

from __future__ import annotations

import pytest

from tunekit.tui.screens.help import HELP, HelpScreen

pytestmark = pytest.mark.asyncio

MAIN_ACTIONS = (
    "Start tuning",
    "Cancel tuning",
    "Diagnose tuners",
    "Profile the job",
    "Apply…",
    "Roll back…",
    "Detach",
)


async def test_help_lists_the_keys(app_factory, wait_for_app):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("question_mark")
        await wait_for_app(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert app.screen.query_one("#help-text").region.height > 10  # drawn
        for key in ("`t`", "`x`", "`p`", "`space`", "`d`", "`a`", "`r`", "`b`", "`q`", "`ctrl+p`"):
            assert f"| {key} |" in HELP


async def test_main_actions_are_in_the_palette_and_the_footer(app_factory, wait_for_app):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.tuner_views)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for action in MAIN_ACTIONS:
            assert action in titles
        footer_keys = {b.binding.key for b in app.screen.active_bindings.values() if b.binding.show}
        assert {"1", "2", "3", "4", "5", "q"} <= footer_keys
        await pilot.press("3")
        await pilot.pause(0.05)
        assert {"space", "d", "t", "x"} <= {
            b.binding.key for b in app.screen.active_bindings.values() if b.binding.show
        }

        # The palette runs an action by name.
        await pilot.press("ctrl+p")
        await pilot.pause(0.1)
        await pilot.press(*"Diagnose tuners")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for_app(pilot, lambda: any(t.state == "diagnosed" for t in app.tuner_views))


async def test_quit_and_detach_say_what_to_do_with_the_job(app_factory):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("q")
    assert app.return_value == "quit"
    app = app_factory()
    async with app.run_test(size=(120, 36)):
        app.action_detach()
    assert app.return_value == "detach"


@pytest.mark.parametrize("width", [80, 100])
async def test_help_and_quit_stay_in_the_footer_of_every_screen(app_factory, wait_for_app, width):
    """Issue 19: at 100 columns the footer cut "? Help" and "q Quit"."""
    from textual.widgets._footer import FooterKey

    app = app_factory()

    def visible() -> dict[str, bool]:
        """Footer entries drawn, and whether each lies left of the palette key."""
        keys = list(app.screen.query(FooterKey))
        palette = min((k.region.x for k in keys if k.action == "command_palette"), default=width)
        return {k.description: k.region.right <= palette for k in keys if k.region.width}

    async with app.run_test(size=(width, 24)) as pilot:
        for key in ("1", "2", "3", "4", "5", "question_mark"):
            await pilot.press(key)
            await wait_for_app(pilot, lambda: "Help" in visible() and "Quit" in visible())
            shown = visible()
            assert shown["Help"] and shown["Quit"], (key, shown)
