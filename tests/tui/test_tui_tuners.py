"""Tuners screen: every installed plugin, enable/disable, diagnoses, gains and planned candidates."""

from __future__ import annotations

import pytest

from tunekit.tui.screens.tuners import CandidateTable, TunersScreen, TunerTable

pytestmark = pytest.mark.asyncio


def rows(table) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


async def open_tuners(app, pilot, wait_for_app):
    await pilot.press("3")
    await wait_for_app(pilot, lambda: isinstance(app.screen, TunersScreen) and app.tuner_views)
    await pilot.pause(0.05)
    return app.screen


async def test_every_plugin_is_listed_and_a_broken_one_cannot_be_enabled(
    app_factory, wait_for_app, text_of
):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await open_tuners(app, pilot, wait_for_app)
        table = screen.query_one(TunerTable)
        assert [r[1] for r in rows(table)] == [
            "batch_ps_sizing",
            "cgdp",
            "fancy",
            "overlap_chunking",
        ]
        fancy = rows(table)[2]
        assert fancy[0] == "[ ]" and fancy[3] == "failed" and "fancy_deps" in fancy[6]
        assert any("fancy" in n.message and "did not load" in (n.title or "") for n in app.notes)

        table.focus()
        await pilot.press("down", "down", "space")  # fancy
        assert any("cannot be enabled" in n.message for n in app.notes)
        assert "ModuleNotFoundError" in text_of(screen.query_one("#tuner-detail"))
        await pilot.press("up", "space")  # cgdp off
        await pilot.pause(0.05)
        assert [t.name for t in app.tuner_views if t.enabled] == [
            "batch_ps_sizing",
            "overlap_chunking",
        ]
        assert rows(table)[1][0] == "[ ]"
        assert "2 enabled tuner(s)" in text_of(screen.query_one("#tune-line"))


async def test_diagnose_shows_verdicts_gains_candidates_and_a_failing_tuner(
    app_factory, wait_for_app, text_of
):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await open_tuners(app, pilot, wait_for_app)
        await pilot.press("d")
        await wait_for_app(
            pilot,
            lambda: all(t.state in ("diagnosed", "failed") for t in app.tuner_views if t.enabled),
        )
        await pilot.pause(0.05)
        table = screen.query_one(TunerTable)
        by_name = {r[1]: r for r in rows(table)}
        # predicted throughput against the live job's measured baseline (64 / 0.231 s)
        assert by_name["overlap_chunking"][3:6] == ["yes", "13%", "318.4 samples/s (1.15x)"]
        # a batch candidate: its own 128 samples per step, the same measure
        assert by_name["batch_ps_sizing"][3:6] == ["yes", "22%", "312.2 samples/s (1.13x)"]
        against = text_of(screen.query_one("#tuner-baseline"))
        assert (
            "277.1 samples/s (231.0 ms/step × 64), the live job's last 57 untuned steps" in against
        )
        assert by_name["cgdp"][3] == "failed"
        assert any("cgdp needs at least 4 ranks" in n.message for n in app.notes)

        table.focus()
        await pilot.press("down", "down", "down")  # overlap_chunking
        await pilot.pause(0.05)
        candidates = rows(screen.query_one(CandidateTable))
        assert [c[1:4] for c in candidates] == [
            [
                "overlap_chunking(bucket_cap_mb=4.0, mode=ddp_buckets)",
                "318.4 samples/s (1.15x)",
                "201.0 ms × 64",
            ],
            ["overlap_chunking(k=5, mode=two_chunk)", "299.1 samples/s (1.08x)", "214.0 ms × 64"],
        ]
        assert "should recover ~13%" in text_of(screen.query_one("#tuner-detail"))


async def test_a_diagnosis_that_raises_is_a_notification(
    app_factory, backend_factory, wait_for_app
):
    backend = backend_factory()

    def broken(names, limit):
        raise RuntimeError("cannot trace the model")
        yield  # a generator, as the real one

    backend.diagnose = broken
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await open_tuners(app, pilot, wait_for_app)
        await pilot.press("d")
        await wait_for_app(
            pilot, lambda: any("cannot trace the model" in n.message for n in app.notes)
        )
        await wait_for_app(pilot, lambda: not any(t.state == "diagnosing" for t in app.tuner_views))
        assert app.is_running
