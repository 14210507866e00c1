"""Issue 19 through the installed command: fast failures and the local hardware. (A config
copied from `tunekit plan` to `tunekit apply` on a live run is tested on the shared live job,
tests/integration/test_live.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tunekit.cli.main import main


def one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert any(needle in ln for ln in err.splitlines()), err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["auto", "--budget", "0s"], "'0s' is no time at all"),
        (["auto", "--plugins", ""], "--plugins '' names no tuner"),
        (["tui", "--plugins", " , "], "names no tuner"),
    ],
)
def test_bad_input_says_what_is_wrong(workdir, capsys, args, needle):
    code = main(args)
    one_line_error(code, capsys.readouterr().err, needle)


@pytest.mark.parametrize("command", [["auto"], ["plan", "overlap_chunking"], ["profile"], ["tui"]])
def test_a_missing_workload_file_fails_before_torch_loads(workdir, command):
    """Issue 19: it took 8 s to say so, importing torch first."""
    code = (
        "import sys; from tunekit.cli.main import main; "
        f"code = main({[*command, 'missing.py:fn']!r}); print(code, 'torch' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=300
    )
    assert res.stdout.split() == ["2", "False"], res.stderr
    assert "workload file missing.py not found" in res.stderr and "Traceback" not in res.stderr


def test_hardware_show_without_a_profile_shows_this_machine(cli):
    res = cli("hardware", "show")
    assert res.returncode == 0, res.stderr
    assert "this machine" in res.stdout and "devices" in res.stdout and "fingerprint" in res.stdout
