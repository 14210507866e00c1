"""A live job's control socket as an attacker and a clumsy user meet it (issue 18, items 1, 2, 4, 5).

One job serves every test here. It runs the way that exposes most: under umask 0
(nothing private by accident), in a folder too deep for a socket path (so its
socket goes to the shared temporary folder, where another user planted a
world-writable ``tunekit-<uid>``), and with an ordinary user's 1024 open files.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from support import WORKLOADS, limited, run_cli, wait_step

from tunekit.errors import ControlError
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, wait_for

pytestmark = pytest.mark.slow

LIGHT = f"{WORKLOADS}:light_cnn"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    deep = tmp_path_factory.mktemp("control") / ("d" * 80)  # run folder + control.sock > 108 bytes
    deep.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="tk"))  # the job's TMPDIR, short enough for a socket path
    planted = tmp / f"tunekit-{os.geteuid()}"
    planted.mkdir()
    planted.chmod(0o777)  # what another local user would leave for us
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env["TMPDIR"] = str(tmp)
    cmd = limited(
        [sys.executable, "-m", "tunekit", "run", LIGHT, "--name", "job", "--checkpoint-every", "5"],
        nofile=1024,
    )
    proc = subprocess.Popen(
        cmd, cwd=deep, env=env, umask=0, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    rd = None
    deadline = time.monotonic() + 120
    while rd is None and time.monotonic() < deadline:
        try:
            rd = RunDir.find("job", deep / ".tunekit")
        except ControlError:
            time.sleep(0.2)
    wait_step(rd, 6)
    yield deep, rd, planted
    run_cli("stop", "job", cwd=deep)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def agent_logs(rd: RunDir) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(rd.logs.glob("agent-*.log")))


# -- item 1: nobody else's folder, nobody else's socket ------------------------------------------


def test_the_socket_is_in_a_private_folder_not_a_planted_one(job):
    _, rd, planted = job
    sock = Path(rd.read_run()["socket"])
    assert len(str(rd.path / "control.sock")) > 108  # the fallback is what is under test
    assert sock.parent != planted and not list(planted.iterdir())
    folder = os.lstat(sock.parent)
    assert stat.S_ISDIR(folder.st_mode) and folder.st_uid == os.geteuid()
    assert stat.S_IMODE(folder.st_mode) == 0o700
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


FAKE_JOB = """
import json, socket, sys
srv = socket.socket(socket.AF_UNIX)
srv.bind(sys.argv[1])
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(10)
data = conn.recv(65536)
open(sys.argv[2], "wb").write(data)
conn.sendall(json.dumps({"ok": True, "status": "running", "step": 999999}).encode() + b"\\n")
"""


def _python_for(uid: int) -> str | None:
    """A Python interpreter another user may run (this one may live in root's home)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if os.access(cand, os.X_OK) and all(
            os.stat(p).st_mode & 0o001 for p in Path(cand).resolve().parents
        ):
            return cand
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another local user needs root")
def test_the_client_sends_no_token_to_a_socket_another_user_answers(tmp_path):
    # The state after a hijack: the path a run records for its socket is answered by
    # another user's process, which would read the token and reply with a made-up status.
    python = _python_for(65534)
    if python is None:
        pytest.skip("no Python interpreter the user nobody can run")
    lair = Path(tempfile.mkdtemp(prefix="tk"))
    lair.chmod(0o777)
    try:
        sock, loot = lair / "s.sock", lair / "loot"
        fake = subprocess.Popen(
            [python, "-c", FAKE_JOB, str(sock), str(loot)],
            user=65534,
            group=65534,
            extra_groups=[],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert fake.stdout.readline().strip() == "ready"
        rd = RunDir.create(tmp_path / ".tunekit", {"workload": "example:cnn"}, name="victim")
        rd.update_run(socket=str(sock))
        res = run_cli("status", "victim", cwd=tmp_path)
        fake.kill()
        fake.wait()
        assert res.returncode == 2, res.stdout + res.stderr
        assert "uid 65534" in res.stderr and "Traceback" not in res.stderr
        assert "999999" not in res.stdout
        assert not loot.exists() or rd.token() not in loot.read_text(errors="replace")
    finally:
        shutil.rmtree(lair, ignore_errors=True)


# -- item 2: private from the start --------------------------------------------------------------


def test_everything_in_the_run_folder_is_private(job):
    _, rd, _ = job
    wait_for(rd, lambda s: s.get("step", 0) >= 10)  # a checkpoint is written
    assert list(rd.checkpoints.glob("step-*.pt"))
    assert stat.S_IMODE(rd.path.stat().st_mode) == 0o700
    loose = []
    for p in rd.path.rglob("*"):
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        if mode & 0o077:
            loose.append(f"{p.relative_to(rd.path)} {oct(mode)}")
    assert not loose, loose


# -- item 4: every field of every request is checked ---------------------------------------------

DEEP = b'{"op": "status", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"op": "apply", "config": {}, "watch": None}, "watch must be an integer"),
        ({"op": "apply", "config": {}, "window": 5, "watch": "x"}, "unknown field 'window'"),
        ({"op": "trial", "config": {}, "window": None}, "window must be an integer"),
        ({"op": "trial", "config": {}, "watch": 5}, "unknown field 'watch'"),
        ({"op": "apply", "config": {}, "nproc": True}, "nproc must be an integer"),
        ({"op": "apply"}, "missing field 'config'"),
        ({"op": "apply", "config": None}, "config must be an object"),
        ({"op": "pause", "reason": ["x"]}, "reason must be a string"),
        ({"op": "stop", "now": True}, "unknown field 'now'"),
        ({"op": None}, "unknown op None"),
        (b'{"op": "status", "token": "T", "n": Infinity}', "not a JSON number"),
        (b'{"op": "status", "token": "T", "n": NaN}', "not a JSON number"),
        (b'{"op": "status", "token": "T", "n": 1e400}', "out of range"),
        (b'{"op": "status", "token": "T", "n": ' + b"7" * 400 + b"}", "too many digits"),
        (b'{"op": "status", "token": "\xc3\xa9t\xc3\xa9"}', "wrong or missing token"),
        (b'{"op": "status", "token": "\\ud800"}', "wrong or missing token"),
        (DEEP, "nested too deeply"),
        (
            {"op": "apply", "config": {"plugins": {"overlap_chunking": {"bucket_cap_mb": 10**24}}}},
            "out of range",
        ),
    ],
    ids=lambda v: v[:40] if isinstance(v, str | bytes) else None,
)
def test_a_bad_request_is_refused_in_one_line_and_the_job_trains_on(job, message, error):
    _, rd, _ = job
    token = rd.token()
    if isinstance(message, dict):
        message = {"token": token, **message}
    else:
        message = message.replace(b'"token": "T"', f'"token": "{token}"'.encode())
    step = rd.read_status()["step"]
    reply = client(rd).raw(message)
    assert reply["ok"] is False and error in reply["error"], reply
    assert "\n" not in reply["error"] and len(reply["error"]) < 400
    wait_step(rd, step + 2)


# -- item 5: connections cannot exhaust the job --------------------------------------------------


def test_a_thousand_idle_connections_neither_crash_the_job_nor_lock_out_its_owner(job):
    deep, rd, _ = job
    sock_path = rd.read_run()["socket"]
    idle = []
    try:
        for _ in range(1100):  # more than the job's 1024 open files
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(sock_path)
            except (BlockingIOError, ConnectionRefusedError):
                pass  # the backlog is full: the server has not accepted yet
            idle.append(s)
        step = rd.read_status()["step"]
        res = run_cli("status", "job", "--json", cwd=deep)
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads(res.stdout)["status"] == "running"
    finally:
        for s in idle:
            s.close()
    wait_step(rd, step + 3)
    assert "Traceback" not in agent_logs(rd)


def test_status_is_answered_beside_64_polling_clients(job):
    deep, rd, _ = job
    c = client(rd, timeout_s=60)
    stop = threading.Event()
    failures: list[str] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                c.request("status")
            except ControlError as exc:
                failures.append(str(exc))

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(64)]
    for t in threads:
        t.start()
    try:
        results = [run_cli("status", "job", cwd=deep, timeout=120) for _ in range(8)]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    for res in results:
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        assert "run job: running" in res.stdout
    assert not failures, failures[:3]


def test_dropped_connections_leave_no_traceback_in_the_log(job):
    _, rd, _ = job
    path = rd.read_run()["socket"]
    for data in (
        b"",
        b'{"op": "sta',
        b'{"token": "' + rd.token().encode() + b'", "op": "subscribe"}\n',
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        # closed before (or while) the reply is written
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
        )  # reset on close
        s.connect(path)
        s.sendall(json.dumps({"token": rd.token(), "op": "status"}).encode() + b"\n")
    step = rd.read_status()["step"]
    wait_step(rd, step + 3)
    assert "Traceback" not in agent_logs(rd)
