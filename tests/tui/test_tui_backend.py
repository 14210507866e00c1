"""The real backend on a run directory as ``tunekit run`` writes it, and the job process's input checks."""

from __future__ import annotations

import json
import os
import time

import pytest

from tunekit.errors import ControlError, WorkloadError
from tunekit.runtime.job_process import JobProcess
from tunekit.runtime.rundir import RunDir
from tunekit.tui.app import TunekitApp
from tunekit.tui.backend import TuneRequest, attach


@pytest.fixture
def run_dir(tmp_path, fixed) -> RunDir:
    """A run directory with the files a live job writes; its only "rank" is this test process."""
    store = tmp_path / ".tunekit"
    rd = RunDir.create(
        store, {"workload": "example:cnn", "nproc": 2, "config": fixed.BASE}, name="job"
    )
    rd.write_status(fixed.status(40))
    rd.metrics_file.write_text("".join(json.dumps(m) + "\n" for m in fixed.metrics(40)))
    (rd.path / "pids").mkdir()
    (rd.path / "pids" / "rank0").write_text(str(os.getpid()))
    return rd


def test_polling_reads_the_run_and_samples_its_ranks(run_dir):
    backend = attach("job", run_dir.path.parent.parent, telemetry_interval_s=0.05)
    assert backend.workload == "example:cnn" and not backend.owns_job
    try:
        backend.start()
        snap = backend.poll()
        assert snap.status["step"] == 40 and len(snap.metrics) == 40
        with open(run_dir.metrics_file, "a") as f:
            f.write(
                json.dumps(
                    {"step": 40, "loss": 1.0, "step_s": 0.2, "config_id": "x", "world_size": 2}
                )
                + "\n"
            )
        assert backend.poll().metrics[-1]["step"] == 40
        deadline = time.monotonic() + 5
        while len(backend.poll().series["host"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        host = backend.poll().series["host"][-1]["data"]["ranks"]
        assert host["0"]["pid"] == os.getpid()
    finally:
        backend.close(stop_job=True)  # attached: nothing to stop


@pytest.mark.asyncio
async def test_the_app_attached_to_a_run_that_is_not_running(run_dir, wait_for_app, text_of):
    backend = attach(str(run_dir.path), run_dir.path.parent.parent)
    app = TunekitApp(backend, TuneRequest(), poll_s=0.1)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            # The real plugins load (torch imports): slow on a busy machine.
            await wait_for_app(pilot, lambda: app.live_view.step == 40 and app.tuner_views, 180)
            assert app.live_view.attached
            assert "attached" in text_of(app.screen.query_one("#job-line"))
            await pilot.press("5", "r")
            await pilot.pause(0.2)
            await pilot.press("y")
            await wait_for_app(pilot, lambda: app.apply_view.state == "failed")
            assert "not running" in app.apply_view.message
    finally:
        backend.close(stop_job=True)


def test_diagnose_runs_the_real_tuners_on_the_live_steps(run_dir):
    backend = attach("job", run_dir.path.parent.parent)
    try:
        results = {
            r.name: r for r in backend.diagnose(["overlap_chunking", "not_installed"], limit=2)
        }
    finally:
        backend.close(stop_job=False)
    oc = results["overlap_chunking"]
    assert oc.error is None and oc.applies is True and "exposed communication" in oc.summary
    assert 1 <= len(oc.candidates) <= 2 and all(c.predicted_s > 0 for c in oc.candidates)
    assert "overlap_chunking" in oc.candidates[0].config["plugins"]
    assert results["not_installed"].error == "not installed"


def test_bad_input_fails_before_any_process_starts(tmp_path):
    with pytest.raises(WorkloadError):
        JobProcess.start("example:no_such_model", nproc=2, store_dir=tmp_path)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ControlError, match="no run 'nope'"):
        attach("nope", tmp_path)
