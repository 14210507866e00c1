"""`tunekit profile` input errors: one clear line before anything is launched."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tunekit.errors import WorkloadError
from tunekit.observe.profile_job import ProfileOptions, profile_job

BROKEN = """
import torch
from torch import nn
from tunekit.workload import Workload


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x.view(-1, 5))  # wrong shape: the forward pass cannot run


def workload():
    return Workload(
        name="broken",
        model=Broken,
        make_batch=lambda n, g: (torch.randn(n, 4, generator=g), torch.zeros(n, dtype=torch.long)),
    )
"""


def test_unknown_workload_is_a_workload_error(tmp_path):
    with pytest.raises(WorkloadError, match="unknown example 'nope'"):
        profile_job("example:nope", ProfileOptions(out_dir=tmp_path))


def test_model_that_cannot_be_traced_is_a_workload_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    with pytest.raises(WorkloadError, match="cannot trace Broken") as info:
        profile_job(f"{path}:workload", ProfileOptions(out_dir=tmp_path / "out"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out" / "trial").exists()  # nothing was launched


def test_cli_reports_bad_input_as_an_exception_for_main_to_print(tmp_path):
    from tunekit.cli.profile import profile_cmd

    res = CliRunner().invoke(profile_cmd, ["example:nope", "--out", str(tmp_path)])
    assert isinstance(res.exception, WorkloadError)


def test_options_are_checked():
    with pytest.raises(ValueError):
        ProfileOptions(nproc=0)
