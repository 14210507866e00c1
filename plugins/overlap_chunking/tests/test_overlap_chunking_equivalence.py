"""two_chunk (f = 0 and f > 0) and live switches end where plain DDP ends, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from tunekit.plugins.overlap_chunking.tests.ranks_overlap_chunking import train_many
from tunekit.testing import run_ranks

pytestmark = pytest.mark.slow

TWO_CHUNK = {"mode": "two_chunk"}


def _near(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Equal up to float summation order: within ``rel`` of the tensor's own scale."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool((a - b).abs().max() <= rel * max(a.abs().max().item(), 1e-12))


def _close(a: dict, b: dict, what: str, rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert _near(a[name], b[name], rel), f"{what}: {name} differs"


def _optimizer_close(a: dict, b: dict, what: str) -> None:
    assert a["state"].keys() == b["state"].keys(), (
        f"{what}: optimizer state covers other parameters"
    )
    for index, state in a["state"].items():
        for key, value in state.items():
            other = b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert _near(value, other, 1e-5), f"{what}: state {index}.{key}"
            else:
                assert value == other, f"{what}: state {index}.{key}"


def _check_against_ddp(results: list[dict], steps: int) -> None:
    for rank_result in results:
        ddp = rank_result["ddp"]
        for name, res in rank_result.items():
            assert len(res["steps"]) == steps
            _close(res["params"], ddp["params"], name)
            _close(res["buffers"], ddp["buffers"], name)
            _optimizer_close(res["optimizer"], ddp["optimizer"], name)
            assert res["requires_grad"], f"{name}: parameters left without requires_grad"
    # Both ranks hold the same parameters.
    for name in results[0]:
        _close(results[0][name]["params"], results[1][name]["params"], f"{name} rank 0 vs 1", rel=0)


def test_cnn_two_chunk_and_live_switches_match_ddp():
    # Few steps: float summation order differs once a replicated FC layer sums
    # its gradient over the gathered batch, and after more steps such tiny
    # differences can flip a max-pool choice and grow past any tight tolerance.
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
    results = run_ranks(train_many, 2, ("example:cnn", steps, schedules))
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
    results = run_ranks(train_many, 2, ("mlp", steps, schedules))
    _check_against_ddp(results, steps)

    schedules = {
        "ddp": [],
        "f0": [(0, {**TWO_CHUNK, "k": 4, "f": 0})],
        "f2": [(0, {**TWO_CHUNK, "k": 4, "f": 2})],
    }
    results = run_ranks(train_many, 2, ("adam_cnn", 4, schedules))
    _check_against_ddp(results, 4)
