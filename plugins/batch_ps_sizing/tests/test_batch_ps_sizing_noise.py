"""The gradient noise scale measured on a problem whose B_simple is known in closed form."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tunekit.plugins.batch_ps_sizing.runtime import gradient_noise_sums, session_noise_sums
from tunekit.runtime.session import Session
from tunekit.workload import load_workload

DIM = 10


def _regression_batches(w_star: torch.Tensor, n: int, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(batch, DIM, generator=gen)
        yield x, x @ w_star + torch.randn(batch, generator=gen)


def _half_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out.squeeze(-1) - y).square().mean()


@pytest.mark.parametrize("parts", [2, 4])
def test_noise_scale_of_linear_regression(parts):
    """Per-sample gradient (d.x - e) x with x ~ N(0, I), e ~ N(0, 1) at distance d from the optimum:

    |G|^2 = |d|^2 and tr(Sigma) = |d|^2 (D + 1) + D, so with |d| = 1, B_simple = 2 D + 1 = 21.
    """
    torch.manual_seed(0)
    w_star = torch.randn(DIM)
    delta = torch.randn(DIM)
    delta /= delta.norm()
    model = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta).unsqueeze(0))
    sums = gradient_noise_sums(
        model, _half_mse, _regression_batches(w_star, 400, 64, seed=1), parts=parts
    )
    est = sums.estimate()
    assert est.samples == 400
    assert est.grad_sq == pytest.approx(1.0, rel=0.15)
    assert est.b_simple == pytest.approx(2 * DIM + 1, rel=0.15)
    assert model.weight.grad is None  # nothing left behind


def test_session_noise_measurement_changes_nothing():
    session = Session(load_workload("example:cnn"))
    session.train_step()
    before = {k: v.clone() for k, v in session.model.state_dict().items()}
    step = session.step
    sums = session_noise_sums(session, 2)
    assert sums.count == 2 and sums.b_small == 16 and sums.b_big == 32
    est = sums.estimate()
    assert est.trace_cov > 0
    after = session.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert session.step == step
    assert all(p.grad is None for p in session.model.parameters())
    # The batches it read are the ones the job trains on next, and training goes on.
    assert session.train_step().step == step
