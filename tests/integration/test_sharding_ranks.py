"""Sharded and checkpointed training on 2 real gloo ranks, in float64: FSDP (both reshard
settings, with and without CPU offload) x checkpointing (full, every k-th) x accumulation
trains like the DDP baseline; checkpointing alone is bit-exact; sharded checkpoints resume,
reshard across world sizes and layouts, and refuse another model in one line."""

from __future__ import annotations

import pytest
import torch
from sharding_ranks import FSDP_LAYOUTS, checkpoints, equivalence, full_state

from tunekit.layout import Layout
from tunekit.runtime.checkpoint import CheckpointMismatch, load_sharded
from tunekit.runtime.dist import single_rank_group
from tunekit.runtime.session import Session
from tunekit.testing import assert_states_close, default_dtype, run_ranks, tiny_gpt_workload

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]


@pytest.fixture(scope="module")
def trained():
    return run_ranks(equivalence, 2, dtype=torch.float64)


@pytest.mark.parametrize("acc", [1, 2])
@pytest.mark.parametrize("layout", FSDP_LAYOUTS, ids=lambda lay: lay.describe())
def test_fsdp_with_checkpointing_trains_like_ddp(trained, layout, acc):
    for rank in (0, 1):  # each rank's losses are of its own batches
        base = trained[rank][f"ddp/acc{acc}"]
        got = trained[rank][f"{layout.describe()}/acc{acc}"]
        assert got["sync"] == "fsdp"
        assert_states_close(got["params"], base["params"], f"{layout.describe()}, rank {rank}")
        assert_states_close(got["losses"].double(), base["losses"].double(), "losses")


@pytest.mark.parametrize("acc", [1, 2])
def test_checkpointing_alone_is_bit_exact_on_two_ranks(trained, acc):
    base, ckpt = trained[0][f"ddp/acc{acc}"], trained[0][f"ddp+ckpt/acc{acc}"]
    for name, value in base["params"].items():
        assert torch.equal(ckpt["params"][name], value), name
    assert torch.equal(ckpt["losses"], base["losses"])


@pytest.mark.parametrize("how", ["two_chunk", "cgdp"])
def test_the_reducers_that_claim_checkpointing_train_like_ddp_with_it(trained, how):
    for rank in (0, 1):
        got, base = trained[rank][f"{how}+ckpt"], trained[rank]["ddp/acc1"]
        assert got["sync"] == how
        assert_states_close(got["params"], base["params"], f"{how} + checkpointing, rank {rank}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp") / "step-00000002.dcp"
    return folder, run_ranks(checkpoints, 2, args=(str(folder),), dtype=torch.float64)


def test_a_sharded_checkpoint_resumes_exactly_and_reshards_into_ddp(saved):
    _, ranks = saved
    out = ranks[0]
    for name, value in out["continued"].items():  # same layout: the very same arithmetic
        assert torch.equal(out["resumed_sharded"][name], value), name
    assert_states_close(out["resumed_replicated"], out["continued"], "FSDP checkpoint into DDP")
    assert_states_close(out["ddp_into_sharded"], out["ddp_continued"], "DDP state into FSDP")


def test_a_two_rank_checkpoint_loads_on_one_rank_and_another_model_is_refused(saved):
    folder, ranks = saved
    with default_dtype(torch.float64), single_rank_group():
        one = Session(tiny_gpt_workload(), layout=Layout(sharding="fsdp"))  # 2 shards -> 1
        load_sharded(one, folder)
        assert one.step == ranks[0]["saved_step"]
        assert_states_close(full_state(one), ranks[0]["saved"], "resharded from 2 ranks to 1")
        from dataclasses import replace

        from tunekit.examples.transformers import GPTModel
        from tunekit.testing.fixtures import TINY_GPT

        wider = replace(tiny_gpt_workload(), model=lambda: GPTModel(**{**TINY_GPT, "blocks": 3}))
        other = Session(wider, layout=Layout(sharding="fsdp"))
        before = full_state(other)
        with pytest.raises(CheckpointMismatch) as err:
            load_sharded(other, folder)
        assert "does not fit this job: it has no model.blocks.2." in str(err.value)
        assert "\n" not in str(err.value)
        for name, value in before.items():  # refused before anything was loaded
            assert torch.equal(full_state(other)[name], value), name
