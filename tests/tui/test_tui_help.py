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


async def test_a_first_visit_composes_the_footer_once_and_it_follows_the_focus(
    app_factory, wait_for_app, monkeypatch
):
    """Issue 35: Textual's footer recomposed six times on a screen's first visit (a new
    widget per key, each restyled: half of the switch's CPU time). Now once; it still
    recomposes when the keys it shows change (here: the focus moves off the tuners table,
    whose key "space" then leaves the footer)."""
    from textual.widgets._footer import FooterKey

    made = []
    init = FooterKey.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(FooterKey, "__init__", counting)

    def footer_keys() -> set[str]:
        return {k.key for k in app.screen.query(FooterKey)}

    def footer_actions() -> set[str]:
        return {k.action for k in app.screen.query(FooterKey)} - {"command_palette"}

    def shown_actions() -> set[str]:
        return {b.binding.action for b in app.screen.active_bindings.values() if b.binding.show}

    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for_app(pilot, lambda: app.tuner_views and footer_keys())
        for key in ("2", "3", "4", "5"):
            made.clear()
            await pilot.press(key)
            await wait_for_app(pilot, lambda: footer_keys() and footer_keys() >= {"q"})
            await pilot.pause()  # the screen's messages handled and the app idle: any
            await pilot.pause(0.2)  # redundant recompose (scheduled after a refresh) done
            assert len(made) == len(footer_keys()), key  # one compose, one widget per key
            assert footer_actions() == shown_actions(), key

        await pilot.press("3")
        await wait_for_app(pilot, lambda: "space" in footer_keys())
        app.screen.set_focus(None)  # off the table: its "space" binding no longer applies
        # Recomposed (an empty footer mid-recompose has no "space" either: wait for "q").
        await wait_for_app(pilot, lambda: "space" not in footer_keys() and footer_keys() >= {"q"})
        assert footer_actions() == shown_actions()
