"""The live job's control channel: newline-delimited JSON over a Unix socket.

Rank 0 serves the socket (mode 0600) in the run directory. Every request
carries the run's token (a 0600 file beside the socket) and is one JSON
object on one line; nothing is ever unpickled. Requests:

    {"token": T, "op": "status"}
    {"token": T, "op": "subscribe"}                      -> a stream of {"metric": {...}} lines
    {"token": T, "op": "apply", "config": {...}, "nproc": N?, "watch": W?}
    {"token": T, "op": "rollback"}
    {"token": T, "op": "trial", "config": {...}, "window": W?}
    {"token": T, "op": "stop"}
    {"token": T, "op": "pause", "reason": "..."?}       -> held until the client hangs up

Replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": "one line"}``.
Requests that change the job are queued and carried out by the training loop
at the next step boundary; the reply comes when they took effect.

A pause is a lease held by its connection: every rank waits at a step boundary
from the reply on, and training resumes when the client closes the connection
(or sends another line), so a tuner that dies can never leave the job paused.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import queue
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunekit.errors import ControlError

MAX_MESSAGE = 1 << 20  # one request line, at most 1 MiB
OPS = ("status", "subscribe", "apply", "rollback", "trial", "stop", "pause")
RESUME = "resume"  # queued by the server when a pause's connection ends; not a client op


def encode(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, default=str) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_MESSAGE:
        raise ValueError(f"message larger than {MAX_MESSAGE} bytes")
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("a request must be a JSON object")
    return obj


@dataclass
class Request:
    """A queued request for the training loop; ``reply`` is filled when it is done."""

    op: str
    body: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None

    def answer(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.done.set()


class ControlServer:
    """Rank 0's socket server. The training loop polls :meth:`next_request`."""

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
        self.socket_path.unlink(missing_ok=True)
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                server._handle(self.rfile, self.wfile)

        old = os.umask(0o177)  # the socket is created 0600
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(self.socket_path), Handler)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="tunekit-control", daemon=True)
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

    def close(self, wait_s: float = 10.0) -> None:
        """Stop serving; answer what is queued; let every reply reach its client first."""
        self._closing.set()
        self._server.shutdown()
        while True:  # nobody will carry these out any more
            req = self.next_request()
            if req is None:
                break
            req.answer({"ok": False, "error": "the job stopped before the request was carried out"})
        with self._written:
            self._written.wait_for(lambda: self._unwritten == 0, timeout=wait_s)
        self._server.server_close()
        self.socket_path.unlink(missing_ok=True)

    # -- connection side -----------------------------------------------------------------

    def _handle(self, rfile, wfile) -> None:
        line = rfile.readline(MAX_MESSAGE + 1)
        try:
            msg = decode(line)
        except ValueError as exc:
            wfile.write(encode({"ok": False, "error": str(exc)}))
            return
        token = msg.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
            wfile.write(encode({"ok": False, "error": "wrong or missing token"}))
            return
        op = msg.get("op")
        if op not in OPS:
            wfile.write(encode({"ok": False, "error": f"unknown op {op!r}; one of {', '.join(OPS)}"}))
            return
        if op == "status":
            wfile.write(encode({"ok": True, **self.status()}))
            return
        if op == "subscribe":
            self._stream(wfile)
            return
        problem = self.validate(msg)
        if problem:
            wfile.write(encode({"ok": False, "error": problem}))
            return
        req = Request(op, msg)
        with self._lock:
            self._unwritten += 1
        try:
            self.requests.put(req)
            if req.done.wait(self.reply_timeout_s):
                wfile.write(encode(req.reply))
                wfile.flush()
            else:
                wfile.write(encode({"ok": False, "error": "timed out waiting for the job"}))
        finally:
            with self._written:
                self._unwritten -= 1
                self._written.notify_all()
            if op == "pause":
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
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        finally:
            with self._lock:
                self._subscribers.remove(q)


class ControlClient:
    """Talks to a run's control socket."""

    def __init__(self, socket_path: Path, token: str, timeout_s: float = 600.0):
        self.socket_path = Path(socket_path)
        self.token = token
        self.timeout_s = timeout_s

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise ControlError(f"the run is not running (no control socket at {self.socket_path})") from None
        return sock

    def request(self, op: str, **body: Any) -> dict[str, Any]:
        """Send one request and return the reply; a refusal raises ControlError."""
        reply = self.raw({"token": self.token, "op": op, **body})
        if not reply.get("ok"):
            raise ControlError(reply.get("error", "request refused"))
        return reply

    def raw(self, message: dict[str, Any] | bytes) -> dict[str, Any]:
        """Send a message as given (tests use this for malformed input)."""
        data = message if isinstance(message, bytes) else encode(message)
        with self._connect() as sock:
            sock.sendall(data if data.endswith(b"\n") else data + b"\n")
            with sock.makefile("rb") as f:
                line = f.readline(MAX_MESSAGE + 1)
        if not line:
            raise ControlError("the job closed the connection without a reply")
        return decode(line)

    @contextlib.contextmanager
    def paused(self, reason: str = "") -> Iterator[dict[str, Any]]:
        """Hold the job at a step boundary for the ``with`` block; it resumes on exit.

        The pause lives as long as this connection: if this process dies, the
        job resumes by itself. Yields the reply (``paused_at``: the step).
        """
        with self._connect() as sock:
            sock.sendall(encode({"token": self.token, "op": "pause", "reason": reason}))
            with sock.makefile("rb") as f:
                reply = decode(f.readline(MAX_MESSAGE + 1) or b'{"ok": false, "error": "the job closed the connection"}')
                if not reply.get("ok"):
                    raise ControlError(reply.get("error", "pause refused"))
                sock.settimeout(None)  # held for as long as the block runs
                yield reply
                with contextlib.suppress(OSError):
                    sock.sendall(b"\n")  # resume now, not when the socket is collected

    def subscribe(self) -> Iterator[dict[str, Any]]:
        """Metrics as the job produces them, until the job stops."""
        with self._connect() as sock:
            sock.sendall(encode({"token": self.token, "op": "subscribe"}))
            with sock.makefile("rb") as f:
                first = decode(f.readline(MAX_MESSAGE + 1) or b"{}")
                if not first.get("ok"):
                    raise ControlError(first.get("error", "subscription refused"))
                for line in f:
                    yield decode(line)["metric"]
