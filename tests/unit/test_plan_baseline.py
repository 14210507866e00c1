"""`tunekit plan` calibrates on the study's latest baseline, whatever its --steps/--warmup,
says which, and marks every figure uncalibrated when there is none (issue 32, item 6)."""

from __future__ import annotations

import pytest
from rich.console import Console
from support import WORKLOADS

from tunekit.cli.plan import _stored_baseline, baseline_source, candidates_table
from tunekit.observe.static import observe_static
from tunekit.orchestrator import AutoSettings, study_key
from tunekit.store import Store


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("store") / "tunekit.db")
    static = observe_static(f"{WORKLOADS}:tiny", 2, "cpu", None, store, time_layers=False)
    yield store, static
    store.close()


def _study(
    store, static, nproc=2, steps=6, warmup=1, medians=(0.9, 0.84), traces=None, **job
) -> int:
    """A study with a baseline trial per median; ``traces``: the folder of the first one's
    trial, profiled (its traces/ exists), as a study profiles its first baseline; ``job``:
    more study settings (``memory_cap_bytes``, ``layout``)."""
    cap = job.pop("memory_cap_bytes", None)
    settings = AutoSettings(
        static.spec, nproc=nproc, steps=steps, warmup=warmup, memory_cap_bytes=cap
    ).study_settings()
    settings.update(job)
    sid = store.create_study(
        key=study_key(static.graph_hash, static.hardware.fingerprint(), settings),
        workload=static.spec,
        graph_hash=static.graph_hash,
        hw_fingerprint=static.hardware.fingerprint(),
        nproc=nproc,
        settings=settings,
    )
    for seq, median in enumerate(medians):
        tid = store.add_trial(
            sid, seq=seq, role="baseline", plugin=None, config_id="base", config={}
        )
        measurement = {"step_s": [median] * 4, "median_s": median, "spread_s": 0.0,
                       "samples_per_s": 16 / median}  # fmt: skip
        result = {"measurement": measurement}
        if traces is not None and seq == 0:
            (traces / "traces").mkdir(parents=True)
            result["trial_dir"] = str(traces)
        store.finish_trial(tid, status="ok", median_s=median, result=result)
    return sid


def test_plan_uses_the_newest_studys_baseline_whatever_its_steps(observed):
    store, static = observed
    sid = _study(store, static, steps=6, warmup=1)  # not AutoSettings' defaults (16 and 3)
    _study(store, static, nproc=4, medians=(0.5,))  # newer, but another job: 4 ranks
    study, row = _stored_baseline(store, static, 2, None)
    assert study is not None and study.id == sid
    assert row.result["measurement"]["median_s"] == 0.84  # the latest of its two baselines
    assert baseline_source(study, row) == (
        f"study {sid}, baseline trial #1, measured with --steps 6 --warmup 1"
    )
    assert _stored_baseline(store, static, 3, None) == (None, None)  # no study with 3 ranks


def test_plan_prefers_the_profiled_baseline_which_brings_its_breakdown(observed, tmp_path):
    store, static = observed
    sid = _study(store, static, steps=8, warmup=2, medians=(0.7, 0.6), traces=tmp_path / "t0")
    study, row = _stored_baseline(store, static, 2, None)
    assert study.id == sid and row.seq == 0 and row.result["trial_dir"] == str(tmp_path / "t0")


def test_plan_takes_no_baseline_of_another_memory_cap_or_layout(observed):
    """A study under --memory-cap, or of the workload sharded, measured another job."""
    store, static = observed
    plain = _study(store, static, medians=(0.8,))
    capped = _study(store, static, medians=(0.7,), memory_cap_bytes=2**30)
    _study(store, static, medians=(0.6,), layout={"sharding": "fsdp"})  # newest of all
    assert _stored_baseline(store, static, 2, None)[0].id == plain
    assert _stored_baseline(store, static, 2, None, memory_cap=2**30)[0].id == capped


def _rendered(calibrated: bool) -> str:
    rows = [
        {"description": "overlap_chunking(k=4)", "predicted_step_s": 0.146,
         "predicted_samples_per_s": 109.6, "rationale": "chunks"},
        {"description": "overlap_chunking(k=9)", "predicted_step_s": None,
         "predicted_samples_per_s": None, "rationale": "no prediction: why"},
    ]  # fmt: skip
    console = Console(record=True, width=400)
    console.print(candidates_table(rows, calibrated=calibrated))
    return console.export_text()


def test_uncalibrated_figures_say_so_in_every_column():
    text = _rendered(calibrated=False)
    assert "UNCALIBRATED" in text
    assert "model step (uncalibrated)" in text and "model samples/s (uncalibrated)" in text
    assert "≈146.0 ms" in text and "≈109.6" in text  # each figure marked, not only the title
    assert "predicted step" not in text.split("\n", 1)[1]  # no column reads as a prediction
    calibrated = _rendered(calibrated=True)
    assert "≈" not in calibrated and "146.0 ms" in calibrated and "predicted step" in calibrated
