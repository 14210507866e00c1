"""The tuner through its contract: knobs, live apply with lr rescaling and rollback, diagnose and plan."""

from __future__ import annotations

import statistics

import pytest
import torch

from tunekit.config import TuningConfig
from tunekit.errors import ConfigError
from tunekit.hardware import load_profile
from tunekit.observe.breakdown import Breakdown, RankBreakdown, StepParts
from tunekit.observe.local import describe_local_machine
from tunekit.observe.observation import Measurement, Observation, summarize_model
from tunekit.plugin_loading import load_all
from tunekit.plugins.batch_ps_sizing import model as zou
from tunekit.plugins.batch_ps_sizing.plugin import BatchPsSizing
from tunekit.runtime.session import Session
from tunekit.store import Store, StudyCache
from tunekit.workload import Workload, load_workload

# -- declare ----------------------------------------------------------------------------


def test_registered_and_declares_batch_knobs():
    rec = {r.name: r for r in load_all()}["batch_ps_sizing"]
    assert rec.ok, rec.error
    knobs = BatchPsSizing().knob_map()
    assert set(knobs) == {"batch_size", "accumulation", "cudnn_benchmark", "knee_tolerance"}
    assert knobs["batch_size"].changes_math and knobs["batch_size"].default == 0
    assert knobs["accumulation"].changes_math and knobs["accumulation"].default == 0
    assert not knobs["cudnn_benchmark"].changes_math
    with pytest.raises(ConfigError):
        BatchPsSizing().validate({"batch_size": -4})


# -- live apply ---------------------------------------------------------------------------


def _tuners():
    return {"batch_ps_sizing": BatchPsSizing()}


def test_live_batch_change_rescales_lr_rebuilds_data_and_rolls_back():
    session = Session(load_workload("example:cnn"))  # batch 32, lr 0.02, linear scaling
    for _ in range(3):
        session.train_step()
    weights = {k: v.clone() for k, v in session.model.state_dict().items()}
    session.apply_config(TuningConfig({"batch_ps_sizing": {"batch_size": 64}}), _tuners())
    assert session.batch_size == 64 and session.lr == pytest.approx(0.04)
    assert session.optimizer.param_groups[0]["lr"] == pytest.approx(0.04)
    assert all(torch.equal(weights[k], v) for k, v in session.model.state_dict().items())
    inputs, _ = session.data.batch(session.step)
    assert inputs.shape[0] == 64
    rec = session.train_step()
    assert rec.step == 3 and torch.isfinite(torch.tensor(rec.loss))
    session.apply_config(TuningConfig(), _tuners())  # rollback to the workload's own
    assert session.batch_size == 32 and session.lr == pytest.approx(0.02)
    assert session.data.batch(session.step)[0].shape[0] == 32


def test_zero_keeps_the_workloads_batch_and_range_is_enforced():
    session = Session(load_workload("example:cnn"))
    session.apply_config(TuningConfig({"batch_ps_sizing": {"batch_size": 0}}), _tuners())
    assert session.batch_size == 32 and session.lr == pytest.approx(0.02)
    with pytest.raises(ConfigError, match="not allowed within"):
        session.apply_config(TuningConfig({"batch_ps_sizing": {"batch_size": 512}}), _tuners())
    assert session.batch_size == 32 and session.lr == pytest.approx(0.02)


def test_workload_without_range_refuses_any_change():
    base = load_workload("example:cnn")
    fixed = Workload(
        name="fixed", model=base.model, make_batch=base.make_batch, batch_size=32, batch_range=None
    )
    session = Session(fixed)
    session.apply_config(TuningConfig({"batch_ps_sizing": {"batch_size": 32}}), _tuners())
    with pytest.raises(ConfigError, match="no batch_range"):
        session.apply_config(TuningConfig({"batch_ps_sizing": {"batch_size": 64}}), _tuners())


def test_sqrt_scaling_rule_is_followed():
    session = Session(load_workload("example:lstm"))  # batch 16, lr 1e-3, sqrt
    session.apply_config(TuningConfig({"batch_ps_sizing": {"batch_size": 64}}), _tuners())
    assert session.lr == pytest.approx(2e-3)


def test_cudnn_benchmark_knob_is_undone_on_reset():
    before = torch.backends.cudnn.benchmark
    session = Session(load_workload("example:cnn"))
    session.apply_config(
        TuningConfig({"batch_ps_sizing": {"cudnn_benchmark": not before}}), _tuners()
    )
    assert torch.backends.cudnn.benchmark is (not before)
    session.apply_config(TuningConfig(), _tuners())
    assert torch.backends.cudnn.benchmark is before


def test_snippet_names_the_batch():
    assert "batch_size = 64" in BatchPsSizing().snippet({"batch_size": 64, "cudnn_benchmark": True})
    assert BatchPsSizing().snippet({"batch_size": 0, "cudnn_benchmark": False}) is None


# -- diagnose / plan ---------------------------------------------------------------------------

# The measuring budget is the tuner's own setting (45 s by default): these check the memory fit,
# the plan's range and the lemmas, which the batches every analysis times (the required ones)
# decide. One setting for all: they share the analysis cached in the module's study cache.
QUICK = {"measure_budget_s": 8.0}


def _baseline(workload: Workload, steps: int = 4) -> Measurement:
    session = Session(workload)
    times = [session.train_step().step_s for _ in range(steps)][1:]
    med = statistics.median(times)
    return Measurement(times, med, max(times) - min(times), workload.batch_size / med)


@pytest.fixture(scope="module")
def cnn_parts(tmp_path_factory):
    w = load_workload("example:cnn")
    store = Store(tmp_path_factory.mktemp("store") / "study.db")
    return (
        w,
        summarize_model(w.model(), w.example_batch(2)[0]),
        _baseline(w),
        StudyCache(store, "test"),
    )


def _obs(parts, hardware, nproc=1, breakdown=None) -> Observation:
    w, summary, baseline, cache = parts
    return Observation(
        "example:cnn",
        w,
        nproc,
        "gloo",
        "cpu",
        hardware,
        summary,
        baseline=baseline,
        breakdown=breakdown,
        cache=cache,
    )


def test_diagnose_reports_memory_fit_and_plan_stays_in_range(cnn_parts):
    obs = _obs(cnn_parts, describe_local_machine(1, "cpu"))
    tuner = BatchPsSizing(**QUICK)
    diag = tuner.diagnose(obs)
    d = diag.details
    prof = zou.MemoryProfile(**d["memory_profile"])
    assert prof.method == "cpu-profiler" and prof.per_sample_bytes > 0
    assert d["largest_fitting_batch"] == prof.largest_batch(
        obs.hardware.devices[0].memory_bytes, 0.1
    )
    assert d["eq5"]["largest_batch"] > 0  # the CNN is a chain: Eqs. 1-5 apply
    assert d["eq5"]["algorithm_plan"]["rows"]
    assert "MiB" in diag.summary
    lo, hi = obs.workload.batch_range
    for cand in tuner.plan(obs, 10):
        b = cand.knobs["batch_size"]
        assert lo <= b <= hi and b != obs.workload.batch_size
        assert cand.details["lr"] == pytest.approx(obs.workload.scaled_lr(b))
        assert cand.predicted_step_s > 0


def test_lemma31_from_a_step_breakdown(cnn_parts):
    # 0.10 s compute, 0.01 s not hidden behind it: R_O = 0.1.
    step = StepParts(0, 0.11, 0.10, 0.006, 0.002, 0.001, 0.001, 0.008)
    breakdown = Breakdown([RankBreakdown(0, "cpu", "markers", [step])])
    obs = _obs(cnn_parts, load_profile("k80x16"), nproc=1, breakdown=breakdown)
    tuner = BatchPsSizing(target_efficiency=0.8, target_speedup=3, **QUICK)
    lem = tuner.diagnose(obs).details["lemma31"]
    assert lem["overhead_ratio"] == pytest.approx(0.1)
    assert lem["gpus_for_speedup"] == 4
    assert lem["gpus_for_efficiency"] == 3  # alpha(3) = 0.846, alpha(4) = 0.786
    assert lem["speedup_asymptote"] == pytest.approx(11.0)
    assert {row["gpus"]: round(row["efficiency"], 4) for row in lem["curve"]}[8] == 0.6111


def test_lemma31_and_32_from_the_hardware_model(cnn_parts):
    hw = load_profile("k80x16")
    obs = _obs(cnn_parts, hw, nproc=1)
    d = BatchPsSizing(**QUICK).diagnose(obs).details
    assert "hardware model" in d["overhead_source"]
    expected = (
        hw.allreduce_time(obs.model.param_bytes, len(hw.devices), "gloo") / obs.baseline.median_s
    )
    assert d["lemma31"]["overhead_ratio"] == pytest.approx(expected)
    lem32 = d["lemma32"]
    slowest = min(lk.bandwidth for lk in hw.links)
    assert lem32["bandwidth_gbps"] == pytest.approx(slowest * 8 / 1e9)
    assert lem32["parameter_servers"] == zou.parameter_servers(
        zou.DataSize.of_bytes(obs.model.param_bytes),
        1,
        zou.Bandwidth.of_bytes_per_s(slowest),
        obs.baseline.median_s,
    )


def test_without_range_the_diagnosis_says_so(cnn_parts):
    w, summary, baseline, cache = cnn_parts
    fixed = Workload(
        name="fixed", model=w.model, make_batch=w.make_batch, batch_size=32, batch_range=None
    )
    # Same model as example:cnn, so the cached measurement of that model serves.
    obs = Observation(
        "example:cnn",
        fixed,
        1,
        "gloo",
        "cpu",
        describe_local_machine(1, "cpu"),
        summary,
        baseline=baseline,
        cache=cache,
    )
    tuner = BatchPsSizing(**QUICK)
    diag = tuner.diagnose(obs)
    assert not diag.applies and "batch_range" in diag.summary
    assert tuner.plan(obs, 5) == []
