"""``tunekit new-plugin``: a new tuner plugin package, ready to install and run.

The generated package registers its tuner under the ``tunekit.plugins``
entry-point group (exactly as the built-in tuners do), ships one working knob
— prefetching the next batches in a background thread, a real and harmless
data-pipeline strategy — with its cost model, runtime hook and tests written
against :mod:`tunekit.testing`, so that it installs with ``pip install -e``,
shows up in ``tunekit plugins`` and runs in ``tunekit auto`` without edits.
The author then replaces the example knob with their strategy.

Templates are plain :class:`string.Template` text (``$name`` placeholders, ``$$``
for a literal dollar); no template engine.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from tunekit import API_VERSION, __version__
from tunekit.errors import PluginError, TunekitError

NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class PluginNames:
    """Every name the package uses, derived from the tuner's name."""

    name: str
    """Tuner name, entry-point name and config key (``my_tuner``)."""

    @property
    def package(self) -> str:
        """Import package (``tunekit_my_tuner``)."""
        return f"tunekit_{self.name}"

    @property
    def dist(self) -> str:
        """Distribution name on an index (``tunekit-my-tuner``)."""
        return "tunekit-" + self.name.replace("_", "-")

    @property
    def class_name(self) -> str:
        """Tuner class (``MyTuner``)."""
        return "".join(part.capitalize() for part in self.name.split("_") if part) or "Tuner"

    @property
    def title(self) -> str:
        return self.name.replace("_", " ").capitalize() + " (prefetch example)"

    def substitutions(self) -> dict[str, str]:
        return {
            "name": self.name,
            "package": self.package,
            "dist": self.dist,
            "class_name": self.class_name,
            "title": self.title,
            "api_major": str(API_VERSION[0]),
            "tunekit_version": __version__,
        }


def builtin_names() -> dict[str, str]:
    """Installed tuner names -> the package that registers each (``tunekit 0.1.0`` for built-ins)."""
    from tunekit.plugin_loading import _package, discover

    return {ep.name: _package(ep) for ep in discover()}


def check_name(name: str) -> PluginNames:
    """The names for ``name``; raise :class:`PluginError` if it cannot be a tuner name."""
    if not NAME_RE.match(name) or keyword.iskeyword(name):
        raise PluginError(
            f"plugin name {name!r} must be a lower-case Python identifier (letters, digits, "
            "underscores; e.g. my_tuner): it is the config key and part of the package name"
        )
    taken = builtin_names()
    if name in taken:
        owner = taken[name]
        what = (
            "a built-in tuner"
            if owner.split()[0] == "tunekit"
            else f"already registered by {owner}"
        )
        raise PluginError(f"plugin name {name!r} is {what}; choose another name")
    return PluginNames(name)


def default_dir(name: str) -> Path:
    return Path.cwd() / PluginNames(name).dist


def scaffold(name: str, directory: Path | None = None) -> list[Path]:
    """Write the package for tuner ``name`` into ``directory``; return the files written.

    ``directory`` (default ``./tunekit-<name>``) is created; if it exists it
    must be an empty folder, so nothing is ever overwritten.
    """
    names = check_name(name)
    root = Path(directory) if directory is not None else default_dir(name)
    if root.exists() and not root.is_dir():
        raise TunekitError(f"{root} exists and is not a folder; choose another --dir")
    if root.is_dir() and any(root.iterdir()):
        raise TunekitError(f"{root} exists and is not empty; choose another --dir")
    subs = names.substitutions()
    written = []
    for rel, text in _files(names).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(text).substitute(subs))
        written.append(path)
    return written


def _files(names: PluginNames) -> dict[str, str]:
    pkg = names.package
    return {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"{pkg}/__init__.py": INIT,
        f"{pkg}/plugin.py": PLUGIN,
        f"{pkg}/model.py": MODEL,
        f"{pkg}/runtime.py": RUNTIME,
        f"tests/test_{names.name}.py": TESTS,
    }


# == templates ============================================================================

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "A tunekit tuner plugin: $name"
readme = "README.md"
requires-python = ">=3.10"
# Written against tunekit $tunekit_version (tuner API $api_major; see api_version in plugin.py).
dependencies = ["tunekit>=$tunekit_version"]

[project.optional-dependencies]
test = ["pytest>=8"]

# tunekit finds tuners in this entry-point group; the name is the tuner's config key.
[project.entry-points."tunekit.plugins"]
$name = "$package.plugin:$class_name"

[tool.setuptools]
packages = ["$package"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

README = """\
# $dist

A tunekit tuner plugin, generated by `tunekit new-plugin $name`.

It ships one working knob as an example: **`prefetch_batches`** — a background
thread prepares the next batches while the current step trains, so the step
does not wait for its data. Batches are a pure function of the step in
tunekit, so prefetching changes when the work happens, never what the model
sees. Replace it with your own strategy (see below).

## Install, list, run

    pip install -e .                 # registers the entry point
    tunekit plugins                  # $name shows up, status ok
    tunekit plugins --knobs          # ... with its knob
    tunekit auto example:cnn --plugins $name
    pytest                           # the plugin's tests (tunekit.testing)

## Layout

| file | phase | what it does |
|---|---|---|
| `$package/plugin.py` | declare, diagnose, plan, apply | the `$class_name` tuner: its knobs, its verdict on an observed job, ranked candidates with predicted step times, and the runtime hook |
| `$package/model.py` | diagnose, plan | the cost model: where the step's time goes, and what a setting would save |
| `$package/runtime.py` | apply | what the knob does inside every training worker |
| `tests/test_$name.py` | | conformance (`tunekit.testing.check_conformance`), the model's numbers, the hook's equivalence |

## Making it yours

1. Declare your knobs in `knobs()`: each with a type, a range (int and
   float knobs need both `low` and `high`) and a default that reproduces the
   untuned job. Pick the `aspect` your knobs control; tunekit never combines
   two tuners of one aspect.
2. `diagnose(obs)` reads the observation (baseline step time, step
   breakdown, telemetry, model graph, hardware) and says whether your
   technique applies and what it expects to save.
3. `plan(obs, limit)` returns candidates, best first, each with a predicted
   step time from your cost model. Real trials verify them.
4. `apply(session, knobs)` changes the training session in every worker.
   It runs after the session was reset to the workload's defaults; anything
   you change that the session does not own, undo with `session.on_reset(...)`.
5. Keep `tests/test_$name.py` passing: `check_conformance` applies your
   hook on a real session, resets it, and checks that nothing leaked.

## Publishing

Build and upload like any Python package (`python -m build`, `twine upload`).
Users `pip install $dist` and the tuner appears in `tunekit plugins`; the
entry point in `pyproject.toml` is all the registration there is.

## Versioning

`api_version` in `plugin.py` is the tuner API's major version this plugin was
written for ($api_major). A tunekit that speaks another major version lists the
plugin as `incompatible` in `tunekit plugins` and does not load it.
"""

INIT = '''\
"""$name: a tunekit tuner plugin (tunekit finds it through its entry point)."""
'''

PLUGIN = '''\
"""$name: prefetch the next batches in a background thread.

Generated by `tunekit new-plugin $name` with one working knob as an example:
a data-pipeline strategy that installs, lists and runs as it is. Replace the
knob, the cost model (model.py) and the runtime hook (runtime.py) with yours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.observe.observation import Observation
from tunekit.runtime.session import Session

from $package.model import DataTimes, data_times, predicted_step_s
from $package.runtime import apply_prefetch

MIN_GAIN = 0.002
"""Smallest predicted saving (a fraction of the step) worth a trial."""


class $class_name(Tuner):
    name = "$name"
    title = "$title"
    aspect = Aspect.DATA
    api_version = $api_major
    """The tuner API's major version this plugin was written for."""

    def __init__(self) -> None:
        # diagnose and plan share the times of one observation
        self._last: tuple[Observation, DataTimes] | None = None

    def times(self, obs: Observation) -> DataTimes:
        """Where the observed step's time goes (computed once per observation)."""
        if self._last is None or self._last[0] is not obs:
            self._last = (obs, data_times(obs))
        return self._last[1]

    # -- phase 1: declare --------------------------------------------------------------

    def knobs(self) -> list[Knob]:
        return [
            Knob(
                "prefetch_batches",
                "int",
                0,
                "batches a background thread prepares ahead of the step (0: none)",
                low=0,
                high=8,
            ),
        ]

    # -- phase 2: diagnose -------------------------------------------------------------

    def diagnose(self, obs: Observation) -> Diagnosis:
        times = self.times(obs)
        best = predicted_step_s(times, depth=1)
        gain = max(0.0, 1 - best / times.step_s)
        evidence = (
            f"getting the batch takes {times.data_s * 1e3:.1f} ms of a {times.step_s * 1e3:.1f} ms "
            f"step ({times.data_s / times.step_s:.0%}, {times.source})"
        )
        if gain < MIN_GAIN:
            why = (
                "every core is busy with the step already, so a prefetch thread would only move the work"
                if times.spare_cores < 1
                else "too little to gain"
            )
            return Diagnosis(
                False, f"{evidence}; {why}", expected_gain=gain, details=times.to_dict()
            )
        return Diagnosis(
            True,
            f"{evidence}; prefetching in a background thread should save ~{gain:.0%}",
            expected_gain=gain,
            details=times.to_dict(),
        )

    # -- phase 3: plan -----------------------------------------------------------------

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        times = self.times(obs)
        out = []
        for depth, why in (
            (1, "the next batch is ready when the step ends"),
            (2, "two batches ahead also absorb an occasional slow batch"),
        ):
            step = predicted_step_s(times, depth)
            if step < times.step_s * (1 - MIN_GAIN):
                out.append(
                    Candidate(
                        {"prefetch_batches": depth}, step, f"prefetch {depth}: {why}"
                    )
                )
        return out[:limit]

    # -- phase 4: runtime (inside every worker) ------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        apply_prefetch(session, int(knobs["prefetch_batches"]))
'''

MODEL = '''\
"""The cost model: how much of the step prefetching can hide.

A step is ``data + rest``: the main thread first gets the batch, then runs
forward, backward and the update. A prefetch thread prepares the next batch
during ``rest``. With a core to itself the step becomes ``max(rest, data)``.
Without one (CPU ranks: each rank's compute threads already use its cores) the
thread's work still takes core time; it is spread over the rank's cores,
where the main thread used only one: ``rest + data / cores``.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tunekit.observe.observation import Observation
from tunekit.runtime.session import Session


@dataclass
class DataTimes:
    step_s: float
    """The untuned job's step time."""
    data_s: float
    """Of which the main thread spends getting the batch."""
    cores_per_rank: float
    """Host cores each rank can use."""
    busy_cores: float
    """Cores a rank keeps busy during forward/backward (all of its share on CPU ranks, one on a GPU)."""
    source: str
    """Where ``data_s`` comes from."""

    @property
    def spare_cores(self) -> float:
        return self.cores_per_rank - self.busy_cores

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "spare_cores": self.spare_cores}


def data_times(obs: Observation) -> DataTimes:
    """The step and its data part: measured in the baseline when it was profiled, else timed here."""
    cores = obs.hardware.host.cores / max(obs.nproc, 1)
    busy = max(1.0, float(int(cores))) if obs.device_type == "cpu" else 1.0
    summary = obs.breakdown.summary() if obs.breakdown is not None else {}
    if obs.baseline is not None and "data" in summary.get("fractions", {}):
        # Profiled steps run slower than measured ones: take the data's share, not its seconds.
        step_s = obs.baseline.median_s
        data_s = summary["fractions"]["data"] * step_s
        return DataTimes(step_s, data_s, cores, busy, "step breakdown")
    step_s, data_s = time_steps(obs)
    if obs.baseline is not None:
        step_s = obs.baseline.median_s
    return DataTimes(step_s, min(data_s, step_s), cores, busy, "timed in this process")


def time_steps(obs: Observation, steps: int = 3) -> tuple[float, float]:
    """Median step and data time of a few real steps of the workload on one rank, here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(obs.hardware.host.cores // max(obs.nproc, 1))))
    session = Session(obs.workload)
    try:
        session.train_step()  # warm-up
        records = [session.train_step() for _ in range(steps)]
    finally:
        session.close()
        torch.set_num_threads(threads)
    return (
        statistics.median(r.step_s for r in records),
        statistics.median(r.data_s for r in records),
    )


def predicted_step_s(times: DataTimes, depth: int) -> float:
    """Predicted step time with ``depth`` batches prefetched (0: the job as it is)."""
    if depth <= 0 or times.data_s <= 0:
        return times.step_s
    rest = times.step_s - times.data_s
    if times.spare_cores >= 1:
        return max(rest, times.data_s)
    return max(rest + times.data_s / max(times.cores_per_rank, 1.0), times.data_s)
'''

RUNTIME = '''\
"""The runtime hook: a background thread prepares the next batches.

Runs inside every training worker. tunekit's batches are a pure function of
the step (``session.data.batch(step)``), so a batch made ahead of time is the
batch the step would have made: prefetching changes when the work happens,
never what the model sees.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tunekit.runtime.session import Session


class PrefetchingSource:
    """Wraps a session's batch source; one thread computes the next ``depth`` batches in order."""

    def __init__(self, inner: Any, depth: int):
        self.inner = inner
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._ahead: dict[int, Future] = {}

    def batch(self, step: int):
        future = self._ahead.pop(step, None)
        if future is None:
            self._drop()  # a jump (first step, resume, batch change): start from this step
            result = self.inner.batch(step)
        else:
            result = future.result()
        for ahead in range(step + 1, step + 1 + self.depth):
            if ahead not in self._ahead:
                self._ahead[ahead] = self._pool.submit(self.inner.batch, ahead)
        return result

    def _drop(self) -> None:
        """Forget prepared batches; wait for the one in progress (the source is not thread-safe)."""
        for future in self._ahead.values():
            future.cancel()
        for future in self._ahead.values():
            if not future.cancelled():
                future.exception()
        self._ahead.clear()

    def set_batch_size(self, batch_size: int) -> None:
        self._drop()
        self.inner.set_batch_size(batch_size)

    def set_options(self, options: Any) -> None:
        self._drop()
        self.inner.set_options(options)

    def shutdown(self) -> None:
        self._drop()
        self._pool.shutdown(wait=True)

    def close(self) -> None:
        self.shutdown()
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Everything else (global_batch, seed, options, batch_size ...) is the inner source's.
        return getattr(self.inner, name)


def apply_prefetch(session: Session, depth: int) -> None:
    """Prefetch ``depth`` batches ahead in ``session``; the session's reset puts the source back."""
    if depth <= 0:
        return
    inner = session.data
    source = PrefetchingSource(inner, depth)
    session.data = source

    def restore() -> None:
        source.shutdown()
        session.data = inner

    session.on_reset(restore)
'''

TESTS = '''\
"""Tests of the $name plugin, with tunekit's plugin-testing harness."""

import pytest
import torch
from tunekit.runtime.session import Session
from tunekit.testing import (
    check_conformance,
    synthetic_observation,
    tiny_dataset_workload,
    tiny_hardware,
    tiny_workload,
)

from $package.model import data_times, predicted_step_s
from $package.plugin import $class_name
from $package.runtime import apply_prefetch

# A job whose batches take 30% of a 100 ms step, on one rank of an 8-core host.
FRACTIONS = {"compute": 0.6, "data": 0.3, "optimizer": 0.1}


def observation(workload, nproc=1, cores=8):
    return synthetic_observation(
        workload,
        nproc=nproc,
        hardware=tiny_hardware(nproc, cores=cores),
        step_s=0.1,
        breakdown=FRACTIONS,
    )


@pytest.mark.parametrize("make_workload", [tiny_workload, tiny_dataset_workload])
def test_honours_the_tuner_contract(make_workload):
    report = check_conformance($class_name(), observation(make_workload()))
    assert report.diagnosis.applies
    assert [c.knobs["prefetch_batches"] for c in report.candidates] == [1, 2]


def test_the_model_hides_data_behind_compute_on_cores_of_its_own():
    times = data_times(observation(tiny_workload(), nproc=1, cores=8))
    assert times.source == "step breakdown"
    # CPU rank with all 8 cores computing: the 30 ms of data spread over 8 cores.
    assert predicted_step_s(times, 1) == pytest.approx(0.07 + 0.03 / 8)
    assert predicted_step_s(times, 0) == pytest.approx(0.1)


def test_no_gain_is_predicted_when_no_core_is_spare():
    diagnosis = $class_name().diagnose(observation(tiny_workload(), nproc=2, cores=2))
    assert not diagnosis.applies
    assert "every core is busy" in diagnosis.summary


@pytest.mark.parametrize("make_workload", [tiny_workload, tiny_dataset_workload])
def test_prefetched_batches_are_the_batches_the_steps_would_make(make_workload):
    plain, prefetched = Session(make_workload()), Session(make_workload())
    apply_prefetch(prefetched, 2)
    try:
        for step in [0, 1, 2, 3, 7, 8, 2]:  # in order, a jump ahead, a jump back
            for a, b in zip(
                plain.data.batch(step), prefetched.data.batch(step), strict=True
            ):
                assert torch.equal(a, b)
    finally:
        plain.close()
        prefetched.close()
'''
