"""Python stacks of every rank, sampled with ``py-spy dump``, summarised into hot spots.

Each sample runs ``py-spy dump --pid PID --json --nonblocking`` once per rank
(``--nonblocking``: the rank is read, not paused, so sampling does not slow it
down). The summary counts, over the main thread's samples, the innermost
Python frame (top functions) and a category per sample:

* ``data_loading``   a frame in ``torch/utils/data``, a dataset's ``__getitem__``,
  a collate function, or tunekit's batch source;
* ``optimizer_step`` a frame in ``torch/optim``;
* ``python``         running Python in the loop (the thread holds the GIL: PyTorch
  releases it inside its ops, so a GIL-holding sample is interpreter work);
* ``native``         inside a PyTorch op or other native code (GIL released);
* ``idle``           not running (waiting on a lock, a collective, I/O).

Only samples taken inside the training loop count, once a rank has any: a
frame named like a loop (``train_step``, ``training_step``, ``_train``,
``train_one_epoch``) marks them, so process start-up (imports, building the
model) does not pollute the hot spots. Samples inside tunekit's own
instrumentation (torch.profiler writing a trial's trace) are left out: they are
the measurement, not the job. A category above ``flag_fraction`` of the samples
is flagged (data loading, optimizer step, Python overhead), once there are
:data:`MIN_FLAG_SAMPLES` samples to judge from. Without py-spy, or where the
kernel forbids reading another process (ptrace), the source says so once and
samples nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_DENIED = (
    "permission denied",
    "operation not permitted",
    "ptrace",
    "eperm",
    "elevated permissions",
)
_DATA_FILES = ("torch/utils/data", "tunekit/runtime/data.py")
_DATA_FUNCS = ("__getitem__", "__getitems__", "collate", "default_collate", "make_batch")
_OPTIM_FILES = ("torch/optim/",)
_OWN_FILES = ("torch/profiler/", "torch/autograd/profiler")
_OWN_FUNCS = ("export_chrome_trace",)
MIN_FLAG_SAMPLES = 30
"""Fewer samples flag nothing: at 6 samples one stray stack is 17%."""
LOOP_FUNCS = ("train_step", "training_step", "_train", "train_one_epoch")
"""Function names that mark a stack as inside the training loop."""


def find_pyspy() -> str | None:
    """The py-spy executable: next to this Python (a venv) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


class PySpySource:
    """Dumps each rank's stacks; unavailable (with a notice) without py-spy or permission."""

    name = "pyspy"

    def __init__(self, exe: str | None = None, timeout_s: float = 5.0, nonblocking: bool = True):
        self.exe = exe or find_pyspy()
        self.timeout_s = timeout_s
        self.nonblocking = nonblocking
        self.available = self.exe is not None
        self.notice = "" if self.available else "py-spy not found; no Python stack samples"
        self.static: dict[str, Any] = {"exe": self.exe, "nonblocking": nonblocking}
        self.errors = 0
        self.last_error = ""

    def dump(self, pid: int) -> list[dict[str, Any]] | None:
        """The threads of ``pid`` as py-spy reports them, or None (error recorded)."""
        assert self.exe is not None, "py-spy not found (check .available before dumping)"
        cmd = [self.exe, "dump", "--pid", str(pid), "--json"]
        if self.nonblocking:
            cmd.append("--nonblocking")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._error(str(exc))
            return None
        if out.returncode != 0:
            err = (out.stderr or out.stdout).strip().splitlines()
            self._error(err[0] if err else f"exit {out.returncode}")
            return None
        try:
            return json.loads(out.stdout)
        except json.JSONDecodeError as exc:
            self._error(f"unreadable output: {exc}")
            return None

    def _error(self, message: str) -> None:
        self.errors += 1
        self.last_error = message
        if any(d in message.lower() for d in _DENIED):
            self.available = False
            self.notice = (
                f"py-spy is not permitted to read the ranks' memory ({message}); "
                "no Python stack samples (run as the ranks' user with ptrace allowed, "
                "e.g. kernel.yama.ptrace_scope=0 or CAP_SYS_PTRACE)"
            )

    def sample(self, pids: Mapping[int, int]) -> dict[str, Any] | None:
        if not self.available:
            return None
        ranks = {}
        for rank, pid in sorted(pids.items()):
            threads = self.dump(pid)
            if not self.available:
                return None
            if threads is None:
                continue
            ranks[str(rank)] = {"pid": pid, "threads": [_thread(t, pid) for t in threads]}
        return {"ranks": ranks}

    def close(self) -> None:
        pass


def _thread(t: Mapping[str, Any], pid: int) -> dict[str, Any]:
    frames = [
        {
            "name": f.get("name", "?"),
            "file": f.get("filename") or f.get("short_filename") or "?",
            "line": f.get("line"),
        }
        for f in t.get("frames", [])
    ]
    return {
        "main": t.get("os_thread_id") == pid or t.get("thread_name") == "MainThread",
        "name": t.get("thread_name"),
        "active": bool(t.get("active")),
        "owns_gil": bool(t.get("owns_gil")),
        "frames": frames,  # innermost first
    }


def classify(thread: Mapping[str, Any]) -> str:
    """The category of one thread sample (see the module docstring)."""
    frames = thread["frames"]
    if any(any(d in f["file"] for d in _DATA_FILES) or f["name"] in _DATA_FUNCS for f in frames):
        return "data_loading"
    if any(any(o in f["file"] for o in _OPTIM_FILES) for f in frames):
        return "optimizer_step"
    if not thread["active"]:
        return "idle"
    return "python" if thread["owns_gil"] else "native"


def own_instrumentation(thread: Mapping[str, Any]) -> bool:
    """Whether a thread sample is tunekit measuring (the profiler exporting a trace)."""
    return any(
        f["name"] in _OWN_FUNCS or any(o in f["file"] for o in _OWN_FILES) for f in thread["frames"]
    )


def in_training_loop(thread: Mapping[str, Any]) -> bool:
    """Whether a thread sample's stack is inside a training loop (see :data:`LOOP_FUNCS`)."""
    return any(f["name"] in LOOP_FUNCS for f in thread["frames"])


def _frame_label(f: Mapping[str, Any]) -> str:
    return f"{f['name']} ({Path(f['file']).name}:{f['line']})"


_FLAGS = {
    "data_loading": "data loading",
    "optimizer_step": "optimizer step",
    "python": "Python overhead in the loop",
}


def summarize_pyspy(
    samples: list[dict[str, Any]], top: int = 10, flag_fraction: float = 0.1
) -> dict[str, Any]:
    """Top functions and categories over every rank's main-thread samples, with flags."""
    categories: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    per_rank: dict[str, Counter[str]] = {}
    mains: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        for rank, r in s["data"].get("ranks", {}).items():
            threads = r["threads"]
            main = next((t for t in threads if t["main"]), threads[0] if threads else None)
            if main is not None and main["frames"] and not own_instrumentation(main):
                mains.setdefault(rank, []).append(main)
    n = 0
    for rank, threads in mains.items():
        in_loop = [t for t in threads if in_training_loop(t)]
        for main in in_loop or threads:
            n += 1
            cat = classify(main)
            categories[cat] += 1
            per_rank.setdefault(rank, Counter())[cat] += 1
            if main["active"]:
                leaf[_frame_label(main["frames"][0])] += 1
    fractions = {c: k / n for c, k in categories.items()} if n else {}
    flags = [
        f"{label}: {100 * fractions[cat]:.0f}% of stack samples"
        for cat, label in _FLAGS.items()
        if n >= MIN_FLAG_SAMPLES and fractions.get(cat, 0.0) >= flag_fraction
    ]
    return {
        "samples": n,
        "categories": fractions,
        "per_rank": {r: dict(c) for r, c in sorted(per_rank.items())},
        "top_functions": [
            {"function": f, "samples": k, "fraction": k / n} for f, k in leaf.most_common(top)
        ],
        "flags": flags,
    }
