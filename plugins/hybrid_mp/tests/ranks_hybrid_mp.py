"""A workload whose transfers arrive out of the order they are consumed (for the runtime tests).

Device 0 computes ``a``, device 1 ``z``, device 0 ``b``: device 0 sends ``a``
before ``b``, but device 1 reads ``b`` first, so a receiver that matched sends
in arrival order would take ``a`` for ``b`` (NCCL has no tags; the runtime
never uses them).
"""

from __future__ import annotations

import torch
from torch import nn

from tunekit.workload import Workload

# fx node -> model-parallel device, and planned start times that put l1 before l2
PLACEMENT = {"l1": 0, "l0": 1, "l2": 0, "l3": 1, "add": 1, "add_1": 1, "l4": 1, "relu": 1}
ORDER = {
    "l1": 0.0,
    "l0": 1.0,
    "l2": 2.0,
    "l3": 3.0,
    "add": 4.0,
    "add_1": 4.0,
    "l4": 5.0,
    "relu": 5.0,
}


class Crossing(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 6)
        self.l3, self.l4 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        a = self.l1(x)
        z = self.l0(x)
        b = self.l2(x)
        return torch.relu(self.l4(self.l3(b) + a + z))


def _batch(n: int, gen: torch.Generator):
    x = torch.randn(n, 8, generator=gen)
    return x, torch.randint(4, (n,), generator=gen)


def crossing() -> Workload:
    return Workload(name="crossing", model=Crossing, make_batch=_batch, batch_size=8, lr=0.1)


def plain_gpt() -> Workload:
    """The toy GPT without its schedule and clipping (the reference run steps neither;
    the training features are checked against the session in the features tests)."""
    import dataclasses

    from tunekit.testing import tiny_gpt_workload

    return dataclasses.replace(tiny_gpt_workload(), scheduler=None, clip_grad_norm=None)
