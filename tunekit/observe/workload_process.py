"""Run a workload's code in a child process, never in tunekit's own.

Observation builds, traces and times the user's model, and tuners' ``diagnose``
and ``plan`` time pieces of it. Run inside tunekit, a workload that segfaults
would kill tunekit (and lose the study's state), one that hangs would never let
it finish, and one that calls ``os._exit`` would end it with no report. So all
of that runs in :mod:`tunekit.observe.workload_child`, and is judged as a trial
is: under the trial timeout, and from facts (the reply, the exception's type,
the exit status, the fault report), never from its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunekit import errors
from tunekit.errors import TunekitError
from tunekit.trials.exits import describe_exit, fault_location
from tunekit.trials.launcher import CRASH, HANG, OOM, stop_all
from tunekit.trials.output import CappedLog, pump
from tunekit.trials.warm_start import PIPE, WarmProcess, child_env, start_python
from tunekit.workload import Workload

if TYPE_CHECKING:
    from tunekit.observe.observation import Observation

OBSERVE_LOG = "observe.log"
"""What the workload printed while observed (capped): in the store folder for ``tunekit auto``
(the tuners' hooks too), in ``--out`` for ``tunekit profile``."""

_REPLY_LIMIT = 1 << 30
"""Longest reply line: a large model's graph is megabytes of JSON."""


class ObservationFailed(TunekitError):
    """The workload's process failed: ``status`` is ``crash``, ``oom`` or ``hang``, as for a trial."""

    def __init__(self, status: str, message: str, *, setup: bool = False):
        super().__init__(message)
        self.status = status
        self.setup = setup
        """It failed while loading the workload or setting up, before any tuner's hook ran."""


class ChildRaised(Exception):
    """A request raised in the child (the child lives on)."""

    def __init__(self, error: dict[str, Any]):
        self.type_name = error.get("type", "Exception")
        self.message = error.get("message", "")
        self.oom = bool(error.get("oom"))
        self.tunekit_error = error.get("tunekit_error")
        self.where = error.get("where", "")
        """Where it was raised (``file:line in function``), in the plugin when a plugin's hook raised."""
        self.traceback = error.get("traceback", "")
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """As tunekit says a failure: a tunekit error by its message, anything else with its type."""
        return self.message if self.tunekit_error else f"{self.type_name}: {self.message}"

    def as_tunekit_error(self) -> TunekitError | None:
        """The same tunekit error (a ``WorkloadError`` ...) raised here, or None for any other exception."""
        cls = getattr(errors, self.tunekit_error or "", None)
        if isinstance(cls, type) and issubclass(cls, TunekitError):
            return cls(self.message)
        return None


class WorkloadProcess:
    """One child that runs the workload's code on request; started by :meth:`start` or the first call.

    A call that kills the child, or outlives ``timeout_s``, raises
    :class:`ObservationFailed` and ends the child; the next call starts a fresh
    one. Each child gets ``setup`` (a request that loads what later calls need)
    before its first call.
    """

    def __init__(self, log_path: Path, timeout_s: float, setup: dict[str, Any] | None = None):
        self.log_path = Path(log_path)
        self.fault_path = self.log_path.with_suffix(".fault")
        self.timeout_s = timeout_s
        self.setup = setup
        self.proc: asyncio.subprocess.Process | WarmProcess | None = None
        self._pump: asyncio.Task | None = None
        self._log: CappedLog | None = None
        self._needs_setup = False
        self._children = 0
        self._cpu_s = 0.0

    async def __aenter__(self) -> WorkloadProcess:
        return self

    async def __aexit__(self, exc_type, *_exc) -> None:
        # Interrupted (Ctrl-C) or failed: do not wait for it.
        await self.close(kill=exc_type is not None)

    async def call(self, op: str, doing: str, **args: Any) -> dict[str, Any]:
        """Send one request; its result. ``doing`` words the failure ("building and tracing the model").

        Raises :class:`ChildRaised` for an exception in the child, :class:`ObservationFailed`
        when the child died or hung.
        """
        await self.start()
        if self._needs_setup and self.setup is not None:
            self._needs_setup = False
            try:
                await self._request(self.setup, "loading the workload")
            except ChildRaised as exc:
                await self.close()
                raise ObservationFailed(
                    CRASH, f"{exc.one_line()} while loading the workload", setup=True
                ) from None
            except ObservationFailed as exc:
                exc.setup = True
                raise
        return await self._request({"op": op, **args}, doing)

    def take_cpu_s(self) -> float:
        """CPU seconds the child spent on the requests it answered since the last take (timings)."""
        cpu, self._cpu_s = self._cpu_s, 0.0
        return cpu

    async def start(self) -> None:
        """Start a child now, unless one runs: it imports torch before it reads a request, so its
        start-up overlaps whatever the caller does next."""
        if self.proc is not None:
            return
        self._needs_setup = True
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.fault_path.unlink(missing_ok=True)
        # A fresh child after one died appends: the log keeps what the dead one said.
        self._log = CappedLog(self.log_path, append=self._children > 0)
        if self._children:
            self._log.note("a fresh process for the workload; the one before it ended")
        self._children += 1
        cmd = [sys.executable, "-m", "tunekit.observe.workload_child", str(self.fault_path)]
        self.proc = await start_python(
            cmd, env=child_env(), stdin=PIPE, stdout=PIPE, stderr=PIPE, limit=_REPLY_LIMIT
        )
        assert self.proc.stderr is not None  # stderr=PIPE
        self._pump = asyncio.create_task(pump(self.proc.stderr, self._log))

    async def _request(self, request: dict[str, Any], doing: str) -> dict[str, Any]:
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), self.timeout_s)
        except TimeoutError:
            await self.close(kill=True)
            raise ObservationFailed(
                HANG,
                f"no result within {self.timeout_s:.0f} s (the trial timeout) while {doing}; "
                f"killed the workload's process{self._see_log()}",
            ) from None
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:  # the child is gone: say how, from its exit status
            code = await self._reap()
            where = fault_location(self.fault_path)
            how = f"the workload's process {describe_exit(code)}" + (
                f" at {where}" if where else ""
            )
            if code is not None and code >= 0:
                how += " without a result"
            await self.close(kill=True)
            raise ObservationFailed(CRASH, f"{how} while {doing}{self._see_log()}")
        reply = json.loads(line)
        self._cpu_s += reply.get("cpu_s") or 0.0
        if reply.get("ok"):
            return reply["result"]
        raised = ChildRaised(reply.get("error") or {})
        if raised.oom:
            raise ObservationFailed(OOM, f"out of memory while {doing} ({raised.one_line()})")
        raise raised

    async def _reap(self) -> int | None:
        assert self.proc is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 10)
        return self.proc.returncode

    def _see_log(self) -> str:
        return f"; its output is in {self.log_path}"

    async def close(self, kill: bool = False) -> None:
        """End the child and finish its log: closing its stdin ends an idle child; a stuck one
        (or any, with ``kill``) is killed with its whole process group."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()
            if not kill:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 5)
            await stop_all([proc])
        if self._pump is not None:
            _, late = await asyncio.wait([self._pump], timeout=5)
            for task in late:
                task.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
            self._pump = None
        if self._log is not None:
            self._log.close()
            self._log = None
        with contextlib.suppress(OSError):
            if self.fault_path.stat().st_size == 0:  # no fatal signal: nothing to keep
                self.fault_path.unlink()


async def observe_call(child: WorkloadProcess, op: str, doing: str, **args: Any) -> dict[str, Any]:
    """A request while observing, where any exception in the workload's code fails the
    observation (a ``WorkloadError``, for a bad name or a model that cannot run, stays what it
    was); a tuner's hook, by contrast, fails only that tuner (``WorkloadProcess.call``)."""
    try:
        return await child.call(op, doing, **args)
    except ChildRaised as exc:
        raise exc.as_tunekit_error() or ObservationFailed(
            CRASH, f"{exc.one_line()} while {doing}"
        ) from None


# -- what crosses between tunekit and the child ------------------------------------------------


def workload_facts(wl: Workload) -> dict[str, Any]:
    """What tunekit's own process needs to know of a workload it does not run (JSON)."""
    return {
        "name": wl.name,
        "batch_size": wl.batch_size,
        "lr": wl.lr,
        "lr_scaling": wl.lr_scaling,
        "batch_range": list(wl.batch_range) if wl.batch_range else None,
        "seed": wl.seed,
        "description": wl.description,
        "extra": wl.extra,
        # The training features (Observation.global_batch counts micro-batches); a scheduler by
        # its presence only: its factory is code, and runs only where the workload does.
        "precision": wl.precision,
        "grad_scaler": wl.grad_scaler,
        "accumulation": wl.accumulation,
        "clip_grad_norm": wl.clip_grad_norm,
        "scheduler": wl.scheduler is not None,
        "layout": wl.layout().to_dict(),
        "scheduler_name": getattr(wl.scheduler, "__name__", None) if wl.scheduler else None,
    }


def stand_in_workload(facts: dict[str, Any]) -> Workload:
    """A :class:`Workload` with the facts of one loaded in the child, whose code runs only there:
    its model and batches refuse to be built in this process."""

    def runs_in_its_own_process(*_args: Any) -> Any:
        raise RuntimeError(f"workload {facts['name']!r} runs in its own process, not in tunekit's")

    batch_range = tuple(facts["batch_range"]) if facts.get("batch_range") else None
    scheduler = None
    if facts.get("scheduler"):

        def scheduler(*_args: Any) -> Any:
            return runs_in_its_own_process()

        # named as the factory it stands for: best_config.md's snippet names it
        scheduler.__name__ = facts.get("scheduler_name") or "scheduler"
    return Workload(
        name=facts["name"],
        model=runs_in_its_own_process,
        make_batch=runs_in_its_own_process,
        batch_size=facts["batch_size"],
        lr=facts["lr"],
        lr_scaling=facts["lr_scaling"],
        batch_range=batch_range,
        seed=facts.get("seed", 0),
        description=facts.get("description", ""),
        extra=facts.get("extra") or {},
        precision=facts.get("precision", "fp32"),
        grad_scaler=facts.get("grad_scaler"),
        accumulation=facts.get("accumulation", 1),
        clip_grad_norm=facts.get("clip_grad_norm"),
        scheduler=scheduler,
        **(facts.get("layout") or {}),
    )


def observation_parts(obs: Observation, cache: dict[str, Any]) -> dict[str, Any]:
    """An :class:`Observation` as the child rebuilds it (``workload_child.observation``): plain
    data, the workload by name, and ``cache``, the study's cached entries for tuners."""
    return {
        "workload_spec": obs.workload_spec,
        "nproc": obs.nproc,
        "backend": obs.backend,
        "device_type": obs.device_type,
        "hardware": obs.hardware.to_dict(),
        "summary": obs.model.to_dict(),
        "baseline": obs.baseline.to_dict() if obs.baseline else None,
        "graph": obs.graph.to_dict() if obs.graph is not None else None,
        "layer_profile": obs.layer_profile.to_dict() if obs.layer_profile is not None else None,
        "breakdown": obs.breakdown.to_dict() if obs.breakdown is not None else None,
        "telemetry": obs.telemetry,
        "cache": cache,
        "memory": obs.memory.to_dict() if obs.memory is not None else None,
        "memory_cap_bytes": obs.memory_cap_bytes,
        "baseline_peak_bytes": obs.baseline_peak_bytes,
        "blocks": obs.blocks,
    }
