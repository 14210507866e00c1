"""best_config.md's ``tunekit.prepare(...)`` call, pasted into a user's loop, trains the job
that was tuned: the same parameters, step for step, as tunekit's own session under the config.

The workload leans on everything ``prepare``'s defaults do not say: sqrt learning-rate
scaling, a warm-up scheduler, clipping, accumulation, bf16; the config changes the batch,
so the learning rate is rescaled by the workload's rule.
"""

from __future__ import annotations

import dataclasses
import json
import re

import torch
from support import DATA

from tunekit.config import TuningConfig
from tunekit.observe.workload_process import stand_in_workload, workload_facts
from tunekit.plugin_loading import available_tuners
from tunekit.report.data import snippet
from tunekit.runtime.dist import single_rank_group
from tunekit.runtime.session import Session
from tunekit.trials.launcher import LaunchOptions
from tunekit.workload import Workload, load_workload, prepare_arguments

FEATURES = DATA / "feature_workloads.py"
STEPS = 3


def tuned_workload() -> Workload:
    base = load_workload(f"{FEATURES}:mlp_all")  # accumulation 2, a LambdaLR warm-up, clipping
    return Workload(
        name="tuned",
        model=base.model,
        make_batch=base.make_batch,
        batch_size=8,
        lr=0.1,
        lr_scaling="sqrt",
        batch_range=(2, 64),
        precision="bf16",
        accumulation=base.accumulation,
        scheduler=base.scheduler,
        clip_grad_norm=base.clip_grad_norm,
    )


def test_the_pasted_prepare_call_trains_exactly_as_the_tuned_session(tmp_path):
    wl = tuned_workload()
    tuners = available_tuners()
    best = TuningConfig({"batch_ps_sizing": {"batch_size": 16}})
    config = tmp_path / "best_config.json"
    config.write_text(json.dumps(best.to_dict()))
    # As a study keeps it: the facts cross from the workload's process to tunekit's.
    training = prepare_arguments(stand_in_workload(workload_facts(wl)))
    text = snippet("job.py:workload", best, tuners, LaunchOptions(nproc=1), wl.batch_size,
                   config_path=str(config), training=training)  # fmt: skip
    code = re.search(r"```python\n(import tunekit\n.*?)```", text, re.S).group(1)
    assert "sharding=" not in code and "checkpointing=" not in code  # plain DDP's are left out

    reference = Session(wl)  # what tunekit run trains under the config
    reference.apply_config(best, tuners)
    loader = []
    for step in range(STEPS):
        micro = [reference.data.batch(step * wl.accumulation + m) for m in range(wl.accumulation)]
        loader.append(tuple(torch.cat(part) for part in zip(*micro, strict=True)))
    for _ in range(STEPS):
        reference.train_step()

    torch.manual_seed(wl.seed)  # the user's model: the same initial weights
    model = wl.model()
    optimizer = wl.optimizer(model.parameters(), wl.lr)
    names = {"model": model, "optimizer": optimizer, "loss_fn": wl.loss, "loader": loader}
    names[wl.scheduler.__name__] = wl.scheduler
    exec(code, names)  # the snippet as a user pastes it
    step = names["step"]
    assert step.batch_size == 32  # 16 per micro-batch, 2 micro-batches
    assert optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    for mine, theirs in zip(model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_the_pasted_prepare_call_lays_a_sharded_job_out_as_it_was_tuned(tmp_path):
    """A sharded, checkpointed workload's call passes its layout: without it, ``prepare``
    would train the job as plain DDP, holding the whole model on every rank."""
    wl = dataclasses.replace(
        load_workload(f"{DATA / 'sharded_workloads.py'}:tiny_sharded_no_scheduler"),
        reshard_after_forward=False,
        checkpoint_blocks=("blocks.1",),
    )
    best = TuningConfig({"batch_ps_sizing": {"batch_size": 4}})
    config = tmp_path / "best_config.json"
    config.write_text(json.dumps(best.to_dict()))
    training = prepare_arguments(stand_in_workload(workload_facts(wl)))
    assert training["layout"] == {
        "sharding": "fsdp",
        "reshard_after_forward": False,
        "checkpointing": "full",
        "checkpoint_blocks": ["blocks.1"],
    }
    text = snippet("job.py:workload", best, available_tuners(), LaunchOptions(nproc=1), wl.batch_size,
                   config_path=str(config), training=training)  # fmt: skip
    code = re.search(r"```python\n(import tunekit\n.*?)```", text, re.S).group(1)
    with single_rank_group():
        torch.manual_seed(wl.seed)
        model = wl.model()
        names = {
            "model": model,
            "optimizer": wl.optimizer(model.parameters(), wl.lr),
            "loss_fn": wl.loss,
            "loader": [wl.example_batch(4, seed=0)],  # the config's batch
        }
        exec(code, names)  # prepares, then trains a step on the loader
        session = names["step"].session
        assert session.grad_sync.name == "fsdp" and session.checkpointed == ["blocks.1"]
        assert session.layout == wl.layout()
