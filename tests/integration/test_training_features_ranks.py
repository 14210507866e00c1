"""Training features on 2 real gloo ranks: DDP with accumulation, a schedule and clipping
trains like one process on the global batch (float64: the same mathematics)."""

from __future__ import annotations

import pytest
import torch
from support import WORKLOADS, rank_train_params

from tunekit.runtime.data import BatchSource
from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close, default_dtype, run_ranks
from tunekit.workload import load_workload

pytestmark = [pytest.mark.slow, pytest.mark.equivalence]

SPEC = f"{WORKLOADS}:featured"


def one_process(spec: str, world: int, steps: int) -> dict:
    """Every micro-batch of every rank at once, then one clipped, scheduled update."""
    w = load_workload(spec)
    torch.manual_seed(w.seed)
    model = w.model()
    opt = w.optimizer(model.parameters(), w.lr)
    sched = w.scheduler(opt)
    data = BatchSource(
        w, rank=0, world_size=world, device=torch.device("cpu"), batch_size=w.batch_size
    )
    losses = []
    for step in range(steps):
        shards = [
            data._shard(step * w.accumulation + m, r)
            for m in range(w.accumulation)
            for r in range(world)
        ]
        x, y = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
        loss = w.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), w.clip_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "losses": losses,
    }


def test_ddp_with_accumulation_schedule_and_clipping_trains_like_one_process():
    steps = 5
    ranks = run_ranks(rank_train_params, 2, (SPEC, steps), dtype=torch.float64)
    with default_dtype(torch.float64):
        ref = one_process(SPEC, 2, steps)
    for r in ranks:
        assert_states_close(r["params"], ref["params"], "DDP vs one process")
    # Each rank's loss is the mean over its own micro-batches; their mean is the global loss.
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert mean == pytest.approx(ref["losses"], rel=EQUIVALENCE_RTOL)
