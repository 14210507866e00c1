"""The split into micro-batches trains as the whole step does (2 gloo ranks, float64): the
same samples per step (ranks share them differently), each update the mean gradient over
them, under DDP and FSDP."""

from __future__ import annotations

import pytest
import torch

from tunekit.plugins.sharding.tests.ranks_sharding import split_against_whole
from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.equivalence, pytest.mark.busy_ok]


def test_micro_batches_at_the_same_samples_per_step_train_as_the_whole_step():
    # A map-style dataset: the micro-batches of a step, over all ranks, are its samples.
    ranks = run_ranks(split_against_whole, 2, (3,), dtype=torch.float64)

    def mean_losses(name: str) -> list[float]:  # the global batch's loss, step by step
        return [sum(r[f"{name}_losses"][i] for r in ranks) / len(ranks) for i in range(3)]

    whole = mean_losses("whole")
    assert mean_losses("split") == pytest.approx(whole, rel=EQUIVALENCE_RTOL)
    assert mean_losses("fsdp_split") == pytest.approx(whole, rel=EQUIVALENCE_RTOL)
    for r in ranks:
        assert_states_close(r["split_params"], r["whole_params"], "split vs whole")
