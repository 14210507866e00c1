"""Suite-wide settings for tests under tests/ and plugins/."""

import os

import pytest

# run_ranks keeps its spawned gloo ranks between tests (tunekit.rank_pool): each
# fresh rank would spend about 3.5 s importing torch and torch._dynamo.
os.environ.setdefault("TUNEKIT_REUSE_RANKS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Under xdist (`-n 2 --dist loadgroup`, the default), the multi-process tests
    # run one after another on one worker: each already uses both cores, and two
    # at once would only contend and skew the timings some of them judge. Those
    # marked busy_ok (their checks hold on a busy machine) form a second group, run
    # beside the first on the other worker with the single-process tests. GPU tests
    # join the first group: two of them at once would share the one device.
    # Equivalence tests compare maths, not timings: they are busy_ok by nature.
    for item in items:
        marked = item.get_closest_marker
        if marked("gpu"):
            item.add_marker(pytest.mark.xdist_group("processes"))
        elif (
            marked("slow") and (marked("busy_ok") or marked("equivalence")) and not marked("timed")
        ):
            item.add_marker(pytest.mark.xdist_group("processes-busy-ok"))
        elif marked("slow"):
            item.add_marker(pytest.mark.xdist_group("processes"))
