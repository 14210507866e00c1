"""A live job's changes asked for from outside it: what ``tunekit apply``, ``tunekit auto
--apply`` and the TUI share.

The job's control socket carries the request (:mod:`tunekit.runtime.control`); the
verdict of the watch that follows an apply comes from ``status.json``, where the job (or
its supervisor, after a crash or a relaunch) leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunekit.config import TuningConfig
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import client, wait_for


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
