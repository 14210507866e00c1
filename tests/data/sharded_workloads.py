"""Sharded and checkpointed workloads for tests: a tiny FSDP one, and bad layouts."""

from dataclasses import replace

import torch
from torch import nn

from tunekit.testing import tiny_gpt_workload
from tunekit.workload import Workload


def tiny_sharded() -> Workload:
    """The tiny GPT, sharded with FSDP2 and every block checkpointed."""
    return replace(tiny_gpt_workload(), name="tiny_sharded", sharding="fsdp", checkpointing="full")


def missing_block() -> Workload:
    """Checkpoints a block the model does not have."""
    return replace(
        tiny_gpt_workload(), checkpointing="full", checkpoint_blocks=("blocks.0", "blocks.9")
    )


class _NoParameters(nn.Module):
    def forward(self, x):
        return x.float().unsqueeze(-1).repeat(1, 1, 2)


def nothing_to_shard() -> Workload:
    """FSDP on a model with no parameters."""
    return replace(tiny_gpt_workload(), model=_NoParameters, sharding="fsdp")


def tiny_sharded_no_scheduler() -> Workload:
    """The tiny GPT, sharded, trained with plain SGD (for prepare())."""
    return replace(tiny_sharded(), scheduler=None, optimizer=lambda p, lr: torch.optim.SGD(p, lr))
