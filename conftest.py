"""Suite-wide settings for tests under tests/ and plugins/.

How the suite is scheduled (``-n 4 --dist loadgroup``, pyproject.toml): every test
goes to whichever of the four workers is free, multi-process tests included. Four on
two cores, because most of a test's time is spent waiting on the processes it started
(a quiet run used the two cores about half of the time with two workers; figures in
docs/architecture.md, "What the suite checks"). None
asserts on how fast or how quiet the machine is (timing-driven decisions are
tested on recorded or injected measurements), so a test may run beside any other.
Two things still keep tests together, as an xdist group that one worker runs:

* a shared fixture: a fixture of module or session scope (a ``tunekit auto``
  study several tests read, one live job) is computed once *per worker*, so
  every test that uses it joins the group named after it, and it is paid once.
  Give a test at most one such fixture (two would make a group of their own);
* a GPU: tests marked ``gpu`` share the one device, one at a time.

The shared fixtures are documented in tests/conftest.py; docs/architecture.md
("What the suite checks") says how the suite is organised and what it costs.
"""

import os
from pathlib import Path

import pytest

# run_ranks keeps its spawned gloo ranks between tests (tunekit.rank_pool): each
# fresh rank would spend about 3.5 s importing torch and torch._dynamo.
os.environ.setdefault("TUNEKIT_REUSE_RANKS", "1")
# Under xdist, the workers share the machine's cores: one intra-op thread per process (every
# process a test starts inherits it; the trial launcher honours OMP_NUM_THREADS as "someone
# sharing the machine" sets it) keeps torch's OpenMP threads from spinning on a core another
# worker needs. With torch's default threads a plugin's test files at -n 2 took 3.3x the
# wall time and 3x the CPU time (252 s / 71 s against 76 s / 23 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# Diagnoses and observations measure with a tenth of their usual repeats and time budgets
# (tunekit.effort; never fewer repeats than a measurement needs): the suite checks what the
# figures say and how they are used, not how tight they are. Every child process (trials,
# the workload's, a live job) inherits it.
os.environ.setdefault("TUNEKIT_MEASURE_EFFORT", "0.1")

_WIDE_SCOPES = ("module", "package", "session")


def shared_fixture_of(item: pytest.Item) -> str | None:
    """The first fixture of module scope or wider the test uses that the suite itself
    defines (in a conftest or a test module; not a plugin's, such as pytest's
    ``tmp_path_factory``), as ``where.name`` (``test_live.live``), or None."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name)
        if not defs:
            continue
        fixture = defs[-1]
        if fixture.scope in _WIDE_SCOPES and fixture.baseid:  # "": a plugin's fixture
            return f"{Path(fixture.baseid.split('::')[0]).stem}.{name}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.xdist_group("gpu"))
        elif shared := shared_fixture_of(item):
            item.add_marker(pytest.mark.xdist_group(shared))
