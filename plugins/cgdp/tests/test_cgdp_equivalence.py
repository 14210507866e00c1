"""CGDP on 2 real gloo ranks: the same parameters as DDP, the same decisions on every rank."""

from __future__ import annotations

import pytest
import torch

from tunekit.plugins.cgdp.tests.ranks_cgdp import live_switch, run_search, train_params_many
from tunekit.testing import assert_states_close, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]

TINY = "tunekit.plugins.cgdp.tests.workloads_cgdp:tiny_bn"
DEEP = "tunekit.plugins.cgdp.tests.workloads_cgdp:deep_narrow"
# In float64: CGDP sums each chunk on the host in another order than DDP's
# buckets, which float32 cannot bound tightly on every CPU.
F64 = torch.float64


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    """The same mathematics: equal up to float64 summation order."""
    assert_states_close(a, b, what)


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    """Replicas: the same reduced values through the same kernels, bitwise."""
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), what


def test_same_parameters_as_ddp_for_several_chunk_sizes():
    jobs = [
        (
            TINY,
            [
                {"chunk_size": 1},
                {"chunk_size": 2},
                {"chunk_size": 3},
                {"chunk_size": 50},
                {"chunk_size": 2, "offload_optimizer": True},
            ],
            4,
        ),
        (DEEP, [{"chunk_size": 1}, {"chunk_size": 5}, {"chunk_size": 23}], 3),
        (  # chunks of whole transformer blocks; AdamW, the schedule and clipping at 1.0
            "tunekit.testing:tiny_gpt_workload",
            [{"chunk_size": 1, "chunk_by": "blocks"}, {"chunk_size": 2, "chunk_by": "blocks"}],
            3,
        ),
    ]
    ranks = run_ranks(train_params_many, 2, (jobs,), dtype=F64)
    for job, (_spec, configs, _steps) in enumerate(jobs):
        r0, r1 = ranks[0][job], ranks[1][job]
        assert_identical(r0["ddp"], r1["ddp"], "DDP replicas")
        runs = [k for k in r0 if k.startswith("cgdp") and ":" not in k]
        assert len(runs) == len(configs)
        for label in runs:
            assert_same(r0[label], r0["ddp"], f"{label} vs DDP")
            assert_identical(r0[label], r1[label], f"{label} replicas")
            comm = r0[label + ":comm"]
            assert comm and all(c["own_s"] >= 0 and c["blocked_s"] >= 0 for c in comm)
            assert r0[label + ":overlap_R"] is not None
    # chunk layout decides the number of communications per step (24 layers)
    deep = ranks[0][1]
    assert len(deep["cgdp_chunk_size=1:comm"]) == 24
    assert len(deep["cgdp_chunk_size=5:comm"]) == 4 + 4  # 4 chunks of 5, then 4 singletons
    assert len(deep["cgdp_chunk_size=23:comm"]) == 2
    assert (
        ranks[0][0]["cgdp_chunk_size=2_offload_optimizer=True:memory"]["host_optimizer_state_bytes"]
        > 0
    )


@pytest.mark.timed  # the search times steps: it must not share the machine
def test_in_job_search_decides_the_same_on_every_rank():
    knobs = {"search_step": 2, "search_range": 1, "search_interval": 3}
    r0, r1 = run_ranks(run_search, 2, (DEEP, knobs, 60))  # float32: no reference to match
    assert (
        r0["knobs"] == r1["knobs"]
        and r0["installed"] == r1["installed"] == r0["knobs"]["chunk_size"]
    )
    assert r0["trace"] == r1["trace"] and r0["trace"][-1]["action"] == "stop"
    assert r0["steps"] == r1["steps"] == 3 * len(r0["trace"])
    assert_identical(r0["params"], r1["params"], "replicas after the search")


def test_live_switches_between_ddp_and_cgdp_keep_training_exact():
    r0, r1 = run_ranks(live_switch, 2, (TINY, 3), dtype=F64)
    assert_same(r0["switched"], r0["reference"], "switched vs uninterrupted DDP")
    assert_identical(r0["switched"], r1["switched"], "replicas")
