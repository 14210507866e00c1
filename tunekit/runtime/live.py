"""The live training job: what every rank runs under ``tunekit run``.

    torchrun ... -m tunekit.runtime.live RUN_DIR

Each step boundary, rank 0 may hand every rank a command (apply a config,
stop, relaunch); all ranks carry it out before the next step, so a config
changes at the same step everywhere and model and optimizer state carry over.
Commands travel over a gloo side group as a length and JSON bytes (never
pickle), one tiny broadcast per step when there is nothing to say.

Rank 0 also runs the control socket (:mod:`tunekit.runtime.control`), writes
``status.json`` and ``metrics.jsonl``, watches each applied config against
the steps before it (rolling back a slowdown beyond noise), and runs in-job
trials (candidate and current config in alternating windows). A pause holds
every rank at a step boundary while a tuner's trials use the machine.

What rank 0 cannot write does not stop training: a checkpoint that fails
refuses the apply, relaunch or stop that needed it (the job keeps its last
good checkpoint), and status, metrics and events that cannot be written (a
full disk) are reported once, keep their last good copy, and are written
again once there is room; a rank's own output cannot fail it either
(:class:`LossyStream`). A change that needs new processes is watched in the relaunched
job like any other and rolled back by a relaunch.

One module, though long: the control loop, the checkpoint and the rollback of
a live change are one transaction at a step boundary; split, its invariants
(what is committed when) would be spread over files.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunekit.config import TuningConfig, check_batch, config_layout, resolve
from tunekit.errors import TunekitError
from tunekit.locks import FileLock, LockHeld, describe_holder
from tunekit.plugin_loading import load_named, select
from tunekit.runtime.checkpoint import (
    is_sharded_checkpoint,
    load_sharded,
    read_extras,
    save_sharded,
)
from tunekit.runtime.control import RESUME, ControlServer, Request
from tunekit.runtime.dist import broadcast_bytes, ensure_group, init_from_env
from tunekit.runtime.quiet_writes import QuietWrites
from tunekit.runtime.rundir import CheckpointError, LossyStream, RunDir
from tunekit.runtime.session import Session, StepRecord
from tunekit.trials.stats import compare
from tunekit.workload import load_workload

STOP, RELAUNCH, PAUSE = "stop", "relaunch", "pause"
MEMORY_STEPS = 3
"""Steps whose peak memory the job measures before it reports what fills a rank's memory."""
REPLY_WRITTEN_S = 30.0
"""How long rank 0 (and with it every rank) waits, after carrying out a request, for its reply
to reach the client: moments, unless the machine is very busy or the client stopped reading."""


# -- rank 0's judgement: watch an applied config, run an in-job trial ---------------------


class Watch:
    """Compares the steps after an apply with the steps before it, in seconds per sample.

    Per sample, not per step: a batch change makes steps longer by design.
    """

    def __init__(
        self,
        before: list[float],
        window: int,
        warm: int,
        min_effect: float,
        step: int,
        prev: dict,
        new: dict,
        checkpoint: str | None,
        **more: Any,
    ):
        self.before, self.window, self.warm, self.min_effect = before, window, warm, min_effect
        self.after: list[float] = []
        self.seen = 0
        self.state = "watching"
        self.reason = ""
        self.info = {
            "applied_at": step,
            "prev_config": prev,
            "config": new,
            "checkpoint": checkpoint,
            **more,
        }

    @classmethod
    def restore(cls, record: dict[str, Any], warm: int, min_effect: float) -> Watch:
        """A watch handed over by a relaunch: still watching (the steps before it came along),
        or its verdict (status shows it)."""
        info = {
            k: v
            for k, v in record.items()
            if k
            not in (
                "state",
                "reason",
                "before",
                "window",
                "before_s_per_sample",
                "after_s_per_sample",
            )
        }
        w = cls(
            list(record.get("before") or []),
            int(record.get("window") or 10),
            warm,
            min_effect,
            info.pop("applied_at", None),
            info.pop("prev_config", None),
            info.pop("config", None),
            info.pop("checkpoint", None),
            **info,
        )
        w.state, w.reason = record.get("state", "watching"), record.get("reason", "")
        return w

    @property
    def relaunch(self) -> bool:
        """Whether undoing the change needs new processes (it changed the world size)."""
        return self.info.get("prev_nproc") not in (None, self.info.get("nproc"))

    def handover(self) -> dict[str, Any]:
        """What a relaunched job needs to go on watching."""
        return {**self.to_dict(), "before": self.before, "window": self.window}

    def update(self, step_s: float) -> bool:
        """Record a step; True when the verdict is a rollback."""
        self.seen += 1
        if self.state != "watching" or self.seen <= self.warm:
            return False
        self.after.append(step_s)
        if len(self.after) < self.window:
            return False
        if len(self.before) < 3:
            self.state, self.reason = "kept", "too little history before the change to judge it"
            return False
        c = compare(self.before, self.after, min_effect=self.min_effect)
        slower = c.ci_high < 1 - self.min_effect
        self.info.update(speedup=c.speedup, ci=[c.ci_low, c.ci_high])
        if slower:
            self.state = "rolling_back"
            self.reason = (
                f"throughput fell to {c.speedup:.0%} of before, slower beyond noise "
                f"({_rate(_median(self.after))} vs {_rate(_median(self.before))})"
            )
            return True
        self.state = "kept"
        self.reason = (
            f"{c.speedup:.2f}x the samples/s of before (95% CI {c.ci_low:.2f}-{c.ci_high:.2f})"
        )
        return False

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason,
            "before_s_per_sample": _median(self.before),
            "after_s_per_sample": _median(self.after) if self.after else None,
            **self.info,
        }

    def pinned_checkpoint(self) -> str | None:
        """The checkpoint a crash under this watch goes back to: not to be rotated away."""
        return self.info.get("checkpoint") if self.state == "watching" else None


class InJobTrial:
    """Candidate and current config in alternating windows (X A X A), judged in seconds per sample."""

    def __init__(
        self,
        request: Request,
        candidate: dict,
        current: dict,
        window: int,
        warm: int,
        min_effect: float,
    ):
        self.request = request
        self.configs = {"candidate": candidate, "current": current}
        self.phases = ["candidate", "current", "candidate", "current"]
        self.window, self.warm, self.min_effect = window, warm, min_effect
        self.times: dict[str, list[float]] = {"candidate": [], "current": []}
        self.phase = -1
        self.in_phase = 0
        self.result: dict[str, Any] | None = None

    def next_command(self) -> dict | None:
        if self.phase == -1 or (
            self.in_phase >= self.window + self.warm and self.phase < len(self.phases)
        ):
            self.phase += 1
            self.in_phase = 0
            if self.phase < len(self.phases):
                return {
                    "op": "apply",
                    "config": self.configs[self.phases[self.phase]],
                    "source": "trial",
                }
            c = compare(self.times["current"], self.times["candidate"], min_effect=self.min_effect)
            keep = c.significant
            candidate_s, current_s = (
                _median(self.times["candidate"]),
                _median(self.times["current"]),
            )
            # compare() needed samples of both
            assert candidate_s is not None and current_s is not None
            self.result = {
                "kept": "candidate" if keep else "current",
                "candidate_samples_per_s": 1 / candidate_s,
                "current_samples_per_s": 1 / current_s,
                "speedup": c.speedup,
                "ci": [c.ci_low, c.ci_high],
                "window": self.window,
            }
            if keep:
                return {"op": "apply", "config": self.configs["candidate"], "source": "trial"}
        return None

    def update(self, step_s: float) -> None:
        if 0 <= self.phase < len(self.phases):
            self.in_phase += 1
            if self.in_phase > self.warm:
                self.times[self.phases[self.phase]].append(step_s)

    @property
    def finished(self) -> bool:
        return self.result is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "phases": self.phases,
            "window": self.window,
            "result": self.result,
        }


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _rate(seconds_per_sample: float | None) -> str:
    return "—" if not seconds_per_sample else f"{1 / seconds_per_sample:,.0f} samples/s"


class Controller:
    """Rank 0: turns socket requests and its own verdicts into commands for all ranks."""

    def __init__(self, job: LiveJob):
        self.job = job
        spec = job.spec
        self.window = int(spec.get("watch_window", 10))
        self.warm = int(spec.get("watch_warm", 2))
        self.min_effect = float(spec.get("min_effect", 0.02))
        self.internal: deque[dict] = deque()
        self.waiting: dict[int, Request] = {}
        self.ids = 0
        self.history: deque[tuple[int, float, str]] = deque(maxlen=500)
        handed = spec.get("watch")  # from the launch before a relaunch
        self.watch: Watch | None = (
            Watch.restore(handed, self.warm, self.min_effect) if handed else None
        )
        self.trial: InJobTrial | None = None
        self.pause: tuple[Request, dict[str, Any]] | None = None
        """The request holding the job paused, and what status says of it."""
        self.last: dict[str, Any] = {}
        rd = job.rd
        self.socket = rd.choose_socket_path()
        self.server = ControlServer(self.socket, rd.token(), self.status, self.validate)
        job.quietly("run.json", rd.update_run, socket=str(self.socket))

    # -- what the socket thread may ask --------------------------------------------------

    def status(self) -> dict[str, Any]:
        s = self.job.session
        return {
            "status": self.job.state,
            "run_id": self.job.rd.run_id,
            "step": s.step,
            "total_steps": self.job.total,
            "world_size": s.world_size,
            "config": s.config.to_dict(),
            "config_id": s.config.config_id,
            "last": self.last,
            "watch": self.watch.to_dict() if self.watch else None,
            "trial": self.trial.to_dict() if self.trial else None,
            "pid": os.getpid(),
            "queued": self.server.requests.qsize(),
            "relaunching_to": self.job.relaunching_to,
            "paused": self.pause[1] if self.pause and self.job.state == "paused" else None,
            "launch": self.job.spec.get("launch"),
            "warnings": sorted(self.job.warned.values()),
            "layout": s.layout.to_dict(),
            "memory": self.job.memory,
            "batch": {
                "size": s.batch_size,
                "workload": s.workload.batch_size,
                "range": list(s.workload.batch_range) if s.workload.batch_range else None,
            },
        }

    def validate(self, msg: dict[str, Any]) -> str | None:
        """Refuse bad requests in the socket thread, before they reach the training loop.

        The fields' types and ranges are checked already (``control.check_fields``);
        this checks what only the job knows: the config against its tuners.
        """
        op = msg["op"]
        if op in ("apply", "trial"):
            try:
                config = TuningConfig.from_dict(msg["config"], where="config")
                resolve(config, self.job.tuners)
                check_batch(config, self.status())
            except TunekitError as exc:
                return str(exc)
            if op == "trial" and self._needs_relaunch(config):
                return "an in-job trial can only try knobs that change at a step boundary"
            nnodes = int(self.job.spec.get("nnodes") or 1)
            if msg.get("nproc") is not None and int(msg["nproc"]) % nnodes:
                return f"{msg['nproc']} ranks do not split evenly over this job's {nnodes} nodes"
        if op == "rollback" and self.watch is None and not self.job.applied:
            return "nothing to roll back: no config was applied to this job"
        return None

    def _needs_relaunch(self, config: TuningConfig) -> bool:
        session = self.job.session
        layout = config_layout(resolve(config, self.job.tuners), session.workload.layout())
        if session.layout.needs_rebuild(layout):  # sharding, resharding, offload: a new model
            return True
        current = self.job.session.config.plugins
        for name, knobs in config.plugins.items():
            tuner = self.job.tuners[name]
            full = tuner.validate(knobs)
            old = current.get(name, tuner.defaults())
            if any(k.live == "relaunch" and full[k.name] != old.get(k.name) for k in tuner.knobs()):
                return True
        for name in set(current) - set(config.plugins):
            tuner = self.job.tuners[name]
            if any(
                k.live == "relaunch" and current[name].get(k.name) != k.default
                for k in tuner.knobs()
            ):
                return True
        return False

    def _change(self, config: dict, nproc: int | None, **cmd: Any) -> dict:
        """An apply at this step boundary, or a relaunch when the change needs new processes."""
        world = self.job.session.world_size
        if (nproc is not None and nproc != world) or self._needs_relaunch(
            TuningConfig.from_dict(config)
        ):
            return {**cmd, "op": RELAUNCH, "config": config, "nproc": nproc or world}
        return {**cmd, "op": "apply", "config": config}

    # -- the loop's side ------------------------------------------------------------------

    def next_command(self) -> dict | None:
        if self.internal:
            return self.internal.popleft()
        if self.trial is not None:
            cmd = self.trial.next_command()
            if self.trial.finished:
                if cmd is None:  # the current config won and is already running
                    self._finish_trial()
                else:  # answer once the candidate is back in place
                    cmd["finish_trial"] = True
            if cmd is not None or self.trial is not None:
                return cmd
        req = self.server.next_request()
        if req is None:
            return None
        if req.op == RESUME:  # a pause's connection ended: lift that pause, and only that one
            if self.pause is not None and req.body.get("of") is self.pause[0]:
                self.pause = None
                return {"op": RESUME}
            return None
        if self.pause is not None and req.op != "stop":
            why = self.pause[1]["reason"] or "paused"
            req.answer(
                {
                    "ok": False,
                    "error": f"the job is paused ({why}); {req.op} is refused until it resumes",
                }
            )
            return None
        self.ids += 1
        self.waiting[self.ids] = req
        body = req.body
        if req.op == "stop":
            return {"op": STOP, "id": self.ids}
        if req.op == PAUSE:
            self.pause = (
                req,
                {"step": self.job.session.step, "reason": str(body.get("reason") or "")[:200]},
            )
            return {"op": PAUSE, "id": self.ids}
        if req.op == "rollback":
            if self.job.applied:
                prev = self.job.applied[-1]
            else:  # only a watch handed over by a relaunch is left to undo
                assert self.watch is not None  # validate() refuses a rollback with nothing to undo
                prev = {
                    "config": self.watch.info["prev_config"],
                    "nproc": self.watch.info.get("prev_nproc"),
                }
            return self._change(prev["config"], prev.get("nproc"), source="rollback", id=self.ids)
        config = TuningConfig.from_dict(body["config"]).to_dict()
        if req.op == "trial":
            self.trial = InJobTrial(
                req,
                config,
                self.job.session.config.to_dict(),
                int(body.get("window", self.window)),
                self.warm,
                self.min_effect,
            )
            self.job.log_event("trial_started", config=config, window=self.trial.window)
            del self.waiting[self.ids]
            return self.next_command()
        return self._change(
            config,
            body.get("nproc"),
            source="user",
            id=self.ids,
            watch=int(body.get("watch", self.window)),
        )

    def before_change(self) -> list[float]:
        """Seconds per sample of the last steps under the config running now."""
        cid = self.job.session.config.config_id
        return [t for (_, t, c) in list(self.history)[-self.window :] if c == cid]

    def relaunch_plan(self, cmd: dict, checkpoint: Path) -> dict[str, Any]:
        """What the supervisor needs to relaunch: world, config, checkpoint, and the watch to hand on."""
        s = self.job.session
        applied = list(self.job.applied)
        source = cmd.get("source", "user")
        watch: dict[str, Any] | None
        if source == "user":
            applied.append({"config": s.config.to_dict(), "nproc": s.world_size})
            watch = Watch(
                self.before_change(),
                int(cmd.get("watch", self.window)),
                self.warm,
                self.min_effect,
                s.step,
                s.config.to_dict(),
                cmd["config"],
                str(checkpoint),
                prev_nproc=s.world_size,
                nproc=cmd["nproc"],
            ).handover()
        else:  # a rollback, asked for or the watch's verdict: undo the newest change
            if applied:
                applied.pop()
            record = self.watch.to_dict() if self.watch else {}
            reason = cmd.get("reason") or "rolled back on request"
            watch = {**record, "state": "rolled_back", "reason": reason} if record else None
        return {
            "launch": self.job.spec.get("launch"),
            "config": cmd["config"],
            "nproc": cmd["nproc"],
            "checkpoint": str(checkpoint),
            "step": s.step,
            "source": source,
            "watch": watch,
            "applied": applied,
        }

    def executed(self, cmd: dict, result: dict[str, Any]) -> None:
        """Answer the request behind ``cmd`` and start or end a watch."""
        source = cmd.get("source")
        step = self.job.session.step
        if cmd["op"] == "apply" and source == "user" and result.get("ok"):
            before = [
                t
                for (_, t, cid) in list(self.history)[-self.window :]
                if cid == result["prev_config_id"]
            ]
            self.watch = Watch(
                before,
                int(cmd.get("watch", self.window)),
                self.warm,
                self.min_effect,
                step,
                result["prev_config"],
                result["config"],
                result.get("checkpoint"),
            )
            self.job.log_event("applied", step=step, config=result["config"])
        elif (
            cmd["op"] in ("apply", RELAUNCH)
            and source in ("rollback", "watch")
            and result.get("ok")
        ):
            self.job.log_event(
                "rolled_back",
                step=step,
                config=result.get("config", cmd["config"]),
                reason=cmd.get("reason", "requested"),
                ok=True,
                relaunch=cmd["op"] == RELAUNCH,
            )
            if self.watch is not None and source == "rollback":
                self.watch.state, self.watch.reason = "rolled_back", "rolled back on request"
        elif not result.get("ok"):
            self.job.log_event(
                f"{cmd['op']}_failed", step=step, error=result.get("error"), source=source
            )
        if cmd.get("finish_trial"):
            self._finish_trial()
        cmd_id = cmd.get("id")
        req = self.waiting.pop(cmd_id, None) if cmd_id is not None else None
        if req is not None:
            req.answer(result)
            # The client hears where the change took effect before the changed job runs a
            # step: a config that crashes the job at once must not take the reply down with
            # it (a rank that raised first had torchrun stop this one before it was written).
            req.written.wait(REPLY_WRITTEN_S)

    def after_step(self, rec: StepRecord) -> None:
        s = self.job.session
        cid = s.config.config_id
        per_sample = rec.step_s / s.global_batch
        self.history.append((rec.step, per_sample, cid))
        self.last = {
            "step": rec.step,
            "loss": rec.loss,
            "step_s": rec.step_s,
            "samples_per_s": s.global_batch / rec.step_s if rec.step_s else None,
        }
        metric = {
            "step": rec.step,
            "loss": rec.loss,
            "step_s": rec.step_s,
            "samples_per_s": self.last["samples_per_s"],
            "config_id": cid,
            "world_size": s.world_size,
            "batch_size": s.batch_size,
            "t": time.time(),
        }
        if rec.metrics.get("overlap_R") is not None:
            metric["overlap_R"] = rec.metrics["overlap_R"]
        self.job.quietly("metrics.jsonl", self.job.rd.append_metric, metric)
        self.server.publish(metric)
        if self.trial is not None:
            self.trial.update(per_sample)
        if self.watch is not None and self.watch.update(per_sample):
            prev = self.watch.info["prev_config"]
            nproc = self.watch.info.get("prev_nproc") if self.watch.relaunch else None
            self.internal.append(
                self._change(prev, nproc, source="watch", reason=self.watch.reason)
            )
            self.watch.state = "rolled_back"
        if (
            self.watch is not None
            and self.watch.state in ("kept",)
            and not self.watch.info.get("logged")
        ):
            self.watch.info["logged"] = True
            self.job.log_event("watch_kept", step=s.step, reason=self.watch.reason)
        self.job.write_status()

    def _finish_trial(self) -> None:
        trial = self.trial
        assert trial is not None and trial.result is not None  # called once a trial has its verdict
        self.trial = None
        self.job.log_event("trial_finished", **trial.result)
        trial.request.answer(
            {"ok": True, **trial.result, "config": self.job.session.config.to_dict()}
        )

    def close(self) -> None:
        self.server.close(relaunching_to=self.job.relaunching_to)
        # A private folder of its own (or shared): tidy if empty.
        if self.socket.parent != self.job.rd.path:
            with contextlib.suppress(OSError):
                self.socket.parent.rmdir()


# -- every rank ---------------------------------------------------------------------------


class LiveJob:
    def __init__(self, rd: RunDir):
        self.rd = rd
        self.spec = rd.read_run()
        self.writes = QuietWrites(rd)
        self.memory_reported = False
        self.memory: dict[str, Any] | None = None
        """What fills a rank's memory, measured on the first steps (rank 0; status shows it)."""
        self.ctx = init_from_env(self.spec.get("device", "auto"))
        world = self.ctx.world_size
        self.lock = self._hold_run() if self.ctx.rank == 0 else None
        pids = rd.path / "pids"  # telemetry samples these processes
        with contextlib.suppress(OSError):  # a full disk: telemetry misses this rank, no more
            pids.mkdir(mode=0o700, exist_ok=True)
            for stale in pids.glob("rank*"):
                if int(stale.name.removeprefix("rank")) >= world:
                    stale.unlink(missing_ok=True)
            (pids / f"rank{self.ctx.rank}").write_text(str(os.getpid()))
        # Control traffic rides a gloo group even when training uses NCCL.
        self.control_group = dist.new_group(backend="gloo") if world > 1 else None
        self.tuners = self._load_tuners()
        workload = load_workload(self.spec["workload"])
        config = TuningConfig.from_dict(self.spec.get("config") or {})
        resume = self.spec.get("resume")
        state: dict[str, Any] | None = None
        if resume and is_sharded_checkpoint(Path(resume)):
            saved_config = read_extras(Path(resume))["config"]
        elif resume:
            state = self._resume_state(Path(resume))
            saved_config = state["session"]["config"]
        if resume and self.spec.get("config") is None:
            config = TuningConfig.from_dict(saved_config)
        # The config's layout is built in from the start: sharding precedes the optimizer.
        layout = config_layout(resolve(config, self.tuners), workload.layout())
        if layout.sharded:
            self.ctx = ensure_group(self.ctx)
        cap = self.spec.get("memory_cap_bytes")
        self.session = Session(
            workload,
            rank=self.ctx.rank,
            world_size=world,
            local_rank=self.ctx.local_rank,
            device=self.ctx.device,
            group=self.ctx.group,
            backend=self.ctx.backend,
            seed=self.spec.get("seed"),
            layout=layout,
            memory_cap_bytes=int(cap) if cap is not None else None,
            track_memory=True,  # the first steps' peak is reported; every step's under a cap
        )
        if resume:
            if state is None:
                load_sharded(self.session, Path(resume))
            else:
                self.session.load_state_dict(state["session"])
            if self.ctx.rank == 0:
                rd.truncate_metrics(self.session.step)
        self.session.apply_config(config, self.tuners)
        self.applied: list[dict] = list(self.spec.get("applied") or [])
        """What each change the user made replaced ({config, nproc}), newest last; kept across relaunches."""
        steps = self.spec.get("steps")
        self.total = int(steps) if steps is not None else None
        self.every = int(self.spec.get("checkpoint_every", 50))
        self.state = "running"
        self.relaunching_to: int | None = None
        """The world size this job exits to be relaunched with, once it does."""
        self.controller = Controller(self) if self.ctx.rank == 0 else None
        if self.controller is not None:
            self.log_event(
                "started",
                step=self.session.step,
                world_size=world,
                config=config.to_dict(),
                resumed=bool(resume),
            )
            self.write_status()

    def _resume_state(self, path: Path) -> dict[str, Any]:
        """The checkpoint to resume from. A job across nodes reads it on rank 0 alone (the other
        nodes hold no copy of the run folder) and sends its bytes to every rank."""
        world = self.ctx.world_size
        if int(os.environ.get("LOCAL_WORLD_SIZE", world)) >= world:
            return RunDir.load_checkpoint(path)
        data, error = None, ""
        if self.ctx.rank == 0:
            try:
                data = path.read_bytes()
            except OSError as exc:
                error = f"cannot read checkpoint {path}: {exc.strerror or exc}"
        data = broadcast_bytes(data, src=0, group=self.control_group)
        if data is None:
            raise TunekitError(error or f"rank 0 could not read checkpoint {path}")
        return RunDir.load_checkpoint(io.BytesIO(data))

    def _hold_run(self) -> FileLock:
        """Rank 0 holds the run while it trains: no second job may write into its folder."""
        try:
            return FileLock(
                self.rd.rank0_lock, "rank 0 of the live job", run=self.rd.run_id
            ).acquire()
        except LockHeld as exc:
            raise TunekitError(
                f"run {self.rd.run_id} already has a job training: its rank 0 is "
                f"{describe_holder(exc.holder)}"
            ) from None

    def _load_tuners(self) -> dict[str, Any]:
        """Exactly the tuners the supervisor saw when it created the run, and no others."""
        listed = self.spec.get("plugins")
        if listed is None:  # a run created before runs recorded them: what is installed
            from tunekit.plugin_loading import available_tuners

            return available_tuners()
        return select(load_named(listed), listed)

    # -- what rank 0 writes: a failure is said once and training goes on -----------------------

    @property
    def warned(self) -> dict[str, str]:
        """What rank 0 could not write, said once each (status shows it)."""
        return self.writes.warned

    def quietly(self, what: str, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.writes.quietly(what, write, *args, **kwargs)

    def log_event(self, kind: str, **payload: Any) -> None:
        self.writes.log_event(kind, **payload)

    def write_status(self) -> None:
        if self.controller is not None:
            self.writes.flush_events()  # any an earlier full disk kept out
            self.quietly("status.json", self.rd.write_status, self.controller.status())

    # -- commands ------------------------------------------------------------------------

    def exchange(self) -> dict | None:
        """Rank 0's command for this boundary, on every rank."""
        cmd = self.controller.next_command() if self.controller else None
        if self.control_group is None:
            return cmd
        data = json.dumps(cmd).encode() if cmd else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control_group)
        if int(size) == 0:
            return None
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(int(size), dtype=torch.uint8)
        )
        dist.broadcast(buf, src=0, group=self.control_group)
        return json.loads(bytes(buf.tolist())) if cmd is None else cmd

    def anyone(self, flag: bool) -> list[int]:
        """Ranks for which ``flag`` is true (every rank learns all)."""
        if self.control_group is None:
            return [0] if flag else []
        flags = torch.zeros(self.ctx.world_size, dtype=torch.int64)
        flags[self.ctx.rank] = int(flag)
        dist.all_reduce(flags, group=self.control_group)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def execute(self, cmd: dict) -> str | None:
        op = cmd["op"]
        result: dict[str, Any]
        outcome = None
        if op == PAUSE:
            return self._hold(cmd)
        if op == "apply":
            result = self._apply(cmd)
        elif op == STOP:
            path, error = self.checkpoint()
            if error:  # stopping now would lose every step since the last checkpoint
                result = {
                    "ok": False,
                    "error": f"{error}; the job was not stopped, so that steps since its last "
                    "checkpoint are not lost: make room and stop it again",
                }
            else:
                result = {"ok": True, "stopped_at": self.session.step, "checkpoint": str(path)}
                outcome = STOP
        elif op == RELAUNCH:
            result = self._relaunch(cmd)
            outcome = RELAUNCH if result["ok"] else None
        else:
            result = {"ok": False, "error": f"unknown command {op}"}
        if self.controller is not None:
            self.controller.executed(cmd, result)  # waits for the reply to reach the client
            self.write_status()  # now: a crash in the very next step must find the watch in status.json
        if self.control_group is not None:
            # No rank runs a step past the command before rank 0's reply is out: a config that
            # crashes the job at once on another rank would have torchrun stop rank 0 first.
            dist.barrier(group=self.control_group)
        return outcome

    def _relaunch(self, cmd: dict) -> dict[str, Any]:
        """Checkpoint and leave the supervisor a plan; refused (the job goes on) when either fails."""
        path, error = self.checkpoint()
        if error is None and self.controller is not None:
            assert path is not None  # checkpoint() gives a path whenever it gives no error
            plan = self.controller.relaunch_plan(cmd, path)
            try:
                self.rd.write_relaunch(plan)
            except OSError as exc:
                error = f"cannot write {self.rd.relaunch_file}: {exc.strerror or exc}"
        if self.anyone(error is not None):
            return {
                "ok": False,
                "error": f"{error or 'rank 0 could not prepare the relaunch'}; "
                "the job goes on as it was",
            }
        self.relaunching_to = int(cmd["nproc"])
        if self.controller is not None:
            self.log_event(
                "relaunch",
                step=self.session.step,
                nproc=cmd["nproc"],
                config=cmd["config"],
                source=cmd.get("source", "user"),
            )
        return {
            "ok": True,
            "relaunching": True,
            "step": self.session.step,
            "nproc": cmd["nproc"],
            "config": cmd["config"],
        }

    def _hold(self, cmd: dict) -> str | None:
        """Every rank waits at this step boundary until rank 0 passes on a resume (or a stop).

        Rank 0 paces the wait; the others sit in the command broadcast, which
        an empty command every 0.1 s keeps well inside the group's timeout.
        """
        self.state = "paused"
        if self.controller is not None:
            self.controller.executed(cmd, {"ok": True, "paused_at": self.session.step})
            pause = self.controller.pause
            assert pause is not None  # rank 0 holds the request that paused the job
            self.log_event("paused", step=self.session.step, reason=pause[1]["reason"])
            self.write_status()
        while True:
            if self.controller is not None:
                time.sleep(0.1)
            nxt = self.exchange()
            if nxt is None:
                continue
            if nxt["op"] == RESUME:
                self.state = "running"
                if self.controller is not None:
                    self.log_event("resumed", step=self.session.step)
                    self.write_status()
                return None
            outcome = self.execute(nxt)
            if outcome is not None:
                return outcome

    def _apply(self, cmd: dict) -> dict[str, Any]:
        s = self.session
        prev = s.config
        checkpoint = None
        if cmd.get("source") == "user":  # the point a crash under the new config goes back to
            checkpoint, error = self.checkpoint()
            if error:
                return {
                    "ok": False,
                    "error": f"{error}; the apply was refused and the job goes on with its "
                    "config and its last good checkpoint",
                }
        error = None
        try:
            s.apply_config(TuningConfig.from_dict(cmd["config"]), self.tuners)
        except Exception as exc:  # a hook failed: every rank goes back together
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        failed = self.anyone(error is not None)
        if failed:
            s.apply_config(prev, self.tuners)
            why = error or f"the runtime hook failed on rank(s) {failed}"
            return {
                "ok": False,
                "error": f"{why}; rolled back to the previous config",
                "rolled_back": True,
                "config": prev.to_dict(),
            }
        if cmd.get("source") == "user":
            self.applied.append({"config": prev.to_dict(), "nproc": s.world_size})
        elif cmd.get("source") in ("rollback", "watch") and self.applied:
            self.applied.pop()
        if self.controller is not None and cmd.get("source") in ("user", "rollback", "watch"):
            self.quietly("run.json", self.rd.update_run, applied=self.applied)
        return {
            "ok": True,
            "step": s.step,
            "config": s.config.to_dict(),
            "prev_config": prev.to_dict(),
            "prev_config_id": prev.config_id,
            "checkpoint": str(checkpoint) if checkpoint else None,
        }

    # -- state ---------------------------------------------------------------------------

    def checkpoint(self) -> tuple[Path | None, str | None]:
        """Rank 0 saves (data-parallel replicas are identical); every rank learns whether it could.

        Returns the checkpoint, or None and why not. The checkpoint a watched change
        would go back to after a crash is kept from rotation. A sharded job's ranks each
        write their shard (:meth:`checkpoint_sharded`).
        """
        if self.session.layout.sharded:
            return self.checkpoint_sharded()
        state = self.session.state_dict()
        path, error = None, None
        if self.controller is not None:
            watch = self.controller.watch
            pinned = watch.pinned_checkpoint() if watch is not None else None
            try:
                path = self.rd.save_checkpoint(
                    self.session.step,
                    {"session": state, "world_size": self.ctx.world_size},
                    keep=(Path(pinned),) if pinned else (),
                )
            except CheckpointError as exc:
                error = str(exc)
                self.log_event("checkpoint_failed", step=self.session.step, error=error)
                self.warned["checkpoints"] = error
        if self.anyone(error is not None):
            return None, error or "rank 0 could not write the checkpoint"
        if self.controller is not None:
            self.warned.pop("checkpoints", None)
        return path or self.rd.checkpoints / f"step-{self.session.step:08d}.pt", None

    def checkpoint_sharded(self) -> tuple[Path | None, str | None]:
        """Every rank writes its shard into a staging folder; once all could, rank 0 makes it
        the newest checkpoint. A rank that cannot write fails the checkpoint for all, and the
        last good one stays."""
        import shutil

        final = self.rd.sharded_checkpoint_path(self.session.step)
        staging = final.with_name(final.name + ".tmp")
        error = None
        if self.controller is not None:
            shutil.rmtree(staging, ignore_errors=True)
        self.anyone(False)  # the old staging folder is gone before anyone writes
        try:
            save_sharded(self.session, staging)
        except (OSError, RuntimeError, TunekitError) as exc:
            error = f"cannot write checkpoint {final}: {exc}"
        failed = self.anyone(error is not None)
        path = None
        if not failed and self.controller is not None:
            watch = self.controller.watch
            pinned = watch.pinned_checkpoint() if watch is not None else None
            try:
                path = self.rd.commit_sharded(
                    staging, final, keep=(Path(pinned),) if pinned else ()
                )
            except CheckpointError as exc:
                error = str(exc)
        if failed or self.anyone(error is not None):
            why = error or f"rank(s) {failed} could not write their shard of checkpoint {final}"
            if self.controller is not None:
                shutil.rmtree(staging, ignore_errors=True)
                self.log_event("checkpoint_failed", step=self.session.step, error=why)
                self.warned["checkpoints"] = why
            return None, why
        if self.controller is not None:
            self.warned.pop("checkpoints", None)
        return path or final, None

    def report_memory(self) -> None:
        """After the first steps: what fills a rank's memory, measured (rank 0 says it once);
        then stop measuring unless a cap must hold on every step."""
        s = self.session
        if self.memory_reported or s.memory.max is None:
            return
        self.memory_reported = True
        breakdown = s.memory_breakdown()
        if self.controller is not None:
            self.memory = breakdown
            self.log_event("memory", step=s.step, **breakdown)
        if s.memory.cap_bytes is None and s.device.type == "cpu":
            s.memory.stop()

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        outcome = None
        try:
            while self.total is None or self.session.step < self.total:
                cmd = self.exchange()
                if cmd is not None:
                    outcome = self.execute(cmd)
                    if outcome is not None:
                        break
                rec = self.session.train_step()
                if self.session.step >= MEMORY_STEPS:
                    self.report_memory()
                if self.controller is not None:
                    self.controller.after_step(rec)
                if self.every and self.session.step % self.every == 0:
                    self.checkpoint()  # a failure is logged; the job goes on
            if outcome is None:
                self.checkpoint()
            self.state = {STOP: "stopped", RELAUNCH: "relaunching", None: "finished"}[outcome]
            self.write_status()
            if self.controller is not None:
                self.log_event(self.state, step=self.session.step)
        finally:
            if self.controller is not None:
                self.controller.close()
            self.session.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if self.lock is not None:
            self.lock.release()
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tunekit.runtime.live RUN_DIR", file=sys.stderr)
        return 2
    os.umask(0o077)  # whatever a rank writes (checkpoints, traces, plugins' files) is private
    sys.stdout, sys.stderr = LossyStream(1), LossyStream(2)
    return LiveJob(RunDir(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main())
