"""``tunekit tui``: start a live job (or attach to one) and open the app.

This module imports no Textual at import time, so registering the command
costs the CLI nothing; the app is imported when the command runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from tunekit.cli.common import (
    MEMORY_CAP_OPTION,
    STORE_OPTION,
    console,
    ensure_writable,
    err_console,
    split_names,
)
from tunekit.plugin_loading import check_names
from tunekit.runtime.job_process import JobProcess
from tunekit.tui.backend import LiveBackend, TuneRequest, attach, plugin_infos
from tunekit.workload_spec import resolve_spec


@click.command("tui")
@click.argument("workload", required=False)
@click.option(
    "--attach",
    "attach_run",
    default=None,
    metavar="RUN",
    help="Watch a run started with `tunekit run` (an id, a path or 'latest') instead of starting one.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Ranks of the job it starts.",
)
@click.option(
    "--plugins",
    "plugins",
    multiple=True,
    metavar="NAMES",
    help="Tuners enabled at start (comma-separated; default: all that load).",
)
@click.option(
    "--trials",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Candidate trials per tuning.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    default=16,
    show_default=True,
    help="Measured steps per trial.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Warm-up steps per trial.",
)
@click.option(
    "--watch-window",
    type=click.IntRange(min=2),
    default=10,
    show_default=True,
    help="Steps compared before and after an apply (the job it starts).",
)
@click.option(
    "--min-effect",
    type=click.FloatRange(0, 1),
    default=0.02,
    show_default=True,
    help="Slowdown beyond noise that rolls an apply back (the job it starts).",
)
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
)
@STORE_OPTION
@MEMORY_CAP_OPTION
def tui_cmd(
    workload,
    attach_run,
    nproc,
    plugins,
    trials,
    steps,
    warmup,
    watch_window,
    min_effect,
    device,
    store_dir,
    memory_cap,
):
    """Watch WORKLOAD train, tune it and apply the winner, interactively (default: example:cnn).

    Starts WORKLOAD as a live job (`tunekit run`) and opens the app; quitting
    (q) checkpoints and stops that job, while closing the terminal leaves it
    running (`tunekit tui --attach RUN` watches it again). With --attach RUN it
    watches a job that is already running and leaves it running on quit.
    """
    if workload and attach_run:
        raise click.UsageError("give WORKLOAD or --attach RUN, not both")
    if workload:
        resolve_spec(workload)  # a missing file: one line now, not after torch has loaded
    from tunekit.tui.app import DETACH, TunekitApp

    request = TuneRequest(plugins=split_names(plugins), trials=trials, steps=steps, warmup=warmup)
    if request.plugins:  # an unknown or broken name: one line, before anything starts
        # (on the list a child process made: this one imports neither the plugins nor torch)
        check_names(plugin_infos(), request.plugins)
    ensure_writable(
        store_dir, "the study store folder (--store)"
    )  # the job, studies and logs go there
    if attach_run:
        backend = attach(attach_run, store_dir, device=device)
    else:
        from tunekit.examples import DEFAULT_EXAMPLE

        err_console.print(
            f"starting {workload or f'example:{DEFAULT_EXAMPLE}'} on {nproc} rank(s) …"
        )
        job = JobProcess.start(
            workload or f"example:{DEFAULT_EXAMPLE}",
            nproc=nproc,
            store_dir=store_dir,
            watch_window=watch_window,
            min_effect=min_effect,
            device=device,
            memory_cap_bytes=memory_cap,
        )
        backend = LiveBackend(job.rd, store_dir, job=job, device=device)
        err_console.print(keeps_running(backend.run_id))
    app = TunekitApp(backend, request)
    outcome = None
    log_path = backend.store_dir / "tui" / f"{backend.run_id}-app.log"
    try:
        with children_write_to(log_path):
            outcome = app.run()
    finally:
        crashed = app.return_code not in (0, None) or outcome is None
        keep = not backend.owns_job or outcome == DETACH or crashed
        if keep and backend.owns_job:
            console.print(
                f"run {backend.run_id} keeps running: `tunekit tui --attach {backend.run_id}` to watch it, "
                f"`tunekit stop {backend.run_id}` to stop it"
            )
        elif backend.owns_job:
            console.print(f"stopping run {backend.run_id} (checkpoint first) …")
        backend.close(stop_job=not keep)
        if not keep:
            st = backend.rd.read_status()
            console.print(
                f"run {backend.run_id} {st.get('status')} at step {st.get('step')}; "
                f"resume with `tunekit run --resume {backend.run_id}`"
            )


def keeps_running(run_id: str) -> str:
    """What happens to the job the app starts, said before the app takes the screen."""
    return (
        f"q checkpoints and stops run {run_id}; if this terminal closes instead, the job keeps "
        f"running: `tunekit tui --attach {run_id}` to watch it again, `tunekit stop {run_id}` to stop it"
    )


@contextlib.contextmanager
def children_write_to(log_path: Path) -> Iterator[None]:
    """While the app runs, file descriptors 1 and 2 go to ``log_path``; the app draws on the terminal.

    The app's workers call core code that may start processes (the hardware
    probe's ranks) or print from native code (torch warnings); either would
    write over the screen. Textual draws on ``sys.__stderr__`` and asks
    ``sys.__stdout__`` for the terminal's size (on start and on every resize,
    through ``shutil.get_terminal_size``), so both are pointed at a duplicate of
    the terminal; everything else that writes to descriptor 1 or 2 — this
    process's native code and every child that inherits them — lands in the log.
    """
    if not os.isatty(2):
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    streams = {"__stdout__": sys.__stdout__, "__stderr__": sys.__stderr__}
    terminal = os.dup(2)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(log_path, "ab") as log:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        for name, stream in streams.items():
            encoding = getattr(stream, "encoding", None) or "utf-8"
            setattr(
                sys, name, os.fdopen(terminal, "w", buffering=1, encoding=encoding, closefd=False)
            )
        try:
            yield
        finally:
            for name, stream in streams.items():
                getattr(sys, name).flush()
                setattr(sys, name, stream)
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            os.close(terminal)
