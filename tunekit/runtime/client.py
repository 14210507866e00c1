"""A live job's changes asked for from outside it: what ``tunekit apply``, ``tunekit stop``,
``tunekit auto --apply`` and the TUI share.

The job's control socket carries the request (:mod:`tunekit.runtime.control`); the
verdict of the watch that follows an apply comes from ``status.json``, where the job (or
its supervisor, after a crash or a relaunch) leaves it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from tunekit.config import TuningConfig
from tunekit.errors import ControlError
from tunekit.locks import holder_if_held
from tunekit.runtime.control import JobRelaunching
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, wait_for

STOP_WAIT_S = 600.0
"""How long ``tunekit stop`` waits for a job between launches to be stopped."""


@dataclass(frozen=True)
class ApplyOutcome:
    """What an apply (or a rollback: the previous config applied) did to the live job."""

    message: str
    """One sentence for people: where it took effect and, when waited for, the verdict."""
    reply: dict[str, Any]
    """The job's own reply (``ok``, ``step``; ``relaunching`` and ``nproc`` for a relaunch)."""
    rolled_back: bool | None = None
    """The watch's verdict; None when it was not waited for."""

    @property
    def relaunching(self) -> bool:
        return bool(self.reply.get("relaunching"))

    def to_dict(self) -> dict[str, Any]:
        """As ``tunekit auto --apply --json`` prints it: the message, the verdict, the reply."""
        verdict = {} if self.rolled_back is None else {"rolled_back": self.rolled_back}
        return {"message": self.message, **verdict, **self.reply}


def apply_to_run(
    rd: RunDir,
    config: TuningConfig,
    nproc: int | None = None,
    watch: int | None = None,
    wait: bool = True,
) -> ApplyOutcome:
    """Apply and (by default) wait for the outcome: kept, rolled back, or relaunched."""
    body: dict[str, Any] = {"config": config.to_dict()}
    if nproc is not None:
        body["nproc"] = nproc
    if watch is not None:
        body["watch"] = watch
    reply = client(rd).request("apply", **body)
    if reply.get("relaunching"):
        msg = f"relaunching with {reply['nproc']} rank(s) from step {reply['step']}"
    else:
        msg = f"applied at step {reply['step']}"
    if not wait:
        return ApplyOutcome(msg + "; watching", reply)

    def verdict(s: dict) -> bool:  # this apply's watch, not an earlier one still in status.json
        w = s.get("watch") or {}
        mine = w.get("applied_at") == reply["step"]
        return (mine and w.get("state") != "watching") or s.get("status") in ("finished", "stopped")

    # A relaunch is watched in the relaunched job; a crash under the change is rolled back by
    # the supervisor, which leaves its verdict in status.json: either way the verdict comes.
    st = wait_for(rd, verdict)
    w = st.get("watch") or {}
    rolled = w.get("state") in ("rolled_back", "rolling_back")
    return ApplyOutcome(
        f"{msg}; {'rolled back' if rolled else 'kept'}: {w.get('reason', '')}", reply, rolled
    )


def stop_run(rd: RunDir, wait_s: float = STOP_WAIT_S) -> str:
    """Checkpoint the job and stop it; one sentence saying where it stopped.

    A job between launches (a relaunch for a new world size) is stopped too: its
    supervisor stops instead of relaunching (``tunekit run --resume`` carries the
    relaunch out later), or, when the relaunched job serves first, that job stops.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = client(rd).request("stop")
            return f"stopped at step {reply['stopped_at']}"
        except JobRelaunching:
            ended = _stop_between_launches(rd, deadline)
            if ended is not None:
                return _said_stopped(rd, ended)
        # The relaunched job serves its socket (or nothing does): ask again.


def _stop_between_launches(rd: RunDir, deadline: float) -> dict[str, Any] | None:
    """Leave the supervisor a stop request; the status it stopped with once it took it, or None
    when the relaunched job (or nobody) is to be asked instead."""
    rd.write_stop_request({"asked_at": time.time(), "pid": os.getpid()})
    while True:
        between = rd.read_status().get("status") == "relaunching"
        supervised = holder_if_held(rd.supervisor_lock) is not None
        out_of_time = time.monotonic() > deadline
        if rd.stop_request_file.exists() and between and supervised and not out_of_time:
            time.sleep(0.2)
            continue
        try:  # take it back; whoever removes it first decides (see supervisor)
            rd.stop_request_file.unlink()
        except FileNotFoundError:  # the supervisor took it: it records the stop
            return wait_for(
                rd,
                lambda s: s.get("status") in ("stopped", "finished", "crashed"),
                timeout_s=max(30.0, deadline - time.monotonic()),
            )
        if out_of_time:
            raise ControlError(
                f"run {rd.run_id} was still relaunching after {STOP_WAIT_S:.0f} s; not stopped"
            )
        return None


def _said_stopped(rd: RunDir, status: dict[str, Any]) -> str:
    step = status.get("step")
    if status.get("status") != "stopped":
        return f"the job {status.get('status')} at step {step} before it could be stopped"
    pending = status.get("pending_relaunch")
    if not pending:
        return f"stopped at step {step}"
    return (
        f"stopped at step {step} instead of relaunching with {pending} rank(s); "
        f"`tunekit run --resume {rd.run_id}` relaunches it"
    )
