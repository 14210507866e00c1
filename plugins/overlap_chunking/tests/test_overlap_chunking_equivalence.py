"""two_chunk (f = 0 and f > 0) and live switches end where plain DDP ends, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tunekit.plugins.overlap_chunking.tests.ranks_overlap_chunking import train_many
from tunekit.testing import assert_states_close, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]

TWO_CHUNK = {"mode": "two_chunk"}
# In float64: two_chunk sums a replicated FC layer's gradient over the gathered
# batch, in another order than DDP's all-reduce, which float32 cannot bound
# tightly on every CPU (see tunekit.testing.EQUIVALENCE_RTOL).
F64 = torch.float64


def _check_against_ddp(results: list[dict], steps: int) -> None:
    for rank_result in results:
        ddp = rank_result["ddp"]
        for name, res in rank_result.items():
            assert len(res["steps"]) == steps
            assert_states_close(res["params"], ddp["params"], f"{name} parameters")
            assert_states_close(res["buffers"], ddp["buffers"], f"{name} buffers")
            assert_states_close(
                res["optimizer"]["state"], ddp["optimizer"]["state"], f"{name} optimizer"
            )
            assert res["requires_grad"], f"{name}: parameters left without requires_grad"
    # Both ranks hold bitwise the same parameters: every update is computed from
    # the same reduced values by the same kernels.
    for name in results[0]:
        a, b = results[0][name]["params"], results[1][name]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a), f"{name}: rank 0 vs 1"


def test_cnn_two_chunk_and_live_switches_match_ddp():
    steps = 5
    schedules = {
        "ddp": [],
        "f0": [(0, {**TWO_CHUNK, "k": 3, "f": 0})],
        "f2": [(0, {**TWO_CHUNK, "k": 5, "f": 2})],
        "pieces": [(0, {"k": 5, "f": 1, "piece_bytes": 64 * 1024})],  # chunk 1: ~70 all-reduces
        "live": [
            (1, {**TWO_CHUNK, "k": 3, "f": 1}),
            (
                2,
                {
                    "mode": "ddp_buckets",
                    "bucket_cap_mb": 0.25,
                    "first_bucket_mb": 0.25,
                    "gradient_as_bucket_view": True,
                    "static_graph": True,
                },
            ),
            (3, {**TWO_CHUNK, "k": 7, "f": 3}),
            (4, None),
        ],
    }
    results = run_ranks(train_many, 2, ("example:cnn", steps, schedules), dtype=F64)
    _check_against_ddp(results, steps)

    steps_f2 = results[0]["f2"]["steps"]
    # Step 0 reduces the two chunks; from step 1 on the FC gathers posted in the
    # previous step complete too: 2f + 2 communications per iteration.
    assert sorted(steps_f2[0]["comms"]) == ["chunk1", "chunk2"]
    for rec in steps_f2[1:]:
        assert len(rec["comms"]) == 2 * 2 + 2
        assert sum(c.startswith("gather_") for c in rec["comms"]) == 4
        assert 0.0 <= rec["R"] <= 100.0
        for own, blocked in rec["timings"]:
            assert own >= 0 and blocked >= 0
    assert all(len(r["comms"]) == 2 for r in results[0]["f0"]["steps"])
    # The live job reports which strategy ran each step, and R for the measured ones.
    live = [r["sync"] for r in results[0]["live"]["steps"]]
    assert live == ["ddp", "two_chunk", "ddp", "two_chunk", "ddp"]
    assert results[0]["live"]["steps"][2]["R"] is not None  # the plugin's DDP is measured
    assert results[0]["live"]["steps"][4]["R"] is None  # the baseline's DDP is not


def test_mlp_with_replicated_first_layer_batchnorm_and_adam_match_ddp():
    steps = 6
    schedules = {
        "ddp": [],
        "f3": [(0, {**TWO_CHUNK, "k": 1, "f": 3})],  # every layer's weight gradient replicated
        "f1": [(0, {**TWO_CHUNK, "k": 2, "f": 1}), (3, {**TWO_CHUNK, "k": 3, "f": 2})],
    }
    results = run_ranks(train_many, 2, ("mlp", steps, schedules), dtype=F64)
    _check_against_ddp(results, steps)

    schedules = {
        "ddp": [],
        "f0": [(0, {**TWO_CHUNK, "k": 4, "f": 0})],
        "f2": [(0, {**TWO_CHUNK, "k": 4, "f": 2})],
    }
    results = run_ranks(train_many, 2, ("adam_cnn", 4, schedules), dtype=F64)
    _check_against_ddp(results, 4)
