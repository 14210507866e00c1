"""Rank entry points for :func:`tunekit.testing.run_ranks` (tests and benchmarks).

They live in the package (not in a test file) because every rank is a fresh
interpreter that must import the function by name.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from tunekit.runtime.data import BatchSource
from tunekit.runtime.session import Session
from tunekit.testing import (  # noqa: F401  (toy transformers, named here for workload specs)
    TINY_GPT,
    TINY_VIT,
    tiny_gpt_workload,
    tiny_vit_workload,
)
from tunekit.workload import load_workload


def train_plan(rank: int, world: int, spec: str, plan: str, steps: int, warmup: int = 0) -> dict:
    """Train ``steps`` steps of workload ``spec`` under the layer_split ``plan`` knob value.

    Returns this rank's parameters after training, the losses, and the
    per-step wall times of the steps after ``warmup``.
    """
    from tunekit.plugins.layer_split.plugin import LayerSplit

    workload = load_workload(spec)
    session = Session(workload, rank=rank, world_size=world, group=dist.group.WORLD)
    tuner = LayerSplit()
    tuner.apply(session, tuner.validate({"plan": plan}))
    losses, times = [], []
    for i in range(steps):
        dist.barrier()
        rec = session.train_step()
        losses.append(rec.loss)
        if i >= warmup:
            times.append(rec.step_s)
    dist.barrier()
    # Every rank's slowest step decides the step time: take the max over ranks per step.
    t = torch.tensor(times, dtype=torch.float64)
    if times:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    params = {k: v.detach().clone() for k, v in session.model.state_dict().items()}
    session.close()
    return {
        "params": params,
        "losses": losses,
        "step_s": t.tolist(),
        "median_s": statistics.median(t.tolist()) if times else None,
    }


def train_plans(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """:func:`train_plan` for several ``(spec, plan, steps[, warmup])`` cases in one set of
    processes; the plan ``"ddp"`` runs the untuned baseline (:func:`train_ddp`) instead."""
    out = []
    for spec, plan, steps, *rest in cases:
        warmup = rest[0] if rest else 0
        if plan == "ddp":
            out.append(train_ddp(rank, world, spec, steps, warmup))
        else:
            out.append(train_plan(rank, world, spec, plan, steps, warmup))
    return out


def train_ddp(rank: int, world: int, spec: str, steps: int, warmup: int = 0) -> dict:
    """The untuned baseline (the session's default DDP) for comparison."""
    workload = load_workload(spec)
    session = Session(workload, rank=rank, world_size=world, group=dist.group.WORLD)
    times = []
    losses = []
    for i in range(steps):
        dist.barrier()
        rec = session.train_step()
        losses.append(rec.loss)
        if i >= warmup:
            times.append(rec.step_s)
    t = torch.tensor(times, dtype=torch.float64)
    if times:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    params = {k: v.detach().clone() for k, v in session.model.state_dict().items()}
    session.close()
    return {
        "params": params,
        "losses": losses,
        "step_s": t.tolist(),
        "median_s": statistics.median(t.tolist()) if times else None,
    }


def train_single_process(spec: str, world: int, steps: int) -> dict:
    """Single-process training on the same global batches a ``world``-rank run sees."""
    workload = load_workload(spec)
    torch.manual_seed(workload.seed)
    model = workload.model()
    optimizer = workload.optimizer(model.parameters(), workload.lr)
    data = BatchSource(
        workload,
        rank=0,
        world_size=world,
        device=torch.device("cpu"),
        batch_size=workload.batch_size,
    )
    losses = []
    for step in range(steps):
        inputs, targets = data.global_batch(step)
        loss = workload.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": losses,
    }


# -- a small branchy model for the executor's DAG paths ------------------------------------


class _Branchy(torch.nn.Module):
    """Inception-like: a stem, three towers joined by concat, a residual add, BN, pools."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 1)
        self.b1 = nn.Conv2d(8, 4, 1)
        self.b2 = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool_conv = nn.Conv2d(8, 4, 1)
        self.mix = nn.Conv2d(20, 8, 3, stride=2, padding=1)
        self.res = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        import torch.nn.functional as F

        x = F.relu(self.stem(x))
        a = F.relu(self.a(x))
        b = F.relu(self.bn(self.b2(F.relu(self.b1(x)))))
        p = self.pool_conv(F.avg_pool2d(x, 3, 1, 1))
        y = F.relu(self.mix(torch.cat([a, b, p], 1)))
        y = F.max_pool2d(self.act(y) + self.res(y), 2)  # act: an elementwise layer of its own
        return self.fc(torch.flatten(self.head(y), 1))


def branchy_workload():
    """A workload around :class:`_Branchy` (8 x 3 x 16 x 16 images per rank)."""
    from tunekit.workload import Workload

    def make_batch(n, gen):
        x = torch.randn(n, 3, 16, 16, generator=gen)
        return x, torch.randint(10, (n,), generator=gen)

    return Workload(name="branchy", model=_Branchy, make_batch=make_batch, batch_size=8, lr=0.05)
