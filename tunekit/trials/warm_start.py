"""tunekit's own Python processes forked from one warm process instead of started afresh.

A study starts a torchrun agent per trial and node (:mod:`tunekit.trials.agent`) and
a process per workload it observes (:mod:`tunekit.observe.workload_child`); each,
started as a fresh ``python -m``, spends about 2.5 s of CPU importing torch,
torchrun's elastic agent and ``torch._dynamo`` before it does anything. Here a
*server* process imports them once per tunekit process (and per import-time
environment, below) and forks each of those processes from itself, so that it
starts with them in memory; the launcher gets back a process handle much like
asyncio's.

What a forked process sees is what ``python -m MODULE ARGS`` would give it: its
own session (``start_new_session``), the caller's environment and working directory
(on ``sys.path`` unless ``PYTHONSAFEPATH`` is set), its standard streams on the
pipes or files given, default signal handlers, exit hooks run, and SIGTERM when
the server dies. The server dies with its caller: it sees the request socket
close (or its parent change) and terminates what it started, except what
:func:`popen_python` started (a live job's agent, which outlives its supervisor).

Environment variables read only when a process starts (the interpreter's, the
dynamic loader's, OpenMP's, torch's: :data:`IMPORT_TIME_PREFIXES`) cannot change
in a fork, so processes asking for other values of those get a server of their
own. ``TUNEKIT_PROCESS_START=spawn`` starts every process afresh, as before.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from collections.abc import Mapping
from functools import partial
from typing import Any

ENV = "TUNEKIT_PROCESS_START"

PRELOAD = (
    "torch._dynamo",  # the optimizers import it at their first call
    "torch.distributed.run",
    "tunekit.trials.agent",
    "tunekit.runtime.worker",
    "tunekit.observe.workload_child",
    "tunekit.observe.graph",  # what the workload process imports before its first request
    "tunekit.observe.layer_profile",
    "tunekit.observe.observation",
    "tunekit.plugin_loading",
)
"""What the server imports before it forks anything: what every agent, rank and workload
process imports before its first step."""

IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH", "PYTORCH")
"""Environment variables read when a process or library starts (a fork would keep the
server's values), except those of :data:`READ_AT_RUN_TIME`."""

READ_AT_RUN_TIME = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONSAFEPATH"})
"""Set per launch and read after start-up: torch sets each thread's OpenMP team size from
``OMP_NUM_THREADS`` when the thread first computes; the other two are applied here."""

CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"

PIPE = subprocess.PIPE
STDOUT = subprocess.STDOUT
_MAX_MESSAGE = 1 << 20
_PR_SET_PDEATHSIG = 1


def forking() -> bool:
    """Whether tunekit's processes fork from a warm server (the default) or start afresh."""
    return os.environ.get(ENV, "fork") != "spawn" and sys.platform.startswith("linux")


def child_env() -> dict[str, str]:
    """The environment of the processes tunekit starts: this one's, torch's C++ log from
    errors up unless asked otherwise (read when torch loads: the same for every child, so
    that one server serves them all, and ``tunekit`` sets it for itself before torch loads,
    so that its server can be a fork of it: :func:`prepare`)."""
    env = dict(os.environ)
    env.setdefault(CPP_LOG_LEVEL, "ERROR")
    return env


def import_time_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a fork could not change."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(IMPORT_TIME_PREFIXES) and k not in READ_AT_RUN_TIME
        )
    )


# --------------------------------------------------------------------------- the server


def serve(sock: socket.socket) -> None:
    """Fork a process per request on ``sock`` until its other end closes."""
    for name in PRELOAD:
        importlib.import_module(name)
    launcher = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD wakes the poll
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl+C and stops ours
    children: dict[int, bool] = {}  # pid -> whether it ends with the caller
    # poll, not select: a caller with over 1024 files open passes a socket numbered past
    # what select can watch
    poller = select.poll()
    for fd in (sock.fileno(), wake_r):
        poller.register(fd, select.POLLIN)
    while os.getppid() == launcher:
        ready = [fd for fd, _ in poller.poll(1000)]
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap(sock, children)
        if sock.fileno() not in ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except ConnectionError:
            break
        if not msg:
            break  # the caller is gone
        request = json.loads(msg)
        try:
            pid = os.fork()
        except OSError as exc:
            _close(fds)
            sock.send(json.dumps({"error": str(exc)}).encode())
            continue
        if pid == 0:
            _become(request, fds, sock, (wake_r, wake_w))
        _close(fds)
        children[pid] = request["bound"]
        sock.send(json.dumps({"pid": pid}).encode())
    for pid, bound in children.items():  # the caller is gone: so is what it started
        if bound:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)


def _let_go_of_the_caller(keep: int) -> None:
    """In a server forked from its caller: drop what belongs to the caller, so that the
    processes it forks start as a fresh server's would."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():  # the caller's handlers (Ctrl+C, SIGTERM) are its own
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    # Its exit hooks and finalizers (a temporary folder's removal) are not ours to run.
    atexit._clear()
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.detach()
    # Its files, sockets and pipes: /dev/null in their place (numbers kept taken, so that the
    # caller's objects living on in memory never close one of ours).
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in (1, 2, keep, devnull):
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
    os.close(devnull)
    if sys.path and not sys.flags.safe_path:
        del sys.path[0]  # the caller's script folder: requests put their own folder there


def _reap(sock: socket.socket, children: dict[int, bool]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        try:
            sock.send(json.dumps({"exit": pid, "code": code}).encode())
        except OSError:
            pass


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _become(request: dict[str, Any], fds: list[int], sock: socket.socket, wake) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` as the request asks; never returns."""
    code: Any = 1
    try:
        os.setsid()
        if request["bound"]:  # else it outlives us, as a live job outlives its supervisor
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        signal.set_wakeup_fd(-1)
        sock.close()
        _close(list(wake))
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        _close([fd for fd in fds if fd > 2])
        env = request["env"]
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(env)
        if not env.get("PYTHONSAFEPATH"):  # the folder first, as `python -m` puts it
            sys.path.insert(0, request["cwd"])
        _standard_streams(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        module, sys.argv = request["module"], [request["module"], *request["args"]]
        sys.modules.pop(module, None)  # run afresh as __main__; its imports stay loaded
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            atexit._run_exitfuncs()
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code if isinstance(code, int) else 1)


def _standard_streams(unbuffered: bool) -> None:
    """``sys.stdin``/``stdout``/``stderr`` on file descriptors 0-2, buffered as a fresh Python's."""
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            errors="backslashreplace" if name == "stderr" else None,
            line_buffering=name == "stderr" or raw.isatty(),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)


def main() -> None:
    serve(socket.socket(fileno=int(sys.argv[1])))


# --------------------------------------------------------------------------- the caller's side


class WarmProcess:
    """A process the server forked: ``pid``, ``returncode`` (negative: killed by that signal) and
    ``wait()``, as asyncio's, and its ``stdin``/``stdout``/``stderr`` streams where piped."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    async def wait(self) -> int:
        while not self._ended.is_set():
            await asyncio.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


class _Server:
    """One server process and the thread that reads what it says."""

    def __init__(self, sock: socket.socket, pid: int, forked_here: bool):
        self.sock = sock
        self.pid = pid
        self.forked_here = forked_here
        self.alive = True
        self._lock = threading.Lock()  # one request at a time: its reply is the next "pid"
        self._replies: list[dict[str, Any]] = []
        self._replied = threading.Condition()
        self._procs: dict[int, WarmProcess] = {}
        self._early: dict[int, int] = {}  # exits read before their reply was handled
        threading.Thread(target=self._read, name="tunekit-warm-start", daemon=True).start()

    @classmethod
    def spawn(cls, env: dict[str, str]) -> _Server:
        """A fresh Python that imports what it preloads."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tunekit.trials.warm_start", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env={**env, "PYTHONSAFEPATH": "1"},
            )
        return cls(ours, proc.pid, forked_here=False)

    @classmethod
    def fork_here(cls) -> _Server:
        """A fork of this process, which has imported torch already (see :func:`prepare`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                _let_go_of_the_caller(keep=theirs.fileno())
                serve(theirs)
            finally:
                os._exit(0)
        theirs.close()
        return cls(ours, pid, forked_here=True)

    def wait(self) -> None:
        """Reap the server once it has ended."""
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:  # reaped already (a Popen's own bookkeeping)
            pass

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                msg = b""
            if not msg:
                break
            said = json.loads(msg)
            with self._replied:
                if "exit" in said:
                    proc = self._procs.pop(said["exit"], None)
                    if proc is None:
                        self._early[said["exit"]] = said["code"]
                    else:
                        proc._end(said["code"])
                else:
                    self._replies.append(said)
                    self._replied.notify_all()
        with self._replied:  # the server died: its children got SIGTERM from the kernel
            self.alive = False
            for proc in self._procs.values():
                proc._end(-signal.SIGTERM)
            self._procs.clear()
            self._replied.notify_all()
        self.wait()

    def fork(
        self,
        module: str,
        args: list[str],
        env: dict[str, str],
        fds: list[int],
        umask: int,
        bound: bool,
    ) -> int:
        request = {
            "bound": bound,
            "module": module,
            "args": args,
            "env": env,
            "cwd": os.getcwd(),
            "umask": umask,
        }
        with self._lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            with self._replied:
                while not self._replies and self.alive:
                    self._replied.wait()
                if not self._replies:
                    raise OSError("tunekit's process server died")
                reply = self._replies.pop(0)
        if "error" in reply:
            raise OSError(reply["error"])
        return int(reply["pid"])

    def track(self, proc: WarmProcess) -> None:
        with self._replied:
            if proc.pid in self._early:
                proc._end(self._early.pop(proc.pid))
            elif not self.alive:
                proc._end(-signal.SIGTERM)
            else:
                self._procs[proc.pid] = proc


_servers: dict[tuple[tuple[str, str], ...], _Server] = {}
_servers_lock = threading.Lock()


def _forget_servers() -> None:
    """In a forked child: the servers are the parent's (their sockets too), and the lock may
    have been held by the thread that forked (a server forks from its caller under it)."""
    global _servers_lock
    _servers.clear()
    _servers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_servers)


def _safe_to_fork_here() -> bool:
    """Whether this process can fork its own server: on its only thread (a fork copies just
    the calling thread: a lock another one held would stay locked for ever)."""
    return threading.current_thread() is threading.main_thread() and threading.active_count() == 1


def prepare() -> None:
    """Start this process's server now, as a fork of this process, if that is safe here.

    Commands call it once they have imported torch and before they start threads (a
    progress display, telemetry): the server then starts with what this process imported
    instead of importing it again (about 2 s of CPU). Elsewhere the first process started
    starts a server afresh.
    """
    if not forking():
        return
    key = import_time_env(child_env())
    with _servers_lock:
        if key in _servers and _servers[key].alive:
            return
        if key == import_time_env(os.environ) and _safe_to_fork_here():
            _servers[key] = _Server.fork_here()


def _server_for(env: dict[str, str]) -> _Server:
    key = import_time_env(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive:
            if key == import_time_env(os.environ) and _safe_to_fork_here():
                server = _Server.fork_here()
            else:
                server = _Server.spawn(env)
            _servers[key] = server
        return server


def _fork(
    module: str,
    args: list[str],
    env: dict[str, str],
    streams: tuple,
    umask: int | None,
    bound: bool = True,
) -> tuple[WarmProcess, list[tuple[str, int]]]:
    """Fork ``python -m MODULE ARGS``; the handle, and this side's ends of its pipes."""
    theirs: list[int] = []
    mine: list[tuple[str, int]] = []
    try:
        for fd, (name, how) in enumerate(zip(("stdin", "stdout", "stderr"), streams, strict=True)):
            if how == STDOUT:
                theirs.append(os.dup(theirs[1]))
            elif how == PIPE:
                r, w = os.pipe()
                theirs.append(r if name == "stdin" else w)
                mine.append((name, w if name == "stdin" else r))
            elif how == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_RDWR))
            else:
                theirs.append(os.dup(fd if how is None else how))
        server = _server_for(env)
        pid = server.fork(module, args, env, theirs, _umask() if umask is None else umask, bound)
    except BaseException:
        _close([fd for _, fd in mine])
        raise
    finally:
        _close(theirs)
    proc = WarmProcess(pid)
    server.track(proc)
    return proc, mine


def _umask() -> int:
    """This process's umask (a child inherits it: the server's may differ)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


async def start_module(
    module: str,
    args: list[str],
    *,
    env: dict[str, str],
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    limit: int = 2**16,
) -> WarmProcess:
    """``python -m MODULE ARGS`` in a session of its own, forked from a warm server.

    Each of ``stdin``/``stdout``/``stderr`` is as :func:`asyncio.create_subprocess_exec`
    takes it: :data:`PIPE` (a stream on the handle), ``DEVNULL``, a file descriptor, or
    None (this process's own); ``stderr`` may be :data:`STDOUT`.
    """
    loop = asyncio.get_running_loop()
    proc, mine = _fork(module, args, env, (stdin, stdout, stderr), None)
    for name, fd in mine:
        if name == "stdin":
            pipe = open(fd, "wb", buffering=0)  # noqa: SIM115 (the transport closes it)
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, pipe
            )
            proc.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        else:
            reader = asyncio.StreamReader(limit=limit, loop=loop)
            pipe = open(fd, "rb", buffering=0)  # noqa: SIM115 (the transport closes it)
            await loop.connect_read_pipe(partial(asyncio.StreamReaderProtocol, reader), pipe)
            setattr(proc, name, reader)
    return proc


class ForkedPopen:
    """:class:`subprocess.Popen`'s ``pid``, ``returncode``, ``poll()`` and ``wait(timeout)``
    for a process the server forked (no pipes)."""

    def __init__(self, proc: WarmProcess, cmd: list[str]):
        self._proc = proc
        self.pid = proc.pid
        self.args = cmd

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._proc._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self._proc.returncode is not None
        return self._proc.returncode


def popen_python(
    cmd: list[str], *, env: dict[str, str], stdout: int, stderr: int, umask: int
) -> subprocess.Popen | ForkedPopen:
    """:func:`start_python` for a caller without an event loop, its output to a file: as
    ``subprocess.Popen(cmd, ..., start_new_session=True, umask=umask)`` would start it, and,
    as that, it outlives this process (a live job outlives its supervisor)."""
    if forking() and cmd[:2] == [sys.executable, "-m"]:
        streams = (subprocess.DEVNULL, stdout, stderr)
        proc, _ = _fork(cmd[2], cmd[3:], env, streams, umask, bound=False)
        return ForkedPopen(proc, cmd)
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=env,
        start_new_session=True,
        umask=umask,
    )


async def start_python(
    cmd: list[str], *, env: dict[str, str], **streams: Any
) -> WarmProcess | asyncio.subprocess.Process:
    """Start ``cmd`` (``[sys.executable, "-m", MODULE, *ARGS]``) in a session of its own that
    ends when this process does: forked from a warm server (:func:`forking`), else afresh."""
    if forking() and cmd[:2] == [sys.executable, "-m"]:
        return await start_module(cmd[2], cmd[3:], env=env, **streams)
    return await asyncio.create_subprocess_exec(
        *die_with_parent(cmd), env=env, start_new_session=True, **streams
    )


# Runs before the command in the child's own process, then becomes it (exec keeps the
# death signal). Doing this in a pre-exec hook instead is unsafe in a process with
# threads (the TUI, telemetry), which Python's docs warn may deadlock.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('tunekit exited before the trial started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd``, made to get SIGTERM when this process exits, however it exits.

    On Linux only; elsewhere ``cmd`` is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


if __name__ == "__main__":
    main()
