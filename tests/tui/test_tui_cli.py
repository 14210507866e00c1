"""``tunekit tui``'s command line: bad input is one clear error, before any process starts."""

from __future__ import annotations

import click
import pytest

from tunekit.errors import ControlError, PluginError, WorkloadError
from tunekit.tui.cli import tui_cmd


def invoke(*args: str):
    return tui_cmd.main(list(args), prog_name="tunekit tui", standalone_mode=False)


def test_workload_and_attach_are_exclusive(tmp_path):
    with pytest.raises(click.UsageError, match="not both"):
        invoke("example:cnn", "--attach", "latest", "--store", str(tmp_path))


def test_attaching_to_a_missing_run_is_one_line(tmp_path):
    with pytest.raises(ControlError, match="no run 'nope'"):
        invoke("--attach", "nope", "--store", str(tmp_path))


def test_an_unknown_workload_starts_nothing(tmp_path):
    with pytest.raises(WorkloadError):
        invoke("example:no_such_model", "--store", str(tmp_path))
    assert not (tmp_path / "runs").exists()


def test_an_unknown_plugin_starts_nothing(tmp_path):
    with pytest.raises(PluginError, match="unknown plugin 'nope'"):
        invoke("example:cnn", "--plugins", "overlap_chunking,nope", "--store", str(tmp_path))
    assert not (tmp_path / "runs").exists()


def test_the_options():
    names = sorted(p.name for p in tui_cmd.params)
    assert names == sorted(
        [
            "workload",
            "attach_run",
            "nproc",
            "plugins",
            "trials",
            "steps",
            "warmup",
            "watch_window",
            "min_effect",
            "device",
            "store_dir",
            "memory_cap",
        ]
    )
