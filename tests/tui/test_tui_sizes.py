"""Every screen at 80×24 (docs/tui.md's promise), 60×20 (graceful) and on large terminals.

Issue 35, tried in tmux: at 80×24 the live metrics were cut (264 samples/s drawn as
"26", system CPU without a value, the memory unit gone), at 60×20 the values and the
run id vanished; the trials table hid status and note at 120 columns and the measured
step at 80, and cut the config at 40 characters at 200; the tuners' predicted column
was cut at 120; at 200×60 the live screen used 13 of 58 rows.
"""

from __future__ import annotations

import pytest
from rich.text import Text

from tunekit.tui.screens.live import LiveScreen
from tunekit.tui.screens.trials import TrialTable
from tunekit.tui.screens.tuners import CandidateTable, TunerTable
from tunekit.tui.widgets import Chart, MetricRow
from tunekit.tui.widgets.table import FitTable

pytestmark = pytest.mark.asyncio

LONG_RUN = "20260419-101010-ab12"
"""A run id as `tunekit run` names them (the fixed backend's "demo" would hide a cut)."""


async def tuned_and_diagnosed(app, pilot, wait_for_app, diagnosed) -> None:
    """Every screen's state filled: a diagnosis, a finished tuning, a profiled run."""
    await wait_for_app(pilot, lambda: app.live_view.step == 60 and app.tuner_views)
    await pilot.press("3", "d")
    await wait_for_app(pilot, lambda: diagnosed(app))
    await pilot.press("t")
    await wait_for_app(pilot, lambda: app.study_view.state == "finished")
    await pilot.press("2", "p")
    await wait_for_app(pilot, lambda: app.profile_view is not None and not app.profile_stage)


def values_whole(screen) -> list[str]:
    """Each metric whose value is drawn narrower than its text (none, when nothing is cut)."""
    return [
        f"{row.metric_name}: {row.value_text!r} in {row.query_one('.metric-value').region.width}"
        for row in screen.query(MetricRow)
        if not row.has_class("-empty")
        and row.query_one(".metric-value").region.width < Text(row.value_text).cell_len
    ]


def tables_whole(screen) -> list[str]:
    """Each table cell of a number column drawn narrower than its text."""
    cut = []
    for table in screen.query(FitTable):
        grow = {c.key for c in table.COLUMNS if c.grow}
        for key, cells in table._rows:
            for col, cell in cells.items():
                if col in grow or col not in table.shown_columns:
                    continue
                width = table.columns[col].width  # type: ignore[index]
                if width < Text(str(cell)).cell_len:
                    cut.append(f"{type(table).__name__} {key}.{col}: {cell!s} in {width}")
    return cut


@pytest.mark.parametrize("size", [(80, 24), (60, 20)])
async def test_nothing_is_cut_on_a_small_terminal(
    app_factory, wait_for_app, screen_lines, diagnosis_over, size
):
    app = app_factory()
    async with app.run_test(size=size) as pilot:
        await tuned_and_diagnosed(app, pilot, wait_for_app, diagnosis_over)
        for key in ("1", "2", "3", "4", "5"):
            await pilot.press(key)
            await pilot.pause(0.1)
            screen = app.screen
            assert not values_whole(screen), (key, values_whole(screen))
            assert not tables_whole(screen), (key, tables_whole(screen))
            lines = screen_lines(app)
            assert len(lines) == size[1] and all(len(line) <= size[0] for line in lines)
            assert "run demo" in lines[0]  # the run id in the header, whatever the screen
        await pilot.press("1")
        await pilot.pause(0.1)
        live = app.screen
        assert isinstance(live, LiveScreen) and live.has_class("-narrow")
        # One column: the step time, throughput and loss each whole on one line.
        text = "\n".join(screen_lines(app))
        for value in ("244.6 ms", "261.7", "2.0050"):
            assert value in text
        # Below, scrolled to: GPU memory with its unit, system CPU with its value.
        assert live.query_one(".metric-mem", MetricRow).value_text == "11.9 GiB / 40.0 GiB"
        assert live.query_one("#system-cpu", MetricRow).value_text == "96%"


async def test_the_run_id_stays_in_sight_at_60_columns(app_factory, backend_factory, screen_lines):
    backend = backend_factory()
    backend.run_id = LONG_RUN
    app = app_factory(backend)
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause(0.2)
        for key in ("1", "3", "4", "question_mark"):
            await pilot.press(key)
            await pilot.pause(0.05)
            assert f"run {LONG_RUN}" in screen_lines(app)[0], screen_lines(app)[0]


async def columns_at(app, width: int, wait_for_app) -> tuple[list[str], list[str]]:
    """The trials table's columns after a tuning, at ``width`` columns, and its configs."""
    async with app.run_test(size=(width, 40)) as pilot:
        await wait_for_app(pilot, lambda: app.tuner_views)
        await pilot.press("t", "4")
        await wait_for_app(pilot, lambda: app.study_view.state == "finished")
        await pilot.pause(0.1)
        table = app.screen.query_one(TrialTable)
        at = table.shown_columns.index("config")
        return table.shown_columns, [str(table.get_row_at(i)[at]) for i in range(table.row_count)]


async def test_the_trials_table_keeps_what_matters_at_each_width(app_factory, wait_for_app):
    shown = {}
    for width in (80, 120, 200):
        shown[width], configs = await columns_at(app_factory(), width, wait_for_app)
    # whole configs at 200, not cut at 40 characters beside empty room
    assert "overlap_chunking(bucket_cap_mb=4.0)" in configs
    assert {"#", "config", "measured", "samples", "status"} <= set(shown[80])
    assert {"predicted", "measured", "status", "note"} <= set(shown[120])
    assert set(shown[200]) == {c.key for c in TrialTable.COLUMNS}


async def test_the_tuners_predictions_are_whole_at_120_columns(
    app_factory, wait_for_app, diagnosis_over
):
    app = app_factory()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for_app(pilot, lambda: app.tuner_views)
        await pilot.press("3", "d")
        await wait_for_app(pilot, lambda: diagnosis_over(app))
        await pilot.pause(0.1)
        table = app.screen.query_one(TunerTable)
        assert "predicted" in table.shown_columns
        width = table.columns["predicted"].width  # type: ignore[index]
        assert width >= len("318.4 samples/s (1.15x)")
        assert {"predicted", "step"} <= set(app.screen.query_one(CandidateTable).shown_columns)


async def test_a_large_terminal_is_used(app_factory, wait_for_app):
    app = app_factory()
    async with app.run_test(size=(200, 60)) as pilot:
        await wait_for_app(pilot, lambda: app.live_view.step == 60 and app.tuner_views)
        await pilot.pause(0.2)
        screen = app.screen
        assert screen.has_class("-wide") and screen.has_class("-taller")
        step_chart = screen.query_one("#step-time").query_one(Chart)
        assert step_chart.region.height >= 10 and step_chart.region.width >= 60
        used = max(w.region.bottom for w in screen.query("#training > *, #hardware > *"))
        assert used >= 45  # of 58 rows between the header and the footer
