"""A live apply from DDP to FSDP, for real: `tunekit run` on 2 gloo ranks, relaunched from its
checkpoint with the model sharded, beside a job that stays replicated."""

from __future__ import annotations

import pytest
from support import rundir, start_run, wait_step

from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client

pytestmark = pytest.mark.slow

SPEC = "tunekit.plugins.sharding.tests.workloads_sharding:gpt_float64"
TO_FSDP = {"plugins": {"sharding": {"sharding": "fsdp", "reshard_after_forward": False}}}


@pytest.mark.equivalence
def test_a_relaunch_from_ddp_to_fsdp_keeps_the_step_and_the_loss_curve(tmp_path):
    steps = 40
    # Both jobs at once, in float64: the sharded job must train as the replicated one does.
    # --min-effect 1: the relaunch is watched, and may not be rolled back whatever it measures.
    plain = start_run(tmp_path, SPEC, "--steps", str(steps), "--name", "plain")
    sharded = start_run(
        tmp_path, SPEC, "--steps", str(steps), "--name", "sharded", "--min-effect", "1"
    )
    rd = rundir(tmp_path, "sharded", timeout=120)
    wait_step(rd, 4, 300)
    # Through the control socket at once (the CLI's start-up would let a tiny job finish).
    reply = client(rd).request("apply", config=TO_FSDP)
    assert reply["step"] < steps
    assert sharded.wait(timeout=600) == 0, sharded.stdout.read()
    assert plain.wait(timeout=600) == 0, plain.stdout.read()

    metrics = rd.read_metrics()
    assert [m["step"] for m in metrics] == list(range(steps))  # nothing lost or repeated
    relaunch = [e for e in rd.read_events() if e["kind"] == "relaunch"]
    assert len(relaunch) == 1
    at = relaunch[0]["step"]
    assert 4 <= at < steps
    configs = [m["config_id"] for m in metrics]
    assert len(set(configs[:at])) == 1 and len(set(configs[at:])) == 1
    assert configs[at] != configs[0]  # the steps from the relaunch on ran sharded
    reference = RunDir.find("plain", tmp_path / ".tunekit").read_metrics()
    for mine, theirs in zip(metrics, reference, strict=True):  # the same loss curve
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-9), mine["step"]
    assert rd.latest_checkpoint().is_dir()  # the sharded job's checkpoints: one shard per rank
