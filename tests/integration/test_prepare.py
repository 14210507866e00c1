"""tunekit.prepare in a user's own torchrun script trains step by step like `tunekit run`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from support import DATA, WORKLOADS, run_cli

from tunekit.runtime.rundir import RunDir
from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]

SPEC = f"{WORKLOADS}:cnn_float64"  # float64: the two runs may split their kernels differently
STEPS = 6


def run_user_script(tmp_path, config_path) -> dict:
    out = tmp_path / "user.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(DATA / "prepare_script.py"),
            SPEC,
            str(config_path),
            str(STEPS),
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def run_tunekit(tmp_path, config_path) -> dict:
    res = run_cli(
        "run",
        SPEC,
        "--steps",
        str(STEPS),
        "--config",
        str(config_path),
        "--name",
        "job",
        "--checkpoint-every",
        str(STEPS),
        cwd=tmp_path,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rd = RunDir.find("job", tmp_path / ".tunekit")
    deadline = time.monotonic() + 60
    while rd.read_status().get("status") != "finished" and time.monotonic() < deadline:
        time.sleep(0.2)
    params = RunDir.load_checkpoint(rd.latest_checkpoint())["session"]["model"]
    return {"losses": [m["loss"] for m in rd.read_metrics()], "params": dict(params)}


def test_a_user_script_with_prepare_trains_like_tunekit_run(tmp_path):
    # One config that exercises both: a reducer with deferred FC updates (math-preserving: so
    # also check that it really ran) and a batch change (the batch tells the user's loader).
    config = {
        "overlap_chunking": {"mode": "two_chunk", "k": 3, "f": 1},
        "batch_ps_sizing": {"batch_size": 16},
    }
    config_path = tmp_path / "best_config.json"
    config_path.write_text(json.dumps({"plugins": config}))
    user = run_user_script(tmp_path, config_path)
    assert (user["strategy"], user["batch"]) == ("two_chunk", 16)
    job = run_tunekit(tmp_path, config_path)
    assert len(job["losses"]) == len(user["losses"]) == STEPS
    assert user["losses"] == pytest.approx(job["losses"], rel=EQUIVALENCE_RTOL)
    assert_states_close(user["params"], job["params"], "prepare() vs tunekit run")
