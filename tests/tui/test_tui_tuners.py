"""Tuners screen: every installed plugin, enable/disable, diagnoses, gains and planned candidates."""

from __future__ import annotations

import pytest

from tunekit.tui.screens.tuners import CandidateTable, TunersScreen, TunerTable

pytestmark = pytest.mark.asyncio


def rows(table) -> list[list[str]]:
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def cells(table) -> list[dict[str, str]]:
    """Each row's cells by column key (the columns drawn depend on the width)."""
    return [dict(zip(table.shown_columns, row, strict=True)) for row in rows(table)]


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
        fancy = cells(table)[2]
        assert fancy["use"] == "[ ]" and fancy["applies"] == "failed"
        assert "fancy_deps" in fancy["headline"]
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
        by_name = {r["tuner"]: r for r in cells(table)}
        # predicted throughput against the live job's measured baseline (64 / 0.231 s)
        oc = by_name["overlap_chunking"]
        assert (oc["applies"], oc["predicted"]) == ("yes", "318.4 samples/s (1.15x)")
        # a headline, one line (derived: the fixed tuners give none)
        assert oc["headline"].startswith("applies · +13% · exposed communication ~24%")
        # a batch candidate: its own 128 samples per step, the same measure
        bs = by_name["batch_ps_sizing"]
        assert (bs["applies"], bs["predicted"]) == ("yes", "312.2 samples/s (1.13x)")
        against = text_of(screen.query_one("#tuner-baseline"))
        assert (
            "277.1 samples/s (231.0 ms/step × 64), the live job's last 57 untuned steps" in against
        )
        assert by_name["cgdp"]["applies"] == "failed"
        assert any("cgdp needs at least 4 ranks" in n.message for n in app.notes)

        table.focus()
        await pilot.pause(0.05)
        # batch_ps_sizing's candidate predicts its peak memory per rank: a column for it
        batch = cells(screen.query_one(CandidateTable))
        assert [(c["config"], c["peak"]) for c in batch] == [
            ("batch_ps_sizing(batch_size=64)", "96.0 MiB")
        ]
        await pilot.press("down", "down", "down")  # overlap_chunking
        await pilot.pause(0.05)
        candidates = cells(screen.query_one(CandidateTable))
        assert "peak" not in screen.query_one(CandidateTable).shown_columns  # none predicted
        assert [(c["config"], c["predicted"], c["step"]) for c in candidates] == [
            (
                "overlap_chunking(bucket_cap_mb=4.0, mode=ddp_buckets)",
                "318.4 samples/s (1.15x)",
                "201.0 ms × 64",
            ),
            ("overlap_chunking(k=5, mode=two_chunk)", "299.1 samples/s (1.08x)", "214.0 ms × 64"),
        ]
        # The headline, then the body as points.
        detail = text_of(screen.query_one("#tuner-detail")).splitlines()
        assert detail[1].startswith("applies · +13%")
        assert detail[2:] == [
            " • exposed communication ~24% of the step",
            " • 4 MiB buckets should recover ~13%",
        ]


async def test_a_diagnosis_that_raises_is_a_notification(
    app_factory, backend_factory, wait_for_app
):
    backend = backend_factory()

    def broken(names, limit, on_progress):
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


async def test_a_diagnosis_says_which_tuner_runs_and_what_it_does(
    app_factory, backend_factory, wait_for_app, text_of
):
    """Issue 35: for two minutes "…" was the only sign of progress."""
    backend = backend_factory()
    backend.hold_diagnosis = "cgdp"
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await open_tuners(app, pilot, wait_for_app)
        await pilot.press("d")
        await wait_for_app(pilot, lambda: any(t.state == "diagnosing" for t in app.tuner_views))
        await pilot.pause(0.1)
        line = text_of(screen.query_one("#tune-line"))
        assert line.startswith("diagnosing: cgdp: diagnosing · 1 more to go"), line
        by_name = {r["tuner"]: r for r in cells(screen.query_one(TunerTable))}
        assert by_name["batch_ps_sizing"]["applies"] == "yes"  # done before it
        assert by_name["cgdp"]["applies"] == "diagnosing…"
        assert by_name["overlap_chunking"]["applies"] == "waiting"
        await pilot.press("d")
        assert any("in progress" in n.message for n in app.notes)  # one at a time
        backend.resume.set()
        await wait_for_app(
            pilot, lambda: not any(t.state in ("waiting", "diagnosing") for t in app.tuner_views)
        )
        await pilot.pause(0.05)
        assert text_of(screen.query_one("#tune-line")).startswith("tuning: t starts")
