"""How a process ended, in words: what trials and observation say about a process that failed.

Facts only: an exit status from ``waitpid`` (negative for a signal, as
:mod:`subprocess` and torchrun report it), the Python stack that
:mod:`faulthandler` writes when a process dies of a fatal signal, and the type
of the exception a process caught. Nothing here reads a process's log.
"""

from __future__ import annotations

import faulthandler
import re
import signal
import sysconfig
from pathlib import Path
from typing import IO

_MEANING = {
    "SIGSEGV": "segmentation fault",
    "SIGBUS": "bus error",
    "SIGABRT": "aborted",
    "SIGFPE": "arithmetic fault",
    "SIGILL": "illegal instruction",
    "SIGKILL": "killed: out of memory (the kernel's OOM killer) or kill -9",
    "SIGTERM": "terminated",
    "SIGINT": "interrupted",
    "SIGPIPE": "broken pipe",
}


def signal_name(returncode: int | None) -> str | None:
    """``SIGSEGV`` for a process that died of that signal (``returncode`` -11), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def describe_exit(returncode: int | None) -> str:
    """``died of SIGSEGV (segmentation fault)``, ``exited with code 3``, ``is still running``."""
    if returncode is None:
        return "is still running"
    name = signal_name(returncode)
    if name is None:
        return f"exited with code {returncode}"
    meaning = _MEANING.get(name)
    return f"died of {name}" + (f" ({meaning})" if meaning else "")


_CUDA_MEMORY_ALLOCATION = 2
"""``cudaErrorMemoryAllocation`` (and ``hipErrorOutOfMemory``): a ``torch.AcceleratorError``'s code."""


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is an allocation failure, by its type: never by words in its
    message or a log (a workload may print "out of memory" and run fine)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    if (
        isinstance(exc, torch.AcceleratorError)
        and getattr(exc, "error_code", None) == _CUDA_MEMORY_ALLOCATION
    ):
        return True
    # cuBLAS failing to allocate its workspace reaches Python as a plain RuntimeError with this status.
    return type(exc) is RuntimeError and "CUBLAS_STATUS_ALLOC_FAILED" in str(exc)


def enable_fault_report(path: Path) -> IO[str]:
    """Have this process write its Python stack to ``path`` if it dies of SIGSEGV, SIGBUS,
    SIGABRT, SIGFPE or SIGILL (faulthandler keeps the file open)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "w")  # noqa: SIM115 - faulthandler holds it for the life of the process
    faulthandler.enable(file=file, all_threads=False)
    return file


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<fn>\S+)')


def fault_location(path: Path) -> str | None:
    """Where the process died, from its fault report: ``workloads.py:110 in _segfault``,
    or None when it wrote none.

    The innermost frame outside Python's own library (``ctypes.string_at`` says less
    than the line that called it); the innermost frame when all are in it.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [
        m for line in text.splitlines() if (m := _FRAME.match(line))
    ]  # most recent call first
    if not frames:
        return None
    m = next((f for f in frames if not f["file"].startswith(stdlib)), frames[0])
    return f"{Path(m['file']).name}:{m['line']} in {m['fn']}"
