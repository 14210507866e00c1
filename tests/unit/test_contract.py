import pytest

from tunekit.config import TuningConfig, resolve
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.errors import ConfigError


class _Buckets(Tuner):
    name, title, aspect = "buckets", "Buckets", Aspect.GRAD_SYNC

    def knobs(self):
        return [
            Knob("cap", "float", 25.0, low=0.5, high=100),
            Knob("count", "int", 2, low=1, high=8),
            Knob("view", "bool", False),
            Knob("mode", "choice", "a", choices=("a", "b")),
        ]

    def diagnose(self, obs):
        return Diagnosis(True, "ok")

    def plan(self, obs, limit):
        return [Candidate({"cap": 8.0}, 0.1)]

    def apply(self, session, knobs):
        pass


class _OtherSync(_Buckets):
    name = "other_sync"


class _Placement(_Buckets):
    name, aspect, excludes = "place", Aspect.PLACEMENT, frozenset({Aspect.GRAD_SYNC})


class _Batch(_Buckets):
    name, aspect = "batch", Aspect.BATCH


def test_knob_checks_types_and_ranges():
    k = Knob("cap", "float", 25.0, low=0.5, high=100)
    assert k.check(3) == 3.0
    with pytest.raises(ConfigError, match=r"out of range \[0.5, 100\]"):
        k.check(200)
    with pytest.raises(ConfigError, match="expected a number"):
        k.check("big")
    with pytest.raises(ConfigError, match="expected an integer"):
        Knob("n", "int", 1, low=0, high=4).check(1.5)
    with pytest.raises(ConfigError, match="expected true or false"):
        Knob("b", "bool", False).check(1)
    with pytest.raises(ConfigError, match="not one of a, b"):
        Knob("m", "choice", "a", choices=("a", "b")).check("c")


def test_knob_default_must_be_valid():
    with pytest.raises(ConfigError):
        Knob("cap", "float", 500.0, low=0, high=100)


def test_validate_fills_defaults_and_refuses_unknown_knobs():
    t = _Buckets()
    assert t.validate({"cap": 8}) == {"cap": 8.0, "count": 2, "view": False, "mode": "a"}
    with pytest.raises(ConfigError, match="unknown knob 'size'"):
        t.validate({"size": 1})


def test_a_tuner_missing_a_hook_cannot_be_built():
    class Incomplete(Tuner):
        name, title, aspect = "x", "X", Aspect.BATCH

        def knobs(self):
            return []

    with pytest.raises(TypeError):
        Incomplete()


def test_resolve_orders_by_aspect_and_refuses_two_of_one_aspect():
    tuners = {t.name: t for t in (_Buckets(), _OtherSync(), _Placement(), _Batch())}
    plan = resolve(TuningConfig({"buckets": {}, "batch": {}}), tuners)
    assert [t.name for t, _ in plan] == ["batch", "buckets"]  # batch before grad_sync
    with pytest.raises(ConfigError, match="both control grad_sync"):
        resolve(TuningConfig({"buckets": {}, "other_sync": {}}), tuners)
    with pytest.raises(ConfigError, match="'place' manages grad_sync itself"):
        resolve(TuningConfig({"place": {}, "buckets": {}}), tuners)
    with pytest.raises(ConfigError, match="not installed"):
        resolve(TuningConfig({"nope": {}}), tuners)


def test_config_roundtrip_and_identity():
    a = TuningConfig({"buckets": {"cap": 8.0, "count": 2}})
    b = TuningConfig.from_json(a.to_dict().__repr__().replace("'", '"'))
    assert a.config_id == b.config_id
    assert TuningConfig().is_baseline and TuningConfig().describe() == "baseline"
    assert a.describe({"buckets": {"cap": 25.0, "count": 2}}) == "buckets(cap=8.0)"
    with pytest.raises(ConfigError, match="not valid JSON"):
        TuningConfig.from_json("{nope")
    with pytest.raises(ConfigError, match="must map tuner names"):
        TuningConfig.from_dict({"plugins": {"buckets": 3}})


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        TuningConfig.load(tmp_path / "none.json")
    (tmp_path / "c.json").write_text('{"tunekit_config": 1, "plugins": {"buckets": {"cap": 4}}}')
    assert TuningConfig.load(tmp_path / "c.json").plugins == {"buckets": {"cap": 4}}


@pytest.mark.parametrize(
    ("pair", "cut"),
    [
        ("overlap_chunking.k=1e300", "(301 characters) is out of range"),
        ("overlap_chunking.mode=" + "x" * 5000, "(5002 characters) is not one of"),
        ("overlap_chunking.k=" + "9" * 400, "(400 characters) is out of range"),
    ],
)
def test_a_refused_value_is_quoted_cut_not_whole(pair, cut):
    """Issue 34, item 11: `k=1e300` reads as an integer of 301 digits; the error quotes 40."""
    from tunekit.config import TuningConfig, resolve
    from tunekit.errors import ConfigError
    from tunekit.plugin_loading import available_tuners

    with pytest.raises(ConfigError) as raised:
        resolve(TuningConfig.from_pairs([pair]), available_tuners())
    message = str(raised.value)
    assert cut in message and len(message) < 160, message
