"""The tuner's hooks on the example CNN: knobs, diagnosis, plan, runtime on one rank."""

from __future__ import annotations

import pytest

from tunekit.contract import Aspect
from tunekit.errors import ConfigError
from tunekit.hardware import CollectiveFit
from tunekit.observe.local import describe_local_machine
from tunekit.observe.observation import Measurement, Observation, summarize_model
from tunekit.plugins.overlap_chunking.plugin import OverlapChunking
from tunekit.plugins.overlap_chunking.search import TIE_TOLERANCE
from tunekit.runtime.session import Session
from tunekit.runtime.sync import LocalSync
from tunekit.workload import load_workload


class DictCache:
    """The study store's cache interface, in memory."""

    def __init__(self):
        self.data = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value):
        self.data[key] = value


def observation(nproc=2, baseline_s: float | None = 0.4, cache=None) -> Observation:
    wl = load_workload("example:cnn")
    summary = summarize_model(wl.model(), wl.example_batch(2)[0])
    # A slow link (20 MB/s) so that communication matters for this small model.
    fit = CollectiveFit("gloo", "all_reduce", nproc, latency=1e-4, bandwidth=20e6)
    hw = describe_local_machine(nproc, "cpu", (fit,))
    baseline = Measurement([baseline_s], baseline_s, 0.0, 64 / baseline_s) if baseline_s else None
    return Observation(
        "example:cnn", wl, nproc, "gloo", "cpu", hw, summary, baseline=baseline, cache=cache
    )


@pytest.fixture(scope="module")
def tuner():
    return OverlapChunking()


@pytest.fixture(scope="module")
def cache():
    return DictCache()


def test_knobs_declare_both_modes(tuner):
    assert tuner.aspect is Aspect.GRAD_SYNC
    defaults = tuner.defaults()
    assert defaults["mode"] == "ddp_buckets"
    assert (defaults["bucket_cap_mb"], defaults["first_bucket_mb"]) == (25.0, 1.0)
    assert tuner.validate({"mode": "two_chunk", "k": 9, "f": 2})["k"] == 9
    with pytest.raises(ConfigError, match="not one of"):
        tuner.validate({"mode": "three_chunks"})
    with pytest.raises(ConfigError, match="out of range"):
        tuner.validate({"f": -1})


def test_one_rank_has_nothing_to_overlap(tuner):
    diag = tuner.diagnose(observation(nproc=1))
    assert not diag.applies
    assert tuner.plan(observation(nproc=1), 3) == []


def test_diagnosis_names_exposed_communication_and_the_best_setting(tuner, cache):
    obs = observation(cache=cache)
    diag = tuner.diagnose(obs)
    assert diag.applies
    assert "exposed communication" in diag.summary
    details = diag.details
    assert 0 < details["exposed_s"] < obs.baseline.median_s
    assert details["layers"] == 9 and details["fc_layers"] == 3
    assert details["compute_scale"] is not None  # calibrated to the baseline
    # The calibrated model reproduces the measured baseline.
    assert details["predicted_default"]["step_s"] == pytest.approx(obs.baseline.median_s, rel=1e-6)
    assert 0 <= diag.expected_gain < 1
    # The profile went to the study cache: a second tuner does not measure again.
    assert any(key.startswith("overlap_chunking:profile") for key in cache.data)


def test_plan_ranks_candidates_of_both_modes_with_predictions(tuner, cache):
    obs = observation(cache=cache)
    candidates = tuner.plan(obs, 4)
    assert 2 <= len(candidates) <= 4
    modes = {c.knobs["mode"] for c in candidates}
    assert modes == {"ddp_buckets", "two_chunk"}
    predicted = [c.predicted_step_s for c in candidates]
    assert all(p > 0 for p in predicted)
    # Best first, up to ties within the model's precision.
    assert predicted[0] <= min(predicted) * (1 + TIE_TOLERANCE)
    for c in candidates:
        knobs = tuner.validate(c.knobs)
        assert not (
            knobs["mode"] == "ddp_buckets"
            and knobs["bucket_cap_mb"] == 25.0
            and knobs["first_bucket_mb"] == 1.0
        )
        assert 0 <= c.details["overlap_R"] <= 100
        assert c.details["comms"]
    # On this slow link replicating FC1 (4 M weights vs 2.5 k gathered values
    # per sample) beats all-reducing it.
    best = candidates[0]
    assert best.knobs["mode"] == "two_chunk" and best.knobs["f"] >= 1


def test_plan_without_baseline_is_uncalibrated(tuner, cache):
    obs = observation(baseline_s=None, cache=cache)
    diag = tuner.diagnose(obs)
    assert diag.applies and "uncalibrated" in diag.summary
    assert tuner.plan(obs, 2)
    # A baseline shorter than the modelled communication alone cannot calibrate.
    diag = tuner.diagnose(observation(baseline_s=0.01, cache=cache))
    assert "shorter than" in diag.summary and diag.details["compute_scale"] is None


def test_apply_on_one_rank_keeps_local_sync(tuner):
    session = Session(load_workload("example:cnn"))
    tuner.apply(session, tuner.validate({"mode": "two_chunk", "k": 3, "f": 1}))
    assert isinstance(session.grad_sync, LocalSync)
    session.train_step()
    session.close()


def test_snippets(tuner):
    ddp = tuner.snippet(tuner.validate({"bucket_cap_mb": 4.0, "first_bucket_mb": 0.5}))
    assert "DistributedDataParallel(model" in ddp and "bucket_cap_mb_list=[0.5] + [4] * 1024" in ddp
    two = tuner.snippet(tuner.validate({"mode": "two_chunk", "k": 9, "f": 2}))
    assert "apply_two_chunk(session, k=9, f=2)" in two
