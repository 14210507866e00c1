"""Workloads with one training feature on each, for the tuners' equivalence tests
(``tests/integration/test_training_features_tuners.py``).

``mlp_<variant>``: a three-layer MLP (fx-traceable, no batch norm: DDP then trains
exactly like one process on the global batch). Variants: ``accum`` (2 micro-batches),
``sched`` (a warm-up LambdaLR), ``clip`` (global norm 0.05: every step clips),
``all`` (the three at once), ``bf16`` / ``fp16`` (autocast; fp16 with a GradScaler),
``plain`` (none). ``mlp_data_accum``: 4 micro-batches of 4 from a map-style dataset,
with a batch range (batch_ps_sizing's trade of micro-batches for accumulation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tunekit.workload import Workload

CLIP = 0.05
"""Far below these models' gradient norms (~0.3-1): every step clips."""

# fx node -> model-parallel device for the hybrid: l0 on 0, l1 on 1, l2 and the loss on 0.
HYBRID_PLACEMENT = {"l0": 0, "relu": 0, "l1": 1, "relu_1": 1, "l2": 0}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(12, 32), nn.Linear(32, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.l2(F.relu(self.l1(F.relu(self.l0(x)))))


class Tied(nn.Module):
    """A GPT-style tied head: ``head.weight`` is ``l0.weight`` (one parameter, two names)."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1 = nn.Linear(12, 12), nn.Linear(12, 12)
        self.head = nn.Linear(12, 12, bias=False)
        self.head.weight = self.l0.weight

    def forward(self, x):
        return self.head(F.relu(self.l1(F.relu(self.l0(x)))))


def tied_all() -> Workload:
    """:class:`Tied` with accumulation, the scheduler and clipping."""
    return Workload(name="tied_all", model=Tied, make_batch=_batch, batch_size=8, lr=0.1, lr_scaling="none",
                    **VARIANTS["all"])  # fmt: skip


def _batch(n: int, gen: torch.Generator):
    x = torch.randn(n, 12, generator=gen)
    return x, x[:, :3].argmax(dim=1)


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


VARIANTS = {
    "plain": {},
    "accum": {"accumulation": 2},
    "sched": {"scheduler": _warmup},
    "clip": {"clip_grad_norm": CLIP},
    "all": {"accumulation": 2, "scheduler": _warmup, "clip_grad_norm": CLIP},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
}


def mlp(variant: str) -> Workload:
    return Workload(
        name=f"mlp_{variant}",
        model=MLP,
        make_batch=_batch,
        batch_size=8,
        lr=0.1,
        lr_scaling="none",
        **VARIANTS[variant],
    )


for _v in VARIANTS:
    globals()[f"mlp_{_v}"] = lambda _v=_v: mlp(_v)


class Points(torch.utils.data.Dataset):
    """256 fixed samples of :func:`_batch`'s task, indexed (a map-style dataset)."""

    def __init__(self):
        self.x, self.y = _batch(256, torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def mlp_data_accum() -> Workload:
    return Workload(name="mlp_data_accum", model=MLP, dataset=Points, batch_size=4, accumulation=4,
                    batch_range=(2, 64), lr=0.1, lr_scaling="none")  # fmt: skip
