"""Processes forked from tunekit's warm server look as ``python -m`` would start them."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tunekit.trials import warm_start
from tunekit.trials.warm_start import PIPE, STDOUT, start_python

pytestmark = pytest.mark.slow

PROBE_DIR = Path(__file__).resolve().parent.parent / "data" / "warm"


async def _run(out: Path, how: str, env: dict[str, str], **streams):
    cmd = [sys.executable, "-m", "warm_probe", str(out), how]
    proc = await start_python(cmd, env=env, stdin=PIPE, **streams)
    proc.stdin.write(b"hello\n")
    await proc.stdin.drain()
    proc.stdin.close()
    said = await proc.stdout.read() if proc.stdout is not None else b""
    return proc, await proc.wait(), said


def test_a_forked_process_gets_its_environment_folder_streams_session_and_exit_status(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(PROBE_DIR)
    env = {**os.environ, "WARM_PROBE": "first"}
    out = tmp_path / "a.json"
    proc, code, said = asyncio.run(_run(out, "3", env, stdout=PIPE, stderr=STDOUT))
    facts = json.loads(out.read_text())
    assert code == 3 and proc.returncode == 3
    assert facts["pid"] == proc.pid and facts["sid"] == proc.pid  # a session of its own
    assert facts["cwd"] == str(PROBE_DIR) and facts["on_path"]  # as `python -m` from there
    assert not facts["plugins_searched_here"]  # plugins come from where they are installed
    assert facts["env"] == "first" and facts["stdin"] == "hello"
    assert facts["name"] == "__main__" and facts["argv"][1:] == [str(out), "3"]
    assert facts["torch_loaded_before"]  # the point: it started warm
    assert facts["sigterm_default"]
    assert (tmp_path / "a.json.atexit").exists()  # exit hooks ran
    assert said.decode().splitlines() == ["to stdout", "to stderr"]

    # The next ones, with other run-time values, fork from the same server; a signal's death
    # reads as asyncio's would, and PYTHONSAFEPATH keeps the folder off the import path.
    servers = dict(warm_start._servers)
    env = {**env, "WARM_PROBE": "second", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "b.json"
    proc, code, _ = asyncio.run(_run(out, "kill", env, stdout=PIPE))
    assert code == -signal.SIGKILL
    assert json.loads(out.read_text())["env"] == "second"
    proc, code, said = asyncio.run(
        _run(tmp_path / "c.json", "0", {**env, "PYTHONSAFEPATH": "1"}, stdout=PIPE, stderr=STDOUT)
    )
    assert code == 1 and "No module named warm_probe" in said.decode()
    assert warm_start._servers == servers


def test_an_import_time_variable_gets_a_server_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(PROBE_DIR)
    env = dict(os.environ)
    asyncio.run(_run(tmp_path / "a.json", "0", env, stdout=PIPE))
    before = warm_start._servers[warm_start.import_time_env(env)]
    other = {**env, "TORCH_SHOW_CPP_STACKTRACES": "1"}
    asyncio.run(_run(tmp_path / "b.json", "0", other, stdout=PIPE))
    after = warm_start._servers[warm_start.import_time_env(other)]
    assert after is not before and after.pid != before.pid and not after.forked_here
    assert before.alive and after.alive
    # Started afresh with PYTHONSAFEPATH, which its forks keep as a flag while they put their
    # folder first on the path, as `python -m` would: plugins are not looked for there.
    facts = json.loads((tmp_path / "b.json").read_text())
    assert facts["on_path"] and not facts["plugins_searched_here"]


MANY_FILES = """
import json, os, subprocess, sys
from tunekit.trials.warm_start import popen_python
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # past what select() watches
os.chdir({probe!r})
with open({log!r}, "wb") as log:  # no thread here: the server is a fork of this process
    proc = popen_python([sys.executable, "-m", "warm_probe", {out!r}, "nest"],
                        env=dict(os.environ), stdout=log.fileno(), stderr=log.fileno(),
                        umask=0o022)
    code = proc.wait(120)
print(json.dumps({{"code": code, "pid": proc.pid, "forked": not isinstance(proc, subprocess.Popen)}}))
"""


def test_a_caller_with_over_1024_files_open_gets_processes_that_fork_their_own(tmp_path):
    # The caller's end of the server's socket is numbered past 1024: the server still hears
    # it. The probe forks one of its own: the server was forked while its caller held the
    # servers' lock, which must not stay held in what it forks.
    out, log = tmp_path / "m.json", tmp_path / "m.log"
    res = subprocess.run(
        [sys.executable, "-c", MANY_FILES.format(out=str(out), log=str(log), probe=str(PROBE_DIR))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    said = json.loads(res.stdout)
    facts = json.loads(out.read_text())
    nested = json.loads((tmp_path / "m.json.nested").read_text())
    assert said["forked"] and said["code"] == 5 and facts["pid"] == said["pid"]
    assert facts["cwd"] == str(PROBE_DIR) and facts["on_path"] and facts["torch_loaded_before"]
    assert not facts["plugins_searched_here"]  # as a fresh `python -m`
    assert nested["pid"] != facts["pid"] and nested["torch_loaded_before"]
    assert nested["cwd"] == str(PROBE_DIR)
    assert log.read_text().splitlines() == ["to stdout", "to stderr"] * 2


CALLER = """
import asyncio, os, sys
sys.path.insert(0, {probe!r})
os.chdir({probe!r})
from tunekit.trials.warm_start import PIPE, start_python
async def main():
    proc = await start_python([sys.executable, "-m", "warm_probe", {out!r}, "sleep"],
                              env=dict(os.environ), stdin=PIPE, stdout=PIPE)
    proc.stdin.write(b"x\\n")
    await proc.stdin.drain()
    await proc.stdout.readline()
    print(proc.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_what_it_started_ends_when_the_caller_is_killed(tmp_path):
    out = tmp_path / "c.json"
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER.format(probe=str(PROBE_DIR), out=str(out))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = int(caller.stdout.readline())
        assert psutil.pid_exists(pid)
        caller.kill()  # no chance to clean up: the server must see it gone
        caller.wait()
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the forked process outlived its caller"
            time.sleep(0.1)
    finally:
        caller.kill()


FORKED_HERE = """
import asyncio, atexit, json, os, sys, tempfile
sys.path.insert(0, {probe!r})
os.chdir({probe!r})
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # as `tunekit` does before torch loads
import torch  # noqa: F401  (a command forks its server once torch is in)
from tunekit.trials import warm_start
from tunekit.trials.warm_start import PIPE, start_python
kept = tempfile.TemporaryDirectory()  # the caller's: a forked process must never remove it
atexit.register(lambda: open(os.path.join({out_dir!r}, f"hook-{{os.getpid()}}"), "w").close())
warm_start.prepare()
(server,) = warm_start._servers.values()
async def main():
    proc = await start_python([sys.executable, "-m", "warm_probe", {out!r}, "0"],
                              env=dict(os.environ), stdin=PIPE, stdout=PIPE)
    proc.stdin.close()
    await proc.stdout.read()
    return await proc.wait()
code = asyncio.run(main())
print(json.dumps({{"code": code, "caller": os.getpid(), "forked_here": server.forked_here,
                  "kept": os.path.isdir(kept.name)}}))
"""


def test_a_command_forks_its_server_from_itself_and_keeps_its_exit_hooks_and_files(tmp_path):
    out = tmp_path / "d.json"
    script = FORKED_HERE.format(probe=str(PROBE_DIR), out=str(out), out_dir=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    facts = json.loads(out.read_text())
    assert said["forked_here"] and said["code"] == 0 and said["kept"]
    assert facts["torch_loaded_before"] and facts["name"] == "__main__"
    # Only the caller ran its exit hook: not its server, not the process forked from that.
    assert [p.name for p in tmp_path.glob("hook-*")] == [f"hook-{said['caller']}"]
    assert (tmp_path / "d.json.atexit").exists()  # the probe's own hook ran
