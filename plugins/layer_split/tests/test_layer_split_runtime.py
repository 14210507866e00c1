"""The executor on 2 real gloo ranks: a plan trains to the single-process parameters."""

from __future__ import annotations

import json

import pytest
import torch

from tunekit.plugins.layer_split.tests.ranks_layer_split import train_plans, train_single_process
from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close, default_dtype, run_ranks

CNN = "example:cnn"
BRANCHY = "tunekit.plugins.layer_split.tests.ranks_layer_split:branchy_workload"

# Every mechanism at once on the example CNN: sample split, spatial h and w splits with
# halos (same config on both sides of _2 -> _3: only halo rows move), channel splits of
# conv, pool and linear, an FC layer on one of the two ranks, and re-splits between them.
CNN_PLAN = {
    "_0": "n2",
    "_2": "h2",
    "_3": "h2",
    "_5": "c2",
    "_6": "w2",
    "_8": "c2",
    "_10": "c2",
    "_12": "1",
    "_14": "n2",
    "output": "n2",
}
# Concat of three towers, a residual add, a ReLU layer of its own, functional avg/max
# pools, BN (channel split: exact statistics), an adaptive pool split spatially, the loss
# on one rank.
BRANCHY_PLAN = {
    "stem": "c2",
    "a": "1",
    "b1": "h2",
    "b2": "c2",
    "avg_pool2d": "c2",
    "pool_conv": "h2",
    "cat": "c2",
    "mix": "h2",
    "act": "n2",
    "res": "n2",
    "add": "w2",
    "max_pool2d": "n2",
    "head": "w2",
    "fc": "c2",
    "output": "1",
}


CASES = [
    ("mixed plan, example CNN", CNN, json.dumps(CNN_PLAN), 3),
    ("mixed plan, branchy DAG", BRANCHY, json.dumps(BRANCHY_PLAN), 2),
    ("named plan owt, example CNN", CNN, "owt", 2),
]


@pytest.mark.slow
@pytest.mark.equivalence
def test_plans_train_like_one_process():
    """All cases in one pair of processes (spawning ranks is the slow part).

    In float64: a split layer sums its gradients in another order than one
    process, which float32 cannot bound tightly on every CPU."""
    f64 = torch.float64
    results = run_ranks(train_plans, 2, ([c[1:] for c in CASES],), timeout_s=600, dtype=f64)
    for i, (what, spec, _plan, steps) in enumerate(CASES):
        ranks = [results[0][i], results[1][i]]
        with default_dtype(f64):
            ref = train_single_process(spec, 2, steps)
        for r in ranks:
            assert_states_close(r["params"], ref["params"], what)
        for name in ref["params"]:
            # Bitwise the same on both ranks: one all-reduce gives everyone the same update.
            assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), (
                f"{what}: {name}"
            )
        assert ranks[0]["losses"] == pytest.approx(ref["losses"], rel=EQUIVALENCE_RTOL), what
        assert ranks[0]["losses"] == ranks[1]["losses"], what
