"""Tests of the dataloader example plugin, with tunekit's plugin-testing harness."""

from pathlib import Path

import pytest
import torch
from tunekit_dataloader.model import ipc_s, loader_facts, predicted_step_s
from tunekit_dataloader.plugin import DataLoaderTuner
from tunekit_dataloader.runtime import apply_loader_options

from tunekit.api import Session
from tunekit.testing import (
    check_conformance,
    synthetic_observation,
    tiny_dataset_workload,
    tiny_hardware,
    tiny_workload,
)
from tunekit.workload import load_workload

SLOW_LOADER = Path(__file__).resolve().parents[2] / "workloads" / "slow_loader.py"
# 40 ms of a 100 ms step spent loading the batch in the training process.
FRACTIONS = {"compute": 0.5, "data": 0.4, "optimizer": 0.1}


def observation(nproc=1, cores=8, device_type="cpu", **kw):
    kw.setdefault("breakdown", FRACTIONS)
    return synthetic_observation(
        tiny_dataset_workload(),
        nproc=nproc,
        hardware=tiny_hardware(nproc, device_type, cores=cores),
        device_type=device_type,
        step_s=0.1,
        **kw,
    )


def test_honours_the_tuner_contract_with_real_worker_processes():
    # The runtime check starts real DataLoader workers, resets, and checks none are left.
    report = check_conformance(DataLoaderTuner(), observation())
    assert report.diagnosis.applies
    assert [k["num_workers"] for k in report.knob_sets] == [0, 1]  # the defaults, then the plan's


def test_cpu_ranks_hide_only_what_their_idle_cores_can_take():
    facts = loader_facts(observation(cores=8))
    assert (facts.source, facts.cores, facts.busy) == ("step breakdown", 8.0, 8.0)
    # Bound by the cores: 60 ms of compute on all 8, plus 40 ms of loading spread over them.
    expected = 0.06 + 0.04 / 8 + ipc_s(facts.batch_bytes)
    assert predicted_step_s(facts, 1) == pytest.approx(expected)
    assert predicted_step_s(facts, 4) == pytest.approx(expected)
    candidates = DataLoaderTuner().plan(observation(cores=8), limit=4)
    assert [c.knobs["num_workers"] for c in candidates] == [1]  # more workers add nothing


def test_on_a_gpu_one_worker_hides_the_loading_behind_compute():
    obs = observation(cores=8, device_type="cuda")
    facts = loader_facts(obs)
    pinned = facts.batch_bytes / facts.h2d_bytes_per_s
    assert predicted_step_s(facts, 1, pin_memory=True) == pytest.approx(
        0.06 + ipc_s(facts.batch_bytes) - pinned
    )
    best = DataLoaderTuner().plan(obs, limit=4)[0]
    assert best.knobs == {"num_workers": 1, "pin_memory": True, "prefetch_factor": 2}


def test_slow_loading_needs_more_workers_on_a_gpu():
    # 70 ms of loading against 30 ms of compute: 3 workers keep up (23 ms each), 2 do not.
    obs = observation(device_type="cuda", breakdown={"compute": 0.3, "data": 0.7})
    candidates = DataLoaderTuner().plan(obs, limit=4)
    assert [c.knobs["num_workers"] for c in candidates] == [3, 2, 1]
    assert [c.details["bound"] for c in candidates] == ["training", "workers", "workers"]


def test_py_spy_is_the_evidence_when_the_step_was_not_profiled():
    obs = observation(breakdown=False, pyspy={"data_loading": 0.4, "native": 0.6})
    diagnosis = DataLoaderTuner().diagnose(obs)
    assert diagnosis.details["source"] == "py-spy stack samples"
    assert diagnosis.details["data_s"] == pytest.approx(0.04)
    assert "data loading: 40% of stack samples" in diagnosis.summary
    assert diagnosis.applies


def test_without_a_profile_or_stack_samples_real_steps_are_timed_here():
    facts = loader_facts(observation(breakdown=False))
    assert facts.source == "timed in this process"
    assert facts.step_s == pytest.approx(0.1)  # the baseline's step; its data part measured here
    assert 0 < facts.data_s < facts.step_s


def test_no_workers_when_every_core_computes_and_the_rank_has_no_other():
    diagnosis = DataLoaderTuner().diagnose(observation(nproc=2, cores=2))
    assert not diagnosis.applies
    assert "cores are busy computing" in diagnosis.summary


def test_batch_factory_workloads_have_no_loader_to_tune():
    obs = synthetic_observation(tiny_workload(), nproc=1)
    assert not DataLoaderTuner().diagnose(obs).applies
    assert DataLoaderTuner().plan(obs, 4) == []


def test_workers_load_exactly_the_batches_the_training_process_would():
    workload = load_workload(f"{SLOW_LOADER}:workload")
    plain, loaded = Session(workload), Session(workload)
    tuner = DataLoaderTuner()
    apply_loader_options(loaded, tuner.validate({"num_workers": 2, "prefetch_factor": 2}))
    try:
        for step in range(3):
            for a, b in zip(plain.data.batch(step), loaded.data.batch(step), strict=True):
                assert torch.equal(a, b)
    finally:
        plain.close()
        loaded.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_pinned_workers_feed_a_gpu_and_stop_cleanly():
    # On a GPU the loader's pin-memory thread runs too: the harness checks it ends on reset.
    obs = observation(cores=8, device_type="cuda")
    report = check_conformance(DataLoaderTuner(), obs, device="cuda")
    assert report.knob_sets[-1] == {"num_workers": 1, "pin_memory": True, "prefetch_factor": 2}
    session = Session(tiny_dataset_workload(), device=torch.device("cuda"))
    try:
        apply_loader_options(session, report.knob_sets[-1])
        inputs, targets = session.data.batch(0)
        assert inputs.is_cuda and targets.is_cuda
    finally:
        session.close()
