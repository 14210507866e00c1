"""What rank 0 of a live job writes into its run folder: a write that fails is said once, shown
by ``tunekit status`` until it succeeds again, and never stops training.

Status and metrics are rewritten or appended every step, so the next step's write clears their
warning once there is room. Events are rare (a failed checkpoint, an apply, a pause), so an
event the disk had no room for waits here, in order and with its own time, and goes out with
the next event or the next status write: once the disk has room, events.jsonl is whole again
and its warning goes, instead of lasting until something else happens.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tunekit.runtime.rundir import RunDir

EVENTS_KEPT = 1000
"""Events kept waiting for room at most (the oldest go first): a disk full for days must not
fill the job's memory instead."""


class QuietWrites:
    def __init__(self, rd: RunDir):
        self.rd = rd
        self.warned: dict[str, str] = {}
        """What could not be written, said once each (status shows it)."""
        self.waiting_events: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)

    def quietly(self, what: str, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``write``, or (it failed: a full disk, a read-only folder) a warning said once and
        shown by `tunekit status` until ``what`` is written again. Training goes on."""
        try:
            result = write(*args, **kwargs)
        except OSError as exc:
            if what not in self.warned:
                self.warned[what] = (
                    f"cannot write {what}: {exc.strerror or exc} (its last good copy stays)"
                )
                print(f"tunekit run: {self.warned[what]}; training goes on", file=sys.stderr)
            return None
        if self.warned.pop(what, None) is not None:
            print(f"tunekit run: {what} is written again", file=sys.stderr)
        return result

    def log_event(self, kind: str, **payload: Any) -> None:
        self.waiting_events.append({"t": time.time(), "kind": kind, **payload})
        self.flush_events()

    def flush_events(self) -> None:
        """Write the events that are waiting, oldest first, until one does not fit."""
        while self.waiting_events:
            event = dict(self.waiting_events[0])
            if self.quietly("events.jsonl", self.rd.log_event, event.pop("kind"), **event) is None:
                return
            self.waiting_events.popleft()
