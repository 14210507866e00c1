"""Profile screen: breakdown bar, overlap R, the sortable layer table, py-spy hot spots per rank."""

from __future__ import annotations

import pytest

from tunekit.tui.screens.profile import LayerTable, ProfileScreen
from tunekit.tui.widgets import BreakdownBar

pytestmark = pytest.mark.asyncio


def first_column(table: LayerTable) -> list[str]:
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


async def test_profile_runs_on_request_and_shows_breakdown_layers_and_hot_spots(
    app_factory, wait_for_app, text_of
):
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("2")
        await wait_for_app(pilot, lambda: isinstance(app.screen, ProfileScreen))
        screen = app.screen
        assert screen.has_class("-empty")
        assert "No profile yet" in text_of(screen.query_one("#profile-source"))

        await pilot.press("p")
        await wait_for_app(pilot, lambda: app.profile_view is not None and not app.profile_stage)
        await pilot.pause(0.05)
        assert not screen.has_class("-empty") and not screen.has_class("-busy")
        bar = screen.query_one(BreakdownBar)
        assert [p for p, _, _ in bar.parts] == [
            "compute",
            "comm_exposed",
            "data",
            "optimizer",
            "idle",
        ]
        legend = str(bar.render())
        assert "compute 66% (151.8 ms)" in legend and "exposed comm 24% (55.2 ms)" in legend
        numbers = text_of(screen.query_one("#profile-numbers"))
        assert "overlap R 40" in numbers and "measured 231.2 ms" in numbers
        table = screen.query_one(LayerTable)
        assert first_column(table)[:3] == [
            "features.3",
            "features.6",
            "features.0",
        ]  # largest total first
        spots = text_of(screen.query_one("#hotspots"))
        assert "rank 0" in spots and "rank 1" in spots and "_conv_forward (conv.py:10)" in spots
        assert "optimizer step: 33% of stack samples" in spots


async def test_the_layer_table_sorts_by_key_and_by_header_click(app_factory, wait_for_app):
    """Issue 35: `s` cycled the columns and never reversed a sort. Now it sorts by the column
    under the cursor (which starts on the sorted one), and again reverses it."""
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("2", "p")
        await wait_for_app(pilot, lambda: app.profile_view is not None)
        await pilot.pause(0.05)
        table = app.screen.query_one(LayerTable)
        table.focus()
        assert table.sorted_by == "total ▼" and first_column(table)[0] == "features.3"
        await pilot.press("s")  # the same column again: reversed
        await pilot.pause(0.05)
        assert table.sorted_by == "total ▲" and first_column(table)[0] == "classifier.2"
        await pilot.press("s")
        await pilot.pause(0.05)
        assert table.sorted_by == "total ▼" and first_column(table)[0] == "features.3"
        await pilot.press("right", "right", "s")  # total -> share -> activations, largest first
        await pilot.pause(0.05)
        assert table.sorted_by == "activations ▼"
        assert first_column(table)[:2] == ["features.0", "features.1"]  # 3.1 MiB each
        await pilot.click(LayerTable, offset=(2, 0))  # the "layer" header: by name
        await pilot.pause(0.05)
        assert first_column(table)[0] == "classifier.0"
        await pilot.click(LayerTable, offset=(2, 0))  # again: reversed
        await pilot.pause(0.05)
        assert first_column(table)[0] == "features.6"


async def test_a_failing_profile_is_a_notification(app_factory, backend_factory, wait_for_app):
    backend = backend_factory()

    def broken(on_stage):
        on_stage("profiled run on 2 rank(s)")
        raise RuntimeError("the profiled run of example:cnn failed (crash): rank 1 segfaulted")

    backend.profile = broken
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("2", "p")
        await wait_for_app(pilot, lambda: any("segfaulted" in n.message for n in app.notes))
        await wait_for_app(pilot, lambda: not app.profile_stage)
        assert app.is_running and app.profile_view is None
        assert app.screen.has_class("-empty")


async def test_the_sorted_column_carries_an_arrow(app_factory, wait_for_app):
    """Issue 19: `s` cycled the sort column with nothing saying which was active."""
    app = app_factory()
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("2", "p")
        await wait_for_app(pilot, lambda: app.profile_view is not None and not app.profile_stage)
        await pilot.pause(0.1)
        table = app.screen.query_one(LayerTable)

        def headers() -> list[str]:
            return [c.label.plain for c in table.columns.values()]

        assert "total ▼" in headers() and "forward" in headers()
        table.focus()
        await pilot.press("right", "s")  # the next column: share, largest first
        await pilot.pause(0.05)
        assert "share ▼" in headers() and "total" in headers()
        await pilot.click(LayerTable, offset=(2, 0))  # the layer header: by name, A first
        await pilot.pause(0.1)
        assert headers()[0] == "layer ▲"
        assert str(table.get_row_at(0)[0]) == "classifier.0"


async def test_the_live_hot_spots_follow_new_samples_once_the_series_is_full(
    app_factory, backend_factory, wait_for_app, text_of, fixed
):
    """Issue 35: the py-spy panel froze after 120 samples: it redrew only when the count
    changed, and the sampler's series stops growing at 120."""
    backend = backend_factory()
    app = app_factory(backend)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("2")
        await wait_for_app(pilot, lambda: app.live_hotspots)
        await pilot.pause(0.05)
        assert "33% step (sgd.py:10)" in text_of(app.screen.query_one("#hotspots"))
        # The same number of samples, the oldest dropped, newer ones in: rank 0 now only steps.
        newer = []
        for s in fixed.pyspy_series():
            threads = s["data"]["ranks"]["0"]["threads"]
            frames = [{"name": "step", "file": "/site/torch/optim/sgd.py", "line": 10}]
            newer.append(
                {
                    "t": s["t"] + 1000,
                    "data": {
                        "ranks": {
                            **s["data"]["ranks"],
                            "0": {"pid": 4242, "threads": [{**threads[0], "frames": frames}]},
                        }
                    },
                }
            )
        assert len(newer) == len(backend.pyspy)
        backend.pyspy = newer
        await wait_for_app(
            pilot, lambda: "100% step (sgd.py:10)" in text_of(app.screen.query_one("#hotspots"))
        )
