"""Shared fixtures: a scratch working directory and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import chaos_pythonpath, run_cli


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """Run in a fresh folder: the study store and reports land here."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def cli(workdir):
    def _run(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 600):
        return run_cli(*args, cwd=workdir, env_extra=env_extra, timeout=timeout)

    return _run


@pytest.fixture
def chaos_env() -> dict[str, str]:
    return chaos_pythonpath()
