"""The real backend on a run directory as ``tunekit run`` writes it, and the job process's input checks."""

from __future__ import annotations

import json
import os
import time

import pytest

from tunekit.errors import ControlError, WorkloadError
from tunekit.runtime.job_process import JobProcess
from tunekit.runtime.rundir import RunDir
from tunekit.tui.backend import attach


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


IDLE_APP = """
import asyncio, json, sys
from tunekit.tui.app import TunekitApp
from tunekit.tui.backend import TuneRequest, attach

async def main(run, store):
    backend = attach(run, store)
    app = TunekitApp(backend, TuneRequest(), poll_s=0.1)
    notes = []
    app.notify = lambda message, **kw: notes.append(message)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            for _ in range(3000):  # the plugins are listed by a child process: torch loads there
                if app.live_view.step == 40 and app.tuner_views:
                    break
                await pilot.pause(0.1)
            job_line = str(app.screen.query_one("#job-line").content)
            for key in ("2", "3", "4", "5", "question_mark", "1", "5", "r"):
                await pilot.press(key)
                await pilot.pause(0.05)
            await pilot.pause(0.2)
            print(json.dumps({
                "tuners": [t.name for t in app.tuner_views],
                "attached": app.live_view.attached,
                "job_line": job_line,
                "screen": type(app.screen).__name__,
                "notes": notes,
                "torch": "torch" in sys.modules,
            }))
    finally:
        backend.close(stop_job=False)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_the_idle_app_on_an_attached_run_never_imports_torch(run_dir):
    """Issue 35: the idle app held ~1 GB, torch loaded by listing the plugins (and by starting
    torch.profiler before the app). Here, in a process of its own: attach, list the tuners,
    poll, visit every screen, ask for a rollback; torch stays out."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", IDLE_APP, str(run_dir.path), str(run_dir.path.parent.parent)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert "overlap_chunking" in seen["tuners"]  # the real plugins, listed
    assert seen["attached"] and "attached" in seen["job_line"]
    # Nothing was applied to this run: said at once, no question, no red "failed".
    assert seen["screen"] == "ApplyScreen"
    assert any("nothing to roll back" in n for n in seen["notes"]), seen["notes"]
    assert seen["torch"] is False


def test_diagnose_runs_the_real_tuners_on_the_live_steps(run_dir):
    backend = attach("job", run_dir.path.parent.parent)
    heard: list[tuple[str | None, str]] = []
    try:
        results = {
            r.name: r
            for r in backend.diagnose(
                ["overlap_chunking", "not_installed"],
                limit=2,
                on_progress=lambda name, what: heard.append((name, what)),
            )
        }
    finally:
        backend.close(stop_job=False)
    # Issue 35: "…" was the only sign of progress for two minutes. The shared observation
    # says what it measures, then each tuner which hook it runs.
    shared = [what for name, what in heard if name is None]
    assert "tracing the model graph" in shared
    assert any(w.startswith("timing ") and "layers" in w for w in shared) or any(
        "cache" in w for w in shared
    )
    assert [h for h in heard if h[0] is not None] == [
        ("overlap_chunking", "diagnosing"),
        ("overlap_chunking", "planning its candidates"),
    ]
    oc = results["overlap_chunking"]
    assert oc.error is None and oc.applies is True and "exposed communication" in oc.summary
    assert oc.headline and len(oc.headline) <= 100
    assert 1 <= len(oc.candidates) <= 2 and all(c.predicted_s > 0 for c in oc.candidates)
    assert "overlap_chunking" in oc.candidates[0].config["plugins"]
    assert results["not_installed"].error == "not installed"


def test_bad_input_fails_before_any_process_starts(tmp_path):
    with pytest.raises(WorkloadError):
        JobProcess.start("example:no_such_model", nproc=2, store_dir=tmp_path)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ControlError, match="no run 'nope'"):
        attach("nope", tmp_path)
