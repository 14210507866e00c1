"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing lost."""

from types import SimpleNamespace

import pytest
from support import WORKLOADS

from tunekit.cli.main import main


def _one_line_error(res, needle):
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert any(needle in ln for ln in lines), res.stderr
    return lines


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["auto", "example:nope"], "unknown example 'nope'"),
        (["auto", "missing.py:fn"], "workload file missing.py not found"),
        (["auto", f"{WORKLOADS}:absent"], "has no function 'absent'"),
        (["auto", f"{WORKLOADS}:not_a_workload"], "expected a tunekit.Workload"),
        (["auto", "--plugins", "nope"], "unknown plugin 'nope'"),
        (["auto", "--budget", "soon"], "is not a duration"),
        (["auto", "--trials", "-1"], "-1 is not in the range x>=0"),
        (["auto", "--trials", "2", "--budget", "1m"], "give --trials or --budget, not both"),
        (["plan", "nope"], "unknown plugin 'nope'"),
        (["report", "7"], "no study store"),
    ],
)
def test_bad_input(workdir, capsys, args, needle):
    # In this process (the entry point's own main): a traceback would fail the test as an exception.
    # The subprocess tests below check the same through the installed command.
    code = main(args)
    out = capsys.readouterr()
    _one_line_error(SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err), needle)


def test_bad_input_through_the_installed_command(cli):
    _one_line_error(cli("auto", f"{WORKLOADS}:not_a_workload"), "expected a tunekit.Workload")


def test_corrupt_store_is_refused_and_kept(cli, workdir):
    store = workdir / ".tunekit" / "tunekit.db"
    store.parent.mkdir()
    store.write_bytes(b"garbage" * 50)
    _one_line_error(cli("auto", "--trials", "1"), "unreadable or corrupt")
    assert store.read_bytes() == b"garbage" * 50


def test_plugins_lists_every_builtin_with_its_state(cli):
    res = cli("plugins")
    assert res.returncode == 0
    for name in ("overlap_chunking", "cgdp", "layer_split", "hybrid_mp", "batch_ps_sizing"):
        assert name in res.stdout
