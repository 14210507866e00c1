import sys
import types
from importlib.metadata import EntryPoint

import pytest

from tunekit import API_VERSION
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.errors import PluginError
from tunekit.plugin_loading import (
    FAILED,
    INCOMPATIBLE,
    INVALID,
    OK,
    discover,
    load,
    load_all,
    select,
)


class Good(Tuner):
    name, title, aspect = "good", "Good", Aspect.DATA

    def knobs(self):
        return [Knob("workers", "int", 0, low=0, high=8)]

    def diagnose(self, obs):
        return Diagnosis(False, "no")

    def plan(self, obs, limit):
        return [Candidate({}, None)]

    def apply(self, session, knobs):
        pass


class OldApi(Good):
    name = "old"
    api_version = API_VERSION[0] - 1


class WrongName(Good):
    name = "something_else"


class NoAspect(Good):
    name = "noaspect"
    aspect = None


class KnobsRaise(Good):
    name = "knobsraise"

    def knobs(self):
        raise RuntimeError("boom")


@pytest.fixture
def fake_module(monkeypatch):
    mod = types.ModuleType("fake_tuners")
    for cls in (Good, OldApi, WrongName, NoAspect, KnobsRaise):
        setattr(mod, cls.__name__, cls)
    mod.not_a_class = 3
    monkeypatch.setitem(sys.modules, "fake_tuners", mod)
    return mod


def _ep(name, value):
    return EntryPoint(name=name, value=value, group="tunekit.plugins")


@pytest.mark.parametrize(
    ("name", "value", "status", "message"),
    [
        ("good", "fake_tuners:Good", OK, ""),
        ("old", "fake_tuners:OldApi", INCOMPATIBLE, f"written for tuner API {API_VERSION[0] - 1}"),
        ("good2", "fake_tuners:WrongName", INVALID, "names itself 'something_else'"),
        ("noaspect", "fake_tuners:NoAspect", INVALID, "does not declare 'aspect'"),
        ("knobsraise", "fake_tuners:KnobsRaise", FAILED, "RuntimeError: boom"),
        ("num", "fake_tuners:not_a_class", INVALID, "not a tunekit.contract.Tuner subclass"),
        ("gone", "no_such_pkg_abc.plugin:X", FAILED, "import failed: ModuleNotFoundError"),
    ],
)
def test_each_failure_is_classified_and_never_raises(fake_module, name, value, status, message):
    rec = load(_ep(name, value))
    assert rec.status == status
    assert message in rec.error
    assert rec.ok == (status == OK)


def test_builtin_plugins_are_discovered_in_name_order():
    names = [ep.name for ep in discover()]
    assert names == sorted(names)
    assert {"overlap_chunking", "cgdp", "layer_split", "hybrid_mp", "batch_ps_sizing"} <= set(names)
    assert all(r.package.startswith("tunekit ") for r in load_all() if r.name == "overlap_chunking")


def test_select_reports_unknown_and_broken_plugins(fake_module):
    records = [load(_ep("good", "fake_tuners:Good")), load(_ep("gone", "no_such_pkg_abc.plugin:X"))]
    assert list(select(records, None)) == ["good"]
    with pytest.raises(PluginError, match="unknown plugin 'nope'"):
        select(records, ["nope"])
    with pytest.raises(PluginError, match="plugin 'gone' from no_such_pkg_abc.plugin is failed"):
        select(records, ["gone"])
