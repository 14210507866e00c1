"""The live job's control channel: newline-delimited JSON over a Unix socket.

Rank 0 serves the socket (mode 0600) in the run directory, or in a private
folder when that path is too long for a socket. Every request carries the
run's token (a 0600 file in the run directory) and is one JSON object on one
line; nothing is ever unpickled. A client sends the token only to a socket its
own user owns and serves. Requests (every field is checked, unknown ones refused):

    {"token": T, "op": "status"}
    {"token": T, "op": "subscribe"}                      -> a stream of {"metric": {...}} lines
    {"token": T, "op": "apply", "config": {...}, "nproc": N?, "watch": W?}
    {"token": T, "op": "rollback"}
    {"token": T, "op": "trial", "config": {...}, "window": W?}
    {"token": T, "op": "stop"}
    {"token": T, "op": "pause", "reason": "..."?}       -> held until the client hangs up

Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}``.
Requests that change the job are queued and carried out by the training loop
at the next step boundary; the reply comes when they took effect. A request
still queued when the job exits to be relaunched (a new world size) is answered
``{"ok": false, "relaunching": true, "nproc": N, "error": ...}``: it was not
carried out, and the relaunched job will take it again.

A connection must send its request within ``READ_TIMEOUT_S`` (``CROWDED_READ_TIMEOUT_S``
while over half the connections are taken, so that idle ones cannot keep the
job's owner out for long); at most
``MAX_CONNECTIONS`` are served at once and the rest are told the job is busy
(clients retry), so no client can starve the training rank of threads or files.

A pause is a lease held by its connection: every rank waits at a step boundary
from the reply on, and training resumes when the client closes the connection
(or sends another line), so a tuner that dies can never leave the job paused.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import os
import queue
import socket
import socketserver
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tunekit.errors import ControlError

MAX_MESSAGE = 1 << 20  # one request line, at most 1 MiB
MAX_DIGITS = 30  # an integer in a request (no knob needs more)
MAX_CONNECTIONS = 64  # served at once; more are told the job is busy
BACKLOG = 256  # connections the kernel queues before the server accepts them
READ_TIMEOUT_S = 10.0  # for the request line; a client that says nothing is dropped
CROWDED_READ_TIMEOUT_S = 1.0  # the same while over half the connections are taken
OPS = ("status", "subscribe", "apply", "rollback", "trial", "stop", "pause")
RESUME = "resume"  # queued by the server when a pause's connection ends; not a client op
BUSY = "busy"  # the start of the refusal a client may retry


class JobNotRunning(ControlError):
    """No job serves the run's socket (it stopped, crashed, or has not started)."""


TRY_AGAIN = 75
"""The exit code of a request the job could not take now but will soon (sysexits' EX_TEMPFAIL)."""


class JobRelaunching(ControlError):
    """The job is between launches (a new world size): its relaunched job takes requests."""

    exit_code = TRY_AGAIN

    def __init__(self, nproc: int | None):
        self.nproc = nproc
        to = f" (to {nproc} rank(s))" if nproc else ""
        super().__init__(f"the job is relaunching{to}; try again in a moment")


def encode(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, default=str) + "\n").encode()


class _Refused(ValueError):
    """A request that is not acceptable JSON for this channel."""


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"number {text[:20]} is out of range")
    return value


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _Refused(
            f"an integer with {len(text)} characters has too many digits (at most {MAX_DIGITS})"
        )
    return int(text)


def decode(line: bytes) -> dict[str, Any]:
    """One request or reply line as a dict; ValueError with one line when it is not one.

    Strict JSON: no NaN or Infinity, no float that overflows, no integer longer
    than any request needs, no nesting deeper than the parser's stack.
    """
    if len(line) > MAX_MESSAGE:
        raise ValueError(f"message larger than {MAX_MESSAGE} bytes")
    try:
        obj = json.loads(
            line, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_short_int
        )
    except _Refused as exc:
        raise ValueError(f"malformed JSON: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise ValueError("malformed JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("a request must be a JSON object")
    return obj


@dataclass(frozen=True)
class Field:
    """One field of a request: its JSON type, and its range or length."""

    kind: type
    required: bool = False
    low: int | None = None
    high: int | None = None
    max_len: int | None = None

    def problem(self, name: str, value: Any) -> str | None:
        if self.kind is int:
            assert self.low is not None and self.high is not None  # int fields declare a range
            ok = (
                isinstance(value, int)
                and not isinstance(value, bool)
                and self.low <= value <= self.high
            )
            return (
                None
                if ok
                else f"{name} must be an integer between {self.low} and {self.high}, not {value!r:.40}"
            )
        if self.kind is str:
            assert self.max_len is not None  # string fields declare a length
            if not isinstance(value, str):
                return f"{name} must be a string, not {value!r:.40}"
            return (
                None
                if len(value) <= self.max_len
                else f"{name} is longer than {self.max_len} characters"
            )
        return None if isinstance(value, dict) else f"{name} must be an object, not {value!r:.40}"


REQUEST_FIELDS: dict[str, dict[str, Field]] = {
    "status": {},
    "subscribe": {},
    "rollback": {},
    "stop": {},
    "pause": {"reason": Field(str, max_len=1000)},  # status shows the first 200 characters
    "apply": {
        "config": Field(dict, required=True),
        "nproc": Field(int, low=1, high=1024),
        "watch": Field(int, low=2, high=10_000),
    },
    "trial": {"config": Field(dict, required=True), "window": Field(int, low=2, high=10_000)},
}
"""Every field each op takes besides ``token`` and ``op``; anything else is refused."""


def check_fields(msg: dict[str, Any]) -> str | None:
    """Why ``msg`` (with a known op) is not a well-formed request, or None."""
    fields = REQUEST_FIELDS[msg["op"]]
    for name in msg:
        if name not in fields and name not in ("token", "op"):
            allowed = ", ".join(fields) or "none"
            return f"unknown field {name!r:.40} for {msg['op']} (it takes: {allowed})"
    for name, f in fields.items():
        if name not in msg:
            if f.required:
                return f"missing field {name!r} for {msg['op']}"
            continue
        problem = f.problem(name, msg[name])
        if problem:
            return problem
    return None


def _same_token(given: Any, expected: str) -> bool:
    if not isinstance(given, str):
        return False
    # As bytes: compare_digest refuses non-ASCII text, and JSON may carry lone surrogates.
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


@dataclass
class Request:
    """A queued request for the training loop; ``reply`` is filled when it is done."""

    op: str
    body: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    written: threading.Event = field(default_factory=threading.Event)
    """Set once the reply was written to the client (or could not be)."""

    def answer(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.done.set()


class _Server(socketserver.ThreadingUnixStreamServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` of them; no tracebacks.

    Over the limit a connection is told the job is busy and closed at once, so
    that no number of clients, idle or not, can use up the rank's file
    descriptors or threads (a training rank that cannot open a file crashes).
    """

    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG

    def __init__(self, path: str, handler: type[socketserver.BaseRequestHandler]):
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._count_lock = threading.Lock()
        self.active = 0  # connections holding a slot
        super().__init__(path, handler)

    def process_request(self, request, client_address) -> None:
        if not self._take_slot():
            with contextlib.suppress(OSError):
                request.settimeout(0.5)
                request.sendall(
                    encode(
                        {
                            "ok": False,
                            "error": f"{BUSY}: {MAX_CONNECTIONS} connections are open; try again",
                        }
                    )
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread was started to give the slot back
            self._give_slot()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_slot()

    def _take_slot(self) -> bool:
        if not self.slots.acquire(blocking=False):
            return False
        with self._count_lock:
            self.active += 1
        return True

    def _give_slot(self) -> None:
        with self._count_lock:
            self.active -= 1
        self.slots.release()

    @property
    def read_timeout(self) -> float:
        """How long a new connection may take to send its request."""
        return CROWDED_READ_TIMEOUT_S if self.active > MAX_CONNECTIONS // 2 else READ_TIMEOUT_S

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away or stopped reading: nothing to say
            return
        print(
            f"tunekit control: a request failed ({type(exc).__name__}: {exc})"[:300],
            file=sys.stderr,
            flush=True,
        )


class ControlServer:
    """Rank 0's socket server. The training loop polls :meth:`next_request`.

    ``socket_path`` must lie in a folder only this user can write (see
    :meth:`tunekit.runtime.rundir.RunDir.choose_socket_path`): nobody else can
    then replace the socket, or a symlink to it, between bind and use.
    """

    def __init__(
        self,
        socket_path: Path,
        token: str,
        status: Callable[[], dict[str, Any]],
        validate: Callable[[dict[str, Any]], str | None],
        reply_timeout_s: float = 600.0,
    ):
        self.socket_path = Path(socket_path)
        self.token = token
        self.status = status
        self.validate = validate
        self.reply_timeout_s = reply_timeout_s
        self.requests: queue.Queue[Request] = queue.Queue()
        self._subscribers: list[queue.Queue] = []
        self._lock = threading.Lock()
        self._unwritten = 0  # replies decided but not yet sent
        self._written = threading.Condition(self._lock)
        self._closing = threading.Event()
        self._unanswered: dict[str, Any] | None = None  # the reply to requests once closed
        self.socket_path.unlink(missing_ok=True)
        server = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = READ_TIMEOUT_S

            def setup(self) -> None:
                # Per connection, shorter while crowded (typeshed calls it a ClassVar, but
                # StreamRequestHandler reads it from the instance).
                self.timeout = cast(_Server, self.server).read_timeout  # type: ignore[misc]
                super().setup()

            def handle(self) -> None:
                server._handle(self.connection, self.rfile, self.wfile)

        old = os.umask(
            0o177
        )  # the socket is created 0600 (no chmod after: it would follow a symlink)
        try:
            self._server = _Server(str(self.socket_path), Handler)
        finally:
            os.umask(old)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="tunekit-control", daemon=True
        )
        self._thread.start()

    # -- loop side ---------------------------------------------------------------------

    def next_request(self) -> Request | None:
        try:
            return self.requests.get_nowait()
        except queue.Empty:
            return None

    def publish(self, metric: dict[str, Any]) -> None:
        with self._lock:
            for q in self._subscribers:
                with contextlib.suppress(queue.Full):
                    q.put_nowait(metric)

    def close(self, wait_s: float = 10.0, relaunching_to: int | None = None) -> None:
        """Stop serving; answer what is queued; let every reply reach its client first.

        ``relaunching_to``: the job exits to be relaunched on that many ranks, so what is
        queued is told so (the relaunched job takes it), not that the job stopped.
        """
        self._closing.set()
        self._server.shutdown()
        if relaunching_to is None:
            unanswered = {
                "ok": False,
                "error": "the job stopped before the request was carried out",
            }
        else:
            unanswered = {
                "ok": False,
                "error": str(JobRelaunching(relaunching_to)),
                "relaunching": True,
                "nproc": relaunching_to,
            }
        with self._lock:  # a connection still reading its request is answered the same
            self._unanswered = unanswered
            while True:  # nobody will carry these out any more
                req = self.next_request()
                if req is None:
                    break
                req.answer(unanswered)
        with self._written:
            self._written.wait_for(lambda: self._unwritten == 0, timeout=wait_s)
        self._server.server_close()
        with contextlib.suppress(OSError):  # a folder that became read-only keeps a dead socket
            self.socket_path.unlink(missing_ok=True)

    # -- connection side -----------------------------------------------------------------

    def _handle(self, conn: socket.socket, rfile, wfile) -> None:
        try:
            line = rfile.readline(MAX_MESSAGE + 1)
        except TimeoutError:
            wfile.write(
                encode({"ok": False, "error": f"no request within {conn.gettimeout():.0f} s"})
            )
            return
        try:
            msg = decode(line)
        except ValueError as exc:
            wfile.write(encode({"ok": False, "error": str(exc)}))
            return
        if not _same_token(msg.get("token"), self.token):
            wfile.write(encode({"ok": False, "error": "wrong or missing token"}))
            return
        op = msg.get("op")
        if op not in OPS:
            wfile.write(
                encode({"ok": False, "error": f"unknown op {op!r:.40}; one of {', '.join(OPS)}"})
            )
            return
        problem = check_fields(msg)
        if problem is None and op not in ("status", "subscribe"):
            try:
                problem = self.validate(msg)
            except Exception as exc:  # a plugin's own check broke: refuse, and keep serving
                problem = f"cannot check the request: {type(exc).__name__}: {exc}"
        if problem:
            wfile.write(encode({"ok": False, "error": " ".join(problem.split())[:300]}))
            return
        if op == "status":
            wfile.write(encode({"ok": True, **self.status()}))
            return
        if op == "subscribe":
            self._stream(wfile)
            return
        req = Request(op, msg)
        with self._lock:
            if self._unanswered is None:
                self.requests.put(req)
            else:  # the loop is gone: nobody would take it from the queue
                req.answer(self._unanswered)
            self._unwritten += 1
        try:
            if req.done.wait(self.reply_timeout_s):
                assert req.reply is not None  # done is set by answer()
                wfile.write(encode(req.reply))
                wfile.flush()
            else:
                wfile.write(encode({"ok": False, "error": "timed out waiting for the job"}))
        finally:
            with self._written:
                self._unwritten -= 1
                self._written.notify_all()
            req.written.set()
            if op == "pause":
                conn.settimeout(None)  # held for as long as the client keeps the connection
                self._hold(req, rfile, granted=bool(req.reply and req.reply.get("ok")))

    def _hold(self, req: Request, rfile, granted: bool) -> None:
        """Keep a granted pause until the client hangs up (or writes); then resume.

        The resume names its pause, so it lifts that one only. It is queued even
        when the pause was not granted in time: the loop may still carry the
        pause out later, and nobody else would lift it.
        """
        if granted:
            with contextlib.suppress(OSError, ValueError):
                rfile.readline(MAX_MESSAGE + 1)
        self.requests.put(Request(RESUME, {"of": req}))

    def _stream(self, wfile) -> None:
        q: queue.Queue = queue.Queue(maxsize=10_000)
        with self._lock:
            self._subscribers.append(q)
        try:
            wfile.write(encode({"ok": True, "subscribed": True}))
            wfile.flush()
            while not self._closing.is_set():
                try:
                    item = q.get(timeout=0.5)
                except queue.Empty:
                    continue
                wfile.write(encode({"metric": item}))
                wfile.flush()
        except OSError:  # the subscriber went away
            pass
        finally:
            with self._lock:
                self._subscribers.remove(q)


def check_socket_owner(path: Path) -> None:
    """Refuse a socket that is not this user's own (another user could read the token)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise JobNotRunning(f"the run is not running (no control socket at {path})") from None
    except OSError as exc:
        raise ControlError(f"cannot reach the control socket {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlError(f"{path} is not a socket; not sending the run's token there")
    if st.st_uid != os.geteuid():
        raise ControlError(
            f"control socket {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
            "not sending the run's token there"
        )


def check_peer(sock: socket.socket, path: Path) -> None:
    """Refuse a connection whose server runs as another user (Linux: SO_PEERCRED)."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return
    _, uid, _ = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
    )
    if uid != os.geteuid():
        raise ControlError(
            f"the process serving {path} runs as uid {uid}, not as you (uid {os.geteuid()}); "
            "not sending the run's token there"
        )


class ControlClient:
    """Talks to a run's control socket, and only to one its own user serves."""

    def __init__(self, socket_path: Path, token: str, timeout_s: float = 600.0):
        self.socket_path = Path(socket_path)
        self.token = token
        self.timeout_s = timeout_s

    def _connect(self, deadline: float) -> socket.socket:
        """A connection to the job's own socket, retried while its queue is full."""
        check_socket_owner(self.socket_path)
        delay = 0.01
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.socket_path))
                check_peer(sock, self.socket_path)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                raise JobNotRunning(
                    f"the run is not running (no control socket at {self.socket_path})"
                ) from None
            except BlockingIOError:  # the listen queue is full: the job is busy, not gone
                sock.close()
            except OSError as exc:
                sock.close()
                raise ControlError(f"cannot reach the job at {self.socket_path}: {exc}") from None
            except BaseException:
                sock.close()
                raise
            if time.monotonic() + delay > deadline:
                raise ControlError(f"the job at {self.socket_path} stayed too busy to connect to")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    @contextlib.contextmanager
    def _open(self, message: bytes) -> Iterator[tuple[socket.socket, Any, dict[str, Any]]]:
        """Connect, send ``message``, read the first reply; a busy job is tried again."""
        deadline = time.monotonic() + min(self.timeout_s, 60.0)
        delay = 0.05
        while True:
            sock = self._connect(deadline)
            with sock, sock.makefile("rb") as f:
                try:
                    try:
                        sock.sendall(message if message.endswith(b"\n") else message + b"\n")
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # a busy job answers and hangs up unread: its reply is still there to read
                    line = f.readline(MAX_MESSAGE + 1)
                except TimeoutError:
                    raise ControlError(
                        f"the job did not answer within {self.timeout_s:.0f} s"
                    ) from None
                except OSError as exc:
                    line = b""
                    if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                        raise ControlError(f"lost the connection to the job: {exc}") from None
                if not line:
                    raise ControlError("the job closed the connection without a reply")
                try:
                    reply = decode(line)
                except ValueError as exc:
                    raise ControlError(f"the job sent a reply that is not JSON ({exc})") from None
                busy = not reply.get("ok") and str(reply.get("error", "")).startswith(BUSY)
                if not busy:
                    yield sock, f, reply
                    return
            if time.monotonic() + delay > deadline:
                raise ControlError(str(reply.get("error")))
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def request(self, op: str, **body: Any) -> dict[str, Any]:
        """Send one request and return the reply; a refusal raises ControlError."""
        reply = self.raw({"token": self.token, "op": op, **body})
        if not reply.get("ok"):
            if reply.get("relaunching"):  # not carried out: the job exited for a relaunch
                raise JobRelaunching(reply.get("nproc"))
            raise ControlError(reply.get("error", "request refused"))
        return reply

    def raw(self, message: dict[str, Any] | bytes) -> dict[str, Any]:
        """Send a message as given (tests use this for malformed input)."""
        data = message if isinstance(message, bytes) else encode(message)
        with self._open(data) as (_, _, reply):
            return reply

    @contextlib.contextmanager
    def paused(self, reason: str = "") -> Iterator[dict[str, Any]]:
        """Hold the job at a step boundary for the ``with`` block; it resumes on exit.

        The pause lives as long as this connection: if this process dies, the
        job resumes by itself. Yields the reply (``paused_at``: the step).
        """
        with self._open(encode({"token": self.token, "op": "pause", "reason": reason})) as (
            sock,
            _,
            reply,
        ):
            if not reply.get("ok"):
                if reply.get("relaunching"):
                    raise JobRelaunching(reply.get("nproc"))
                raise ControlError(reply.get("error", "pause refused"))
            sock.settimeout(None)  # held for as long as the block runs
            yield reply
            with contextlib.suppress(OSError):
                sock.sendall(b"\n")  # resume now, not when the socket is collected

    def subscribe(self) -> Iterator[dict[str, Any]]:
        """Metrics as the job produces them, until the job stops."""
        with self._open(encode({"token": self.token, "op": "subscribe"})) as (sock, f, first):
            if not first.get("ok"):
                raise ControlError(first.get("error", "subscription refused"))
            for line in f:
                yield decode(line)["metric"]
