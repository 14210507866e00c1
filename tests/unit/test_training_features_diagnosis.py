"""Issue 17, item 2: a training feature a tuner (or one of its configs) cannot honour is
said by its diagnosis ("does not apply: <feature> needs ...") and left out of its plan;
the study goes on with the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunekit.plugins.cgdp.plugin import Cgdp
from tunekit.plugins.hybrid_mp.plugin import HybridMp
from tunekit.plugins.layer_split.plugin import LayerSplit
from tunekit.plugins.overlap_chunking.plugin import OverlapChunking
from tunekit.runtime.sync import declined_features
from tunekit.testing import synthetic_observation
from tunekit.workload import load_workload

FEATURES = Path(__file__).parents[1] / "data" / "feature_workloads.py"


def obs(variant: str):
    return synthetic_observation(load_workload(f"{FEATURES}:mlp_{variant}"))


def test_the_line_names_each_feature_and_what_it_needs():
    line = declined_features(
        frozenset({"clipping", "scheduler", "amp"}),
        frozenset({"amp"}),
        {"clipping": "the whole gradient"},
    )
    assert (
        line
        == "does not apply: clipping needs the whole gradient; scheduler needs what this tuner does not do"
    )
    assert declined_features(frozenset({"amp"}), frozenset({"amp"}), {}) is None


@pytest.mark.parametrize(
    ("variant", "feature"), [("bf16", "amp"), ("fp16", "amp"), ("fp16", "grad_scaler")]
)
def test_layer_split_declines_what_its_executor_cannot_honour(variant, feature):
    d = LayerSplit().diagnose(obs(variant))
    assert not d.applies
    assert d.summary.startswith("does not apply:") and f"{feature} needs" in d.summary


@pytest.mark.parametrize("variant", ["accum", "sched", "clip", "all"])
def test_layer_split_features_it_honours_are_not_declined(variant):
    assert "does not apply" not in LayerSplit().diagnose(obs(variant)).summary


def test_hybrid_mp_declines_no_feature():
    for variant in ("all", "bf16", "fp16"):
        assert "does not apply" not in HybridMp().diagnose(obs(variant)).summary


def test_cgdp_says_offload_declines_the_scaler_and_never_plans_it():
    o = obs("fp16")
    d = Cgdp().diagnose(o)
    assert "offload_optimizer does not apply: grad_scaler needs" in d.summary
    assert not any(c.knobs.get("offload_optimizer") for c in Cgdp().plan(o, 20))
    assert "does not apply" not in Cgdp().diagnose(obs("all")).summary


@pytest.mark.parametrize("variant", ["accum", "sched", "clip", "bf16", "fp16"])
def test_overlap_chunking_plans_no_replicated_layers_under_a_feature(variant):
    o = obs(variant)
    tuner = OverlapChunking()
    d = tuner.diagnose(o)
    assert d.applies
    plan = tuner.plan(o, 50)
    assert plan and all(not (c.knobs.get("mode") == "two_chunk" and c.knobs.get("f")) for c in plan)
    plain = tuner.plan(obs("plain"), 50)
    if any(c.knobs.get("mode") == "two_chunk" and c.knobs.get("f") for c in plain):
        assert "two_chunk with f > 0 does not apply:" in d.summary


# -- issue 30: sharded and checkpointed jobs ---------------------------------------------------

LAYOUTS = Path(__file__).parents[1] / "data" / "sharded_workloads.py"


def sharded_obs(checkpointed_only: bool = False):
    from dataclasses import replace

    w = load_workload(f"{LAYOUTS}:tiny_sharded")
    if checkpointed_only:
        w = replace(w, sharding="ddp")
    return synthetic_observation(w)


@pytest.mark.parametrize("tuner", [OverlapChunking, Cgdp])
def test_gradient_reducers_say_a_sharded_job_reduces_its_own_and_plan_nothing(tuner):
    o = sharded_obs()
    d = tuner().diagnose(o)
    assert not d.applies and "the job is sharded (FSDP)" in d.summary
    assert tuner().plan(o, 20) == []


@pytest.mark.parametrize("tuner", [LayerSplit, HybridMp])
def test_placements_decline_sharded_and_checkpointed_jobs_with_why(tuner):
    d = tuner().diagnose(sharded_obs())
    assert not d.applies and "sharded needs whole parameters" in d.summary
    assert "checkpointed needs the blocks' checkpointed forward" in d.summary
    only = tuner().diagnose(sharded_obs(checkpointed_only=True))
    assert "sharded needs" not in only.summary and "checkpointed needs" in only.summary


def test_overlap_chunking_applies_to_a_checkpointed_ddp_job_without_replicated_layers():
    o = sharded_obs(checkpointed_only=True)
    tuner = OverlapChunking()
    assert tuner.diagnose(o).applies
    assert all(
        not (c.knobs.get("mode") == "two_chunk" and c.knobs.get("f")) for c in tuner.plan(o, 50)
    )
