"""Issue 19 through the installed command: fast failures, the local hardware, and a config
copied from `tunekit plan` to `tunekit apply` on a live run."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest
from support import WORKLOADS

from tunekit.cli.main import main
from tunekit.config import TuningConfig
from tunekit.runtime.rundir import RunDir


def one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert any(needle in ln for ln in err.splitlines()), err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["auto", "--budget", "0s"], "'0s' is no time at all"),
        (["auto", "--plugins", ""], "--plugins '' names no tuner"),
        (["tui", "--plugins", " , "], "names no tuner"),
    ],
)
def test_bad_input_says_what_is_wrong(workdir, capsys, args, needle):
    code = main(args)
    one_line_error(code, capsys.readouterr().err, needle)


@pytest.mark.parametrize("command", [["auto"], ["plan", "overlap_chunking"], ["profile"], ["tui"]])
def test_a_missing_workload_file_fails_before_torch_loads(workdir, command):
    """Issue 19: it took 8 s to say so, importing torch first."""
    code = (
        "import sys; from tunekit.cli.main import main; "
        f"code = main({[*command, 'missing.py:fn']!r}); print(code, 'torch' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300
    )
    assert res.stdout.split() == ["2", "False"], res.stderr
    assert "workload file missing.py not found" in res.stderr and "Traceback" not in res.stderr


def test_hardware_show_without_a_profile_shows_this_machine(cli):
    res = cli("hardware", "show")
    assert res.returncode == 0, res.stderr
    assert "this machine" in res.stdout and "devices" in res.stdout and "fingerprint" in res.stdout


@pytest.mark.slow
@pytest.mark.busy_ok
@pytest.mark.timeout(1800)
def test_a_config_copied_from_plan_applies_to_a_live_run(cli, workdir):
    workload = f"{WORKLOADS}:light_cnn"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tunekit",
            "run",
            workload,
            "--nproc",
            "2",
            "--name",
            "job",
            "--watch-window",
            "4",
        ],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Every candidate comes apply-ready, fastest predicted (per sample) first.
        res = cli("plan", "batch_ps_sizing", workload, "--json")
        assert res.returncode == 0, res.stderr
        plan = json.loads(res.stdout)
        rates = [c["predicted_samples_per_s"] for c in plan["candidates"]]
        assert rates and rates == sorted(rates, reverse=True)
        first = plan["candidates"][0]
        assert first["apply"].startswith("tunekit apply RUN batch_ps_sizing.")

        # A long config is written to a file and named by its path; nothing is cut.
        res = cli("plan", "layer_split", workload)
        assert res.returncode == 0, res.stderr
        assert "…" not in res.stdout
        assert "tunekit apply RUN tunekit-out/plan/layer_split-1.json" in res.stdout
        TuningConfig.load(workdir / "tunekit-out" / "plan" / "layer_split-1.json")

        rd = RunDir.find("job", workdir / ".tunekit")
        deadline = time.monotonic() + 600
        while rd.read_status().get("status") != "running" or rd.read_status().get("step", 0) < 12:
            assert time.monotonic() < deadline and job.poll() is None, rd.read_status()
            time.sleep(1)

        # The batch range is the run's, checked before anything is sent.
        bad = cli("apply", "job", "batch_ps_sizing.batch_size=100000")
        one_line_error(bad.returncode, bad.stderr, "outside run job's batch range (2–64")

        args = shlex.split(first["apply"])[3:]
        res = cli("apply", "job", *args)
        assert res.returncode in (0, 1), (
            res.stderr
        )  # kept, or rolled back by the watch: applied either way
        assert "applied at step" in res.stdout
        assert rd.read_events()[-1]["kind"] in ("applied", "watch_kept", "rolled_back")
        applied = next(e for e in reversed(rd.read_events()) if e["kind"] == "applied")
        assert (
            TuningConfig.from_dict(applied["config"]).plugins["batch_ps_sizing"]["batch_size"]
            == (TuningConfig.from_pairs(args).plugins["batch_ps_sizing"]["batch_size"])
        )

        status = cli("status", "job")
        assert status.returncode == 0, status.stderr
        assert "samples/s (median of the last" in status.stdout
        assert "per rank (allowed 2–64)" in status.stdout
    finally:
        cli("stop", "job")
        try:
            job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            job.kill()
