"""tunekit.prepare on one process: the step, the batch it wants, and bad input in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tunekit
from tunekit.errors import ConfigError


def parts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy


def batch(n: int):
    x = torch.randn(n, 8)
    return x, (x[:, 0] > 0).long()


def test_prepare_trains_the_users_model_in_place():
    model, opt, loss_fn = parts()
    before = [p.detach().clone() for p in model.parameters()]
    got, got_opt, step = tunekit.prepare(
        model, opt, loss_fn, None, batch_size=4, accumulation=2, clip_grad_norm=1.0
    )
    assert got is model and got_opt is opt and step.batch_size == 8
    losses = [step(*batch(8)) for _ in range(3)]
    assert all(isinstance(x, float) for x in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert step.state_dict()["step"] == 3
    step.close()


def test_a_batch_of_another_size_is_refused_in_one_line():
    model, opt, loss_fn = parts()
    _, _, step = tunekit.prepare(
        model, opt, loss_fn, {"batch_ps_sizing": {"batch_size": 16}}, batch_size=4
    )
    assert step.batch_size == 16
    with pytest.raises(
        ConfigError, match=r"got a batch of 4 samples; this config trains 16 per rank"
    ):
        step(*batch(4))


def test_a_missing_config_file_is_one_line(tmp_path):
    model, opt, loss_fn = parts()
    with pytest.raises(ConfigError, match="config file .* not found"):
        tunekit.prepare(model, opt, loss_fn, tmp_path / "best_config.json", batch_size=4)


def test_prepare_leaves_the_users_random_state_alone():
    model, opt, loss_fn = parts()
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    tunekit.prepare(model, opt, loss_fn, None, batch_size=4)
    assert torch.equal(torch.rand(1), expected)


def test_best_config_md_shows_prepare_with_the_jobs_batch():
    from tunekit.config import TuningConfig
    from tunekit.plugin_loading import available_tuners
    from tunekit.report.data import snippet
    from tunekit.trials.launcher import LaunchOptions

    tuners = available_tuners()
    best = TuningConfig({"overlap_chunking": {"bucket_cap_mb": 4.0}})
    text = snippet("example:cnn", best, tuners, LaunchOptions(nproc=2), batch_size=32)
    assert (
        'tunekit.prepare(\n    model, optimizer, loss_fn, config="best_config.json", batch_size=32\n)'
        in text
    )
    assert "DistributedDataParallel(model" in text  # the plain-PyTorch form too
    assert "Nothing to change" in snippet(
        "example:cnn", TuningConfig(), tuners, LaunchOptions(nproc=2), 32
    )
