"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing lost."""

import sqlite3
import subprocess
import sys
from types import SimpleNamespace

import pytest
from support import WORKLOADS, limited

from tunekit.cli.main import main
from tunekit.store import Store


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
        (
            ["auto", f"{WORKLOADS}:forward_fails", "--no-probe"],
            "its forward pass fails on the example batch",
        ),
        (
            ["plan", "overlap_chunking", f"{WORKLOADS}:forward_fails"],
            "its forward pass fails on the example batch",
        ),
        (["profile", f"{WORKLOADS}:forward_fails"], "its forward pass fails on the example batch"),
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


def _finished_study(db):
    store = Store(db)
    sid = store.create_study(
        key="k",
        workload="example:cnn",
        graph_hash="g",
        hw_fingerprint="h",
        nproc=2,
        settings={"steps": 4},
    )
    tid = store.add_trial(
        sid, seq=0, role="baseline", plugin=None, config_id="base", config={"plugins": {}}
    )
    store.finish_trial(
        tid, status="ok", median_s=0.1, spread_s=0.01, samples_per_s=100.0, result={"ranks": []}
    )
    store.set_study(
        sid, status="finished", decision={"winner": "baseline", "reason": "nothing beat it"}
    )
    store.close()


@pytest.mark.parametrize(
    ("damage", "needle", "list_ok"),
    [
        (
            "UPDATE studies SET decision = '{\"winner\": '",
            "study 1's decision is not valid JSON",
            False,
        ),
        ("UPDATE trials SET config = 'not json'", "trial 1's config is not valid JSON", True),
        ("DROP TABLE events", "is damaged (no table 'events')", False),
    ],
)
def test_report_on_a_damaged_store_says_so_in_one_line_and_changes_nothing(
    workdir, capsys, damage, needle, list_ok
):
    db = workdir / ".tunekit" / "tunekit.db"
    _finished_study(db)
    conn = sqlite3.connect(db)
    conn.execute(damage)
    conn.commit()
    conn.close()
    before = db.read_bytes()
    code = main(["report"])
    out = capsys.readouterr()
    _one_line_error(SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err), needle)
    code = main(["report", "--list"])
    out = capsys.readouterr()
    if list_ok:
        assert code == 0 and "example:cnn" in out.out
    else:
        _one_line_error(SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err), needle)
    assert db.read_bytes() == before  # left untouched, as the message says


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["profile", f"{WORKLOADS}:tiny"],
            "cannot write the profile folder (--out) tunekit-profile",
        ),
        (
            ["run", f"{WORKLOADS}:tiny", "--steps", "1"],
            "cannot write the study store folder (--store) .tunekit",
        ),
        (["tui", f"{WORKLOADS}:tiny"], "cannot write the study store folder (--store) .tunekit"),
        (
            ["auto", f"{WORKLOADS}:tiny", "--no-probe"],
            "cannot write the study store folder (--store) .tunekit",
        ),
        (["hardware", "probe"], "cannot write the study store folder (--store) .tunekit"),
    ],
)
def test_a_read_only_working_directory_is_one_line_before_any_work(tmp_path, args, needle):
    cwd = tmp_path / "readonly"
    cwd.mkdir()
    cwd.chmod(0o555)
    try:
        # limited(): the suite may run as root, which would write there regardless.
        res = subprocess.run(
            limited([sys.executable, "-m", "tunekit", *args], obey_file_modes=True),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        cwd.chmod(0o755)
    lines = _one_line_error(res, needle)
    assert "Permission denied" in lines[-1]
    assert "measured on" not in res.stdout  # nothing was measured before the failure
    assert not list(cwd.iterdir())
