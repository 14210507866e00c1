"""E_N from short runs (gradient accumulation) and from the gradient noise scale."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tunekit.errors import ConfigError
from tunekit.hardware import load_profile
from tunekit.plugins.hybrid_mp.convergence import (
    allreduce_model,
    estimate_noise_scale,
    measure_epochs,
    noise_scale_epochs,
)
from tunekit.workload import Workload

D, SIGMA = 4, 1.0
W_STAR = torch.ones(D)


def _zero_linear() -> nn.Module:
    m = nn.Linear(D, 1, bias=False)
    nn.init.zeros_(m.weight)
    return m


def _regression_batch(n: int, gen: torch.Generator):
    x = torch.randn(n, D, generator=gen)
    return x, x @ W_STAR + SIGMA * torch.randn(n, generator=gen)


def regression(batch: int = 8, lr: float = 0.05) -> Workload:
    """Linear regression y = x.w* + noise, from w = 0 (its noise scale is known)."""
    return Workload(
        name="regression",
        model=_zero_linear,
        make_batch=_regression_batch,
        loss=lambda out, y: nn.functional.mse_loss(out.squeeze(-1), y),
        optimizer=lambda params, lr: torch.optim.SGD(params, lr=lr),
        batch_size=batch,
        lr=lr,
    )


def test_noise_scale_of_linear_regression_matches_theory():
    # at w = 0 with x ~ N(0, I_d): per-sample gradient -2 y x, so |G|^2 = 4 |w*|^2 and
    # tr(Sigma) = 4 (|w*|^2 (d + 1) + sigma^2 d): B_noise = d + 1 + sigma^2 d / |w*|^2 = 6
    est = estimate_noise_scale(regression(), micro_batches=16, draws=64)
    assert est.grad_sq == pytest.approx(4 * float(W_STAR @ W_STAR), rel=0.15)
    assert est.b_noise == pytest.approx(D + 1 + SIGMA**2 * D / float(W_STAR @ W_STAR), rel=0.15)


def test_noise_scale_epochs_grow_with_the_global_batch():
    t = noise_scale_epochs(b_noise=64.0, batch=32, widths=[1, 2, 4, 8])
    assert t(8) / t(1) == pytest.approx((1 + 8 * 32 / 64) / (1 + 32 / 64))
    assert [t(n) for n in (1, 2, 4, 8)] == sorted(t(n) for n in (1, 2, 4, 8))
    with pytest.raises(ConfigError):
        noise_scale_epochs(0.0, 32, [1])


def test_measured_epochs_come_from_accumulated_steps():
    table, runs = measure_epochs(regression(), [1, 4], target_loss=1.5, max_samples=20_000)
    assert table.source == "measured"
    for r in runs:
        assert r.reached and r.final_loss <= 1.5
        assert r.samples == r.steps * r.width * 8
        assert table(r.width) == pytest.approx(r.samples / (1000 * 8))
    with pytest.raises(ConfigError, match="no width reached"):
        measure_epochs(regression(), [1], target_loss=-1.0, max_samples=64)


def test_measured_epochs_count_accumulated_micro_batches_in_the_global_batch():
    # batch 4 x 2 micro-batches: a replica trains 8 samples per optimizer step, as above
    accumulated = dataclasses.replace(regression(batch=4), accumulation=2)
    table, runs = measure_epochs(accumulated, [1, 4], target_loss=1.5, max_samples=20_000)
    for r in runs:
        assert r.reached
        assert r.samples == r.steps * r.width * 8
        assert table(r.width) == pytest.approx(r.samples / (1000 * 8))
    plain, _ = measure_epochs(regression(batch=8), [1, 4], target_loss=1.5, max_samples=20_000)
    # the same global batch needs about as many epochs, whatever its micro-batches
    for n in (1, 4):
        assert table(n) == pytest.approx(plain(n), rel=0.5)


def test_allreduce_model_extends_a_profile_past_its_devices():
    hw = load_profile("dgx1-v100x4")
    ar = allreduce_model(hw)
    assert ar(1e8, 1) == 0.0
    assert ar(1e8, 4) == pytest.approx(hw.allreduce_time(1e8, 4))
    assert ar(1e8, 64) > ar(1e8, 4)
