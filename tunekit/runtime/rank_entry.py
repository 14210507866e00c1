"""What a rank runs when its torchrun agent forks it instead of starting a fresh Python.

    python -m tunekit.trials.agent - --run-path --start-method fork \\
        .../tunekit/runtime/rank_entry.py tunekit.runtime.worker TRIAL_DIR/spec.json

A fresh rank spends about 2.5 s of CPU importing torch and ``torch._dynamo`` (the
optimizers import it) before its first step; a study pays that for every rank of
every trial. The agent (:mod:`tunekit.trials.agent`) imports them, and the rank's
module, once; torchrun's ``fork`` start method then starts each rank with them in
memory. This file then runs the module as ``python -m MODULE ARGS`` would, with
the differences a forked child has undone:

* The agent's sockets (its rendezvous store's listening port, its connections)
  are let go: held by a rank, a port would stay bound and a connection open
  after the agent closed them.
* torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT to stop its workers;
  a rank gets the default handlers back, so that it dies of them as before.
* The interpreter's exit hooks (``atexit``) run when the module ends: a
  multiprocessing child ends with ``os._exit``, which skips them.
* ``sys.exit(0)`` returns instead of ending the process: torchrun collects a
  forked rank's return value and would wait for ever on one that exited early.

``TUNEKIT_RANK_START=spawn`` in the environment starts ranks the old way (a fresh
``python -m`` per rank), for a workload that cannot live in a forked process.
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import socket
import sys

ENV = "TUNEKIT_RANK_START"


def forking() -> bool:
    """Whether ranks fork from their agent (the default) or start a fresh Python."""
    return os.environ.get(ENV, "fork") != "spawn"


def preload(module: str) -> None:
    """Import, in the agent, what every rank of ``module`` imports before its first step."""
    import torch._dynamo  # noqa: F401  (the optimizers import it at their first call)

    importlib.import_module(module)


def release_inherited_sockets() -> None:
    """Let go of the TCP sockets the agent had open when it forked this rank.

    Each is replaced by ``/dev/null`` rather than closed, so that its number stays taken:
    the agent's objects that own it live on in this process's memory and must never
    close a number the rank has since reused for a socket of its own.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: nothing to let go of that we can find
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            if fd <= 2 or fd == devnull:
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:  # not a socket (or the listing's own, already closed)
                continue
            family = sock.family
            sock.detach()  # the object lets go of the number without closing it
            if family in (socket.AF_INET, socket.AF_INET6):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def main(argv: list[str]) -> None:
    release_inherited_sockets()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    module, sys.argv = argv[0], argv
    # Run afresh as ``__main__``, as ``python -m`` would; its imports stay loaded.
    sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        atexit._run_exitfuncs()


if __name__ == "__main__":
    main(sys.argv[1:])
