"""Plugins that exit, take their time, or lie in the working directory (issue 18, items 18, 19)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import WORKLOADS, run_cli

pytestmark = pytest.mark.slow

TUNER = """
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner


class {cls}(Tuner):
    name, title, aspect = "{name}", "{name} (tests only)", Aspect.DATA

    def knobs(self):
        return [Knob("level", "int", 0, low=0, high=3)]

    def diagnose(self, obs):
        return Diagnosis(False, "never applies")

    def plan(self, obs, limit):
        return []

    def apply(self, session, knobs):
        pass
"""


def make_plugin(folder: Path, name: str, prelude: str) -> None:
    """A plugin distribution in ``folder``, found the way an installed one is (a dist-info)."""
    info = folder / f"tk_{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tk-{name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[tunekit.plugins]\n{name} = tk_{name}:{name.title()}\n"
    )
    (folder / f"tk_{name}.py").write_text(prelude + TUNER.format(cls=name.title(), name=name))


MARKER = "import os\nopen(os.path.join(os.environ['MARKER_DIR'], f'loaded-{os.getpid()}'), 'w').close()\n"


def test_a_plugin_that_exits_or_is_slow_is_reported_one_in_the_working_directory_is_not_loaded(
    tmp_path,
):
    """One listing and one two-rank run for both claims: a plugin that exits or is slow to
    import is reported and the rest run; ranks load exactly the plugins tunekit lists (a
    dist-info lying in the working directory is not installed)."""
    work, plugins, marks = tmp_path / "project", tmp_path / "site", tmp_path / "marks"
    marks.mkdir()
    make_plugin(plugins, "quitter", "import sys\nsys.exit(3)\n")
    make_plugin(plugins, "sleepy", "import time\ntime.sleep(3.5)\n")
    make_plugin(work, "stray", MARKER)  # any process that imports it leaves a mark
    env = {
        "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        "COLUMNS": "400",  # a table wide enough not to wrap its cells
        "MARKER_DIR": str(marks),
    }
    res = run_cli("plugins", cwd=work, env_extra=env)
    assert res.returncode == 0, res.stdout + res.stderr
    out = " ".join(res.stdout.split())
    assert "quitter" in out and "called sys.exit(3)" in out
    assert "overlap_chunking" in out and "sleepy" in out
    assert "plugin sleepy (tk-sleepy 0.1) took" in out and "to import" in out
    assert "stray" not in res.stdout
    res = run_cli(
        "run", f"{WORKLOADS}:light_cnn", "--nproc", "2", "--steps", "2", cwd=work, env_extra=env
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "finished at step 2" in res.stdout and "slow_plugin" in res.stdout
    assert not list(marks.iterdir()), "a process imported a plugin tunekit plugins does not list"
