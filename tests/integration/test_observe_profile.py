"""Real multi-process observation: `tunekit profile` (a profiled 2-rank gloo trial and its breakdown), the probe."""

from __future__ import annotations

import json
import statistics

import pytest

from tunekit.observe.breakdown import PARTS, analyze_trial

pytestmark = pytest.mark.slow


def test_profile_job_end_to_end_and_its_breakdown_sums_to_the_measured_step(tmp_path):
    """`tunekit profile`'s whole path; its profiled trial (a fresh 2-rank trial through the
    launcher) also carries the breakdown's claim: each rank's parts sum to its measured step."""
    from tunekit.observe.profile_job import ProfileOptions, profile_job

    stages = []
    report = profile_job(
        "example:cnn",
        ProfileOptions(nproc=2, steps=3, warmup=3, out_dir=tmp_path, layer_repeats=1),
        on_stage=stages.append,
    )
    assert stages[0] == "tracing the model graph" and len(stages) == 4
    assert report["graph"]["method"] == "fx" and report["graph"]["params"] == 1_276_234
    assert len(report["top_layers"]) == 9 and report["top_layers"][0]["forward_s"] > 0
    bd = report["breakdown"]
    assert [r["rank"] for r in bd["ranks"]] == [0, 1]
    assert sum(bd["summary"]["fractions"][p] for p in PARTS) == pytest.approx(1.0)
    assert bd["summary"]["total_s"] == pytest.approx(bd["summary"]["measured_step_s"], rel=0.05)
    tel = report["telemetry"]
    assert set(tel["host"]["ranks"]) == {"0", "1"}  # the ranks' pids came from trial/pids
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written["files"]["traces"] == report["files"]["traces"]
    assert len(report["files"]["traces"]) == 2
    assert json.loads((tmp_path / "telemetry.json").read_text())["series"]["host"]

    trial = analyze_trial(tmp_path / "trial")  # the trial's traces, read afresh
    assert len(trial.ranks) == 2
    for rb in trial.ranks:
        assert len(rb.steps) == 3
        parts = statistics.fmean(s.parts_sum() for s in rb.steps)
        measured = statistics.fmean(rb.measured_step_s)
        assert parts == pytest.approx(measured, rel=0.05)
        assert all(s.comm_total_s > 0 for s in rb.steps)
        assert rb.overlap_R is not None and 0 <= rb.overlap_R <= 100


def test_probe_fits_collectives_on_two_real_ranks():
    from tunekit.observe.probe import probe_hardware

    res = probe_hardware(2, sizes=(4096, 65536, 2**20, 2**22), repeats=2)
    ops = {s.op: s for s in res.sweeps}
    assert set(ops) == {"all_reduce", "p2p"}
    for s in res.sweeps:
        assert s.backend == "gloo" and len(s.points) == 4
        assert s.fit.bandwidth > 0 and s.fit.latency >= 0 and s.fit.residual >= 0
    hw = res.hardware
    assert hw.source == "probe"
    assert hw.fit("all_reduce", 2, "gloo") == ops["all_reduce"].fit
    assert hw.path_bandwidth("rank0", "rank1") == pytest.approx(ops["p2p"].fit.bandwidth)
