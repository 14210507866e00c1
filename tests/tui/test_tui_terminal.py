"""The real `tunekit tui` command in a pseudo-terminal: it draws at the terminal's size and
follows a resize (issue 19: it drew 80×24 whatever the terminal, once its descriptor 1
pointed at the log).

The terminal is emulated with pyte, so the checks read the screen a user would see. The
app attaches to a run directory as `tunekit run` writes it (no job: nothing to wait for
but the app itself), and the pseudo-terminal is the command's controlling terminal, so a
resize reaches it as SIGWINCH from the kernel, as in a real terminal.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from tunekit.runtime.rundir import RunDir

pyte = pytest.importorskip("pyte")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def set_size(fd: int, columns: int, lines: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))


def take_terminal() -> None:
    """In the child: a session of its own with the pseudo-terminal as controlling terminal."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """``tunekit tui`` on a pseudo-terminal, its output fed to an emulated screen."""

    def __init__(self, args: list[str], columns: int, lines: int, cwd):
        self.main, child = pty.openpty()
        set_size(child, columns, lines)
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env["TERM"] = "xterm-256color"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tunekit", "tui", *args],
            cwd=cwd,
            stdin=child,
            stdout=child,
            stderr=child,
            env=env,
            preexec_fn=take_terminal,
        )
        os.close(child)
        self.screen = pyte.Screen(columns, lines)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = b""

    @property
    def lines(self) -> list[str]:
        return self.screen.display

    def read(self, timeout: float = 0.2) -> None:
        ready, _, _ = select.select([self.main], [], [], timeout)
        if ready:
            try:
                data = os.read(self.main, 65536)
            except OSError:
                return
            self.raw += data
            self.stream.feed(data)

    def until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                screen = "\n".join(self.lines)
                raise AssertionError(f"{what} not seen; the screen:\n{screen}")
            self.read()

    def resize(self, columns: int, lines: int) -> None:
        self.screen.resize(lines, columns)
        set_size(self.main, columns, lines)  # the kernel sends SIGWINCH to the command

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        os.close(self.main)


def fills(term: Terminal) -> bool:
    """The app covers the whole emulated screen: the title is centred on the top line,
    the footer (with Help and Quit) is on the last, and the live screen is drawn between."""
    lines = term.lines
    top, bottom = lines[0], lines[-1]
    # The header centres "tunekit — <workload> · run <id>" (the part after the title
    # appears once the job is read), right of the header's icon.
    start = top.find("tunekit")
    end = len(top.rstrip())
    width = term.screen.columns
    return (
        start >= 0
        and abs((start + end) / 2 - width / 2) <= 2
        and "? Help" in bottom
        and "q Quit" in bottom
        and any("samples/s" in line for line in lines[1:-1])
    )


@pytest.fixture
def attachable(tmp_path, fixed):
    """A run directory with the files a live job writes (the app attaches to it)."""
    store = tmp_path / ".tunekit"
    rd = RunDir.create(
        store, {"workload": "example:cnn", "nproc": 2, "config": fixed.BASE}, name="job"
    )
    rd.write_status(fixed.status(40))
    rd.metrics_file.write_text("".join(json.dumps(m) + "\n" for m in fixed.metrics(40)))
    return store


SIZES = [(80, 24), (120, 35), (200, 50), (80, 24)]
"""The terminal's sizes, in turn: each resize from one to the next, larger and smaller."""


def test_the_app_fills_the_terminal_and_follows_a_resize(attachable, tmp_path):
    # One command, resized from each size to the next: every resize is a SIGWINCH the app
    # follows in the same run (the app starting at each size is the first step of each).
    first, *others = SIZES
    term = Terminal(["--attach", "job", "--store", str(attachable)], *first, cwd=tmp_path)
    try:
        term.until(lambda: fills(term), 300, f"the app filling {first[0]}×{first[1]}")
        for size in others:
            term.resize(*size)
            term.until(lambda: fills(term), 60, f"the app redrawn at {size[0]}×{size[1]}")
        os.write(term.main, b"q")
        deadline = time.monotonic() + 60
        while term.proc.poll() is None and time.monotonic() < deadline:
            term.read()
        assert term.proc.returncode == 0
    finally:
        term.close()
