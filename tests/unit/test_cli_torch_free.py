"""Commands that need no model start without torch (1-2 s of CPU): help, usage and input errors,
and the commands that only read the study store or a run folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tunekit.cli.main import COMMANDS
from tunekit.runtime.rundir import RunDir
from tunekit.store import Store

# (argv, exit code, a phrase of its output): the phrase shows the path taken is the one named.
TORCH_FREE: list[tuple[list[str], int, str]] = [
    (["--help"], 0, "Commands:"),
    *[([name, "--help"], 0, f"tunekit {name} [OPTIONS]") for name in COMMANDS],
    (["hardware", "list"], 0, "k80x16"),
    (["hardware", "show", "k80x16"], 0, "fingerprint"),
    (["bogus"], 2, "No such command 'bogus'"),
    (["auto", "--trials", "-1"], 2, "-1 is not in the range x>=0"),
    (["auto", "example:nope"], 2, "unknown example 'nope'"),
    (["auto", "--plugins", "nope"], 2, "unknown plugin 'nope'"),
    (["plan", "nope"], 2, "unknown plugin 'nope'"),
    (["run", "nope"], 2, "is not of the form path/file.py:fn"),
    (["run", "example:nope"], 2, "unknown example 'nope'"),
    (["profile", "missing.py:fn"], 2, "workload file missing.py not found"),
    (["report", "--store", "absent"], 2, "no study store at absent"),
    (["report"], 2, "no studies in"),
    (["report", "7"], 2, "no study 7"),
    (["report", "--list"], 0, "studies in"),
    (["status", "job"], 0, "run job: stopped at step 5"),
    (["status", "--json"], 0, '"status": "stopped"'),
    (["stop", "job"], 2, "the run is not running"),
    (["apply", "job", "cgdp.chunks=2"], 2, "the run is not running"),
    (["rollback", "nope"], 2, "nope"),
]

RUN_EACH = """
import contextlib, io, json, sys
from tunekit.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    results.append([code, out.getvalue(), "torch" in sys.modules])
print(json.dumps(results))
"""


def test_help_errors_and_read_only_commands_do_not_import_torch(tmp_path: Path):
    Store.open_default(tmp_path / ".tunekit").close()  # a store without studies
    rd = RunDir.create(tmp_path / ".tunekit", {"workload": "example:cnn", "nproc": 2}, name="job")
    rd.write_status({"status": "stopped", "step": 5, "world_size": 2, "config": {}})
    argvs = [argv for argv, _, _ in TORCH_FREE]
    # One interpreter for all: each command must leave torch unloaded for the next to be checked.
    res = subprocess.run(
        [sys.executable, "-c", RUN_EACH, json.dumps(argvs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    results = json.loads(res.stdout.splitlines()[-1])
    for (argv, code, phrase), (got_code, said, torch_loaded) in zip(
        TORCH_FREE, results, strict=True
    ):
        assert (got_code, phrase in said) == (code, True), (argv, got_code, said)
        assert not torch_loaded, f"`tunekit {' '.join(argv)}` imported torch"
