"""Mixed precision, gradient accumulation, LR schedules and clipping, as Workload fields.

The claim that needs exactness is checked in float64 (tunekit.testing.EQUIVALENCE_RTOL):
accumulation is the same mathematics as one larger batch.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from tunekit.errors import ConfigError, WorkloadError
from tunekit.runtime.session import Session
from tunekit.runtime.sync import GradSync
from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close, default_dtype
from tunekit.workload import Workload


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


def _batch(n: int, gen: torch.Generator):
    x = torch.randn(n, 12, generator=gen)
    return x, x[:, :3].argmax(dim=1)


def workload(**kw) -> Workload:
    base = dict(
        name="mlp", model=_model, make_batch=_batch, batch_size=8, lr=0.1, batch_range=(2, 64)
    )
    return Workload(**{**base, **kw})


def params(session: Session) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in session.model.named_parameters()}


# -- bad input: one line naming the field and the doc ----------------------------------------


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"accumulation": 0}, "accumulation"),
        ({"accumulation": 2.5}, "accumulation"),
        ({"precision": "fp8"}, "precision"),
        ({"precision": "fp16", "grad_scaler": False}, "grad_scaler"),
        ({"grad_scaler": True}, "grad_scaler"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm"),
        ({"scheduler": "cosine"}, "scheduler"),
        ({"batch_size": "32"}, "batch_size"),
        ({"loss": 3}, "loss"),
    ],
)
def test_a_bad_field_is_named_with_the_doc(kw, field):
    with pytest.raises(WorkloadError) as err:
        workload(**kw)
    text = str(err.value)
    assert f": {field} " in text and "see docs/workloads.md" in text and "\n" not in text


def test_features_in_use():
    assert workload().features() == frozenset()
    w = workload(
        precision="fp16",
        accumulation=2,
        clip_grad_norm=1.0,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    assert w.features() == {"amp", "grad_scaler", "accumulation", "scheduler", "clipping"}


# -- accumulation ---------------------------------------------------------------------------------


def test_accumulating_micro_batches_is_one_larger_batch():
    with default_dtype(torch.float64):
        acc = Session(workload(accumulation=4, batch_size=8))
        big = Session(workload(batch_size=32))
        assert acc.global_batch == big.global_batch == 32 and acc.lr == big.lr
        for _ in range(3):
            # The same 32 samples per step: micro-batch m of step s is data index s*4+m.
            xs, ys = zip(*(acc.data.batch(acc.micro_step(m)) for m in range(4)), strict=True)
            x, y = torch.cat(xs), torch.cat(ys)
            loss_acc = acc.train_step().loss
            out = big.workload.loss(big.model(x), y)
            out.backward()
            big.optimizer_step()
            big.optimizer.zero_grad(set_to_none=True)
            big.step += 1
            assert loss_acc == pytest.approx(float(out.detach()), rel=EQUIVALENCE_RTOL)
        assert_states_close(params(acc), params(big), "accumulated vs one batch")


def test_accumulation_changes_follow_the_learning_rate_rule():
    s = Session(workload(lr_scaling="linear"))
    s.set_accumulation(4)
    assert s.global_batch == 32 and s.lr == pytest.approx(0.4)
    s.reset()
    assert s.accumulation == 1 and s.lr == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="accumulation"):
        s.set_accumulation(0)


# -- schedules ------------------------------------------------------------------------------------


def warmup_then_halve(opt):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / 3) * 0.5 ** (step // 5)
    )


def test_the_scheduler_steps_once_per_optimizer_step_and_follows_batch_changes():
    s = Session(workload(scheduler=warmup_then_halve, accumulation=2))
    lrs = []
    for _ in range(6):
        s.train_step()
        lrs.append(s.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx(
        [0.1 * min(1, (k + 2) / 3) * 0.5 ** ((k + 1) // 5) for k in range(6)]
    )
    s.set_batch_size(16)  # linear rule: twice the base rate, same point on the schedule
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(2 * lrs[-1])
    s.train_step()
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * 0.5 ** (7 // 5))


def test_checkpoints_carry_the_schedule_and_the_loss_scale():
    w = workload(scheduler=warmup_then_halve, precision="fp16", clip_grad_norm=1.0)
    a = Session(w)
    for _ in range(4):
        a.train_step()
    saved = io.BytesIO()  # through bytes, as a checkpoint file: optimizer.load_state_dict
    torch.save(a.state_dict(), saved)  # would otherwise share a's momentum tensors with b
    saved.seek(0)
    b = Session(w)
    b.load_state_dict(torch.load(saved, weights_only=False))
    assert b.scheduler.last_epoch == 4 and b.scaler.get_scale() == a.scaler.get_scale()
    for _ in range(3):
        assert a.train_step().loss == b.train_step().loss  # the same kernels in the same order
    assert all(
        torch.equal(x, y) for x, y in zip(params(a).values(), params(b).values(), strict=True)
    )


# -- clipping and mixed precision -----------------------------------------------------------------


def test_clipping_bounds_the_update_by_the_global_norm():
    with default_dtype(torch.float64):
        clipped = Session(
            workload(clip_grad_norm=1e-3, optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr))
        )
        before = params(clipped)
        clipped.train_step()
        moved = math.sqrt(sum(float((params(clipped)[n] - before[n]).pow(2).sum()) for n in before))
    assert moved == pytest.approx(
        0.1 * 1e-3, rel=1e-5
    )  # lr x the clipped norm (torch adds 1e-6 to the norm)


def test_bf16_autocast_trains_with_fp32_parameters():
    s = Session(workload(precision="bf16"))
    with s.autocast():
        out = s.model(s.data.batch(0)[0])
    assert out.dtype == torch.bfloat16
    losses = [s.train_step().loss for _ in range(20)]
    assert all(p.dtype == torch.float32 for p in s.model.parameters())
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0]


def test_fp16_scales_the_loss_and_unscales_before_clipping():
    s = Session(workload(precision="fp16", clip_grad_norm=0.5))
    assert s.scaler is not None and s.scaler.get_scale() > 1
    losses = [s.train_step().loss for _ in range(20)]
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0]


# -- strategies that do not honour a feature are refused -----------------------------------------


class ChunkyUpdates(GradSync):
    name = "chunky"  # updates in pieces; honours nothing


def test_a_strategy_that_does_not_honour_a_feature_is_refused_in_one_line():
    s = Session(workload(clip_grad_norm=1.0, accumulation=2))
    with pytest.raises(ConfigError) as err:
        s.set_grad_sync(ChunkyUpdates())
    assert "chunky does not honour accumulation, clipping" in str(err.value)
    assert s.grad_sync.name == "local"  # the session keeps its strategy
    Session(workload()).set_grad_sync(ChunkyUpdates())  # no features: fine
