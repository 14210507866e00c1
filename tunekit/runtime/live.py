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
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tunekit.config import TuningConfig, check_batch, resolve
from tunekit.errors import TunekitError
from tunekit.plugin_loading import available_tuners
from tunekit.runtime.control import RESUME, ControlServer, Request
from tunekit.runtime.dist import init_from_env
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.session import Session, StepRecord
from tunekit.trials.stats import compare
from tunekit.workload import load_workload

STOP, RELAUNCH, PAUSE = "stop", "relaunch", "pause"


# -- rank 0's judgement: watch an applied config, run an in-job trial ---------------------


class Watch:
    """Compares the steps after an apply with the steps before it, in seconds per sample.

    Per sample, not per step: a batch change makes steps longer by design.
    """

    def __init__(self, before: list[float], window: int, warm: int, min_effect: float,
                 step: int, prev: dict, new: dict, checkpoint: str | None):
        self.before, self.window, self.warm, self.min_effect = before, window, warm, min_effect
        self.after: list[float] = []
        self.seen = 0
        self.state = "watching"
        self.reason = ""
        self.info = {"applied_at": step, "prev_config": prev, "config": new, "checkpoint": checkpoint}

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
            self.reason = (f"throughput fell to {c.speedup:.0%} of before, slower beyond noise "
                           f"({_rate(_median(self.after))} vs {_rate(_median(self.before))})")
            return True
        self.state = "kept"
        self.reason = f"{c.speedup:.2f}x the samples/s of before (95% CI {c.ci_low:.2f}-{c.ci_high:.2f})"
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "before_s_per_sample": _median(self.before),
                "after_s_per_sample": _median(self.after) if self.after else None, **self.info}


class InJobTrial:
    """Candidate and current config in alternating windows (X A X A), judged in seconds per sample."""

    def __init__(self, request: Request, candidate: dict, current: dict, window: int, warm: int, min_effect: float):
        self.request = request
        self.configs = {"candidate": candidate, "current": current}
        self.phases = ["candidate", "current", "candidate", "current"]
        self.window, self.warm, self.min_effect = window, warm, min_effect
        self.times: dict[str, list[float]] = {"candidate": [], "current": []}
        self.phase = -1
        self.in_phase = 0
        self.result: dict[str, Any] | None = None

    def next_command(self) -> dict | None:
        if self.phase == -1 or (self.in_phase >= self.window + self.warm and self.phase < len(self.phases)):
            self.phase += 1
            self.in_phase = 0
            if self.phase < len(self.phases):
                return {"op": "apply", "config": self.configs[self.phases[self.phase]], "source": "trial"}
            c = compare(self.times["current"], self.times["candidate"], min_effect=self.min_effect)
            keep = c.significant
            self.result = {
                "kept": "candidate" if keep else "current",
                "candidate_samples_per_s": 1 / _median(self.times["candidate"]),
                "current_samples_per_s": 1 / _median(self.times["current"]),
                "speedup": c.speedup, "ci": [c.ci_low, c.ci_high], "window": self.window,
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
        return {"phase": self.phase, "phases": self.phases, "window": self.window, "result": self.result}


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
        self.watch: Watch | None = None
        self.trial: InJobTrial | None = None
        self.pause: tuple[Request, dict[str, Any]] | None = None
        """The request holding the job paused, and what status says of it."""
        self.last: dict[str, Any] = {}
        rd = job.rd
        self.server = ControlServer(rd.socket_path, rd.token(), self.status, self.validate)
        rd.update_run(socket=str(rd.socket_path))

    # -- what the socket thread may ask --------------------------------------------------

    def status(self) -> dict[str, Any]:
        s = self.job.session
        return {
            "status": self.job.state, "run_id": self.job.rd.run_id, "step": s.step,
            "total_steps": self.job.total, "world_size": s.world_size, "config": s.config.to_dict(),
            "config_id": s.config.config_id, "last": self.last,
            "watch": self.watch.to_dict() if self.watch else None,
            "trial": self.trial.to_dict() if self.trial else None, "pid": os.getpid(),
            "paused": self.pause[1] if self.pause and self.job.state == "paused" else None,
            "batch": {"size": s.batch_size, "workload": s.workload.batch_size,
                      "range": list(s.workload.batch_range) if s.workload.batch_range else None},
        }

    def validate(self, msg: dict[str, Any]) -> str | None:
        """Refuse bad requests in the socket thread, before they reach the training loop."""
        op = msg["op"]
        if op in ("apply", "trial"):
            try:
                config = TuningConfig.from_dict(msg.get("config"), where="config")
                resolve(config, self.job.tuners)
                check_batch(config, self.status())
            except TunekitError as exc:
                return str(exc)
            nproc = msg.get("nproc")
            if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or not 1 <= nproc <= 1024):
                return f"nproc must be an integer between 1 and 1024, not {nproc!r}"
            if op == "trial" and (nproc not in (None, self.job.session.world_size) or self._needs_relaunch(config)):
                return "an in-job trial can only try knobs that change at a step boundary"
            window = msg.get("window", msg.get("watch"))
            if window is not None and (not isinstance(window, int) or isinstance(window, bool) or not 2 <= window <= 10_000):
                return f"window must be an integer between 2 and 10000, not {window!r}"
        if op == "rollback" and self.watch is None and not self.job.applied:
            return "nothing to roll back: no config was applied to this job"
        return None

    def _needs_relaunch(self, config: TuningConfig) -> bool:
        current = self.job.session.config.plugins
        for name, knobs in config.plugins.items():
            tuner = self.job.tuners[name]
            full = tuner.validate(knobs)
            old = current.get(name, tuner.defaults())
            if any(k.live == "relaunch" and full[k.name] != old.get(k.name) for k in tuner.knobs()):
                return True
        for name in set(current) - set(config.plugins):
            tuner = self.job.tuners[name]
            if any(k.live == "relaunch" and current[name].get(k.name) != k.default for k in tuner.knobs()):
                return True
        return False

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
            req.answer({"ok": False, "error": f"the job is paused ({why}); {req.op} is refused until it resumes"})
            return None
        self.ids += 1
        self.waiting[self.ids] = req
        body = req.body
        if req.op == "stop":
            return {"op": STOP, "id": self.ids}
        if req.op == PAUSE:
            self.pause = (req, {"step": self.job.session.step, "reason": str(body.get("reason") or "")[:200]})
            return {"op": PAUSE, "id": self.ids}
        if req.op == "rollback":
            prev = self.job.applied[-1] if self.job.applied else self.job.session.config.to_dict()
            return {"op": "apply", "config": prev, "source": "rollback", "id": self.ids}
        config = TuningConfig.from_dict(body["config"]).to_dict()
        if req.op == "trial":
            self.trial = InJobTrial(req, config, self.job.session.config.to_dict(),
                                    int(body.get("window", self.window)), self.warm, self.min_effect)
            self.job.rd.log_event("trial_started", config=config, window=self.trial.window)
            del self.waiting[self.ids]
            return self.next_command()
        nproc = body.get("nproc")
        relaunch = (nproc is not None and nproc != self.job.session.world_size) or self._needs_relaunch(
            TuningConfig.from_dict(config))
        if relaunch:
            return {"op": RELAUNCH, "config": config, "nproc": nproc or self.job.session.world_size, "id": self.ids}
        return {"op": "apply", "config": config, "source": "user", "id": self.ids,
                "watch": int(body.get("watch", self.window))}

    def executed(self, cmd: dict, result: dict[str, Any]) -> None:
        """Answer the request behind ``cmd`` and start or end a watch."""
        rd = self.job.rd
        source = cmd.get("source")
        if cmd["op"] == "apply" and source == "user" and result.get("ok"):
            before = [t for (_, t, cid) in list(self.history)[-self.window:] if cid == result["prev_config_id"]]
            self.watch = Watch(before, int(cmd.get("watch", self.window)), self.warm, self.min_effect,
                               self.job.session.step, result["prev_config"], result["config"], result.get("checkpoint"))
            rd.log_event("applied", step=self.job.session.step, config=result["config"])
        elif cmd["op"] == "apply" and source in ("rollback", "watch"):
            rd.log_event("rolled_back", step=self.job.session.step, config=result.get("config"),
                         reason=cmd.get("reason", "requested"), ok=result.get("ok"))
            if self.watch is not None and source == "rollback":
                self.watch.state, self.watch.reason = "rolled_back", "rolled back on request"
        elif cmd["op"] == "apply" and not result.get("ok"):
            rd.log_event("apply_failed", step=self.job.session.step, error=result.get("error"))
        if cmd.get("finish_trial"):
            self._finish_trial()
        req = self.waiting.pop(cmd.get("id"), None)
        if req is not None:
            req.answer(result)

    def after_step(self, rec: StepRecord) -> None:
        s = self.job.session
        cid = s.config.config_id
        per_sample = rec.step_s / s.global_batch
        self.history.append((rec.step, per_sample, cid))
        self.last = {"step": rec.step, "loss": rec.loss, "step_s": rec.step_s,
                     "samples_per_s": s.global_batch / rec.step_s if rec.step_s else None}
        metric = {"step": rec.step, "loss": rec.loss, "step_s": rec.step_s, "samples_per_s": self.last["samples_per_s"],
                  "config_id": cid, "world_size": s.world_size, "batch_size": s.batch_size, "t": time.time()}
        if rec.metrics.get("overlap_R") is not None:
            metric["overlap_R"] = rec.metrics["overlap_R"]
        self.job.rd.append_metric(metric)
        self.server.publish(metric)
        if self.trial is not None:
            self.trial.update(per_sample)
        if self.watch is not None and self.watch.update(per_sample):
            self.internal.append({"op": "apply", "config": self.watch.info["prev_config"], "source": "watch",
                                  "reason": self.watch.reason})
            self.watch.state = "rolled_back"
        if self.watch is not None and self.watch.state in ("kept",) and not self.watch.info.get("logged"):
            self.watch.info["logged"] = True
            self.job.rd.log_event("watch_kept", step=s.step, reason=self.watch.reason)
        self.job.write_status()

    def _finish_trial(self) -> None:
        trial = self.trial
        self.trial = None
        self.job.rd.log_event("trial_finished", **trial.result)
        trial.request.answer({"ok": True, **trial.result, "config": self.job.session.config.to_dict()})

    def close(self) -> None:
        self.server.close()


# -- every rank ---------------------------------------------------------------------------


class LiveJob:
    def __init__(self, rd: RunDir):
        self.rd = rd
        self.spec = rd.read_run()
        self.ctx = init_from_env(self.spec.get("device", "auto"))
        world = self.ctx.world_size
        pids = rd.path / "pids"  # telemetry samples these processes
        pids.mkdir(exist_ok=True)
        for stale in pids.glob("rank*"):
            if int(stale.name.removeprefix("rank")) >= world:
                stale.unlink(missing_ok=True)
        (pids / f"rank{self.ctx.rank}").write_text(str(os.getpid()))
        # Control traffic rides a gloo group even when training uses NCCL.
        self.control_group = dist.new_group(backend="gloo") if world > 1 else None
        self.tuners = available_tuners()
        workload = load_workload(self.spec["workload"])
        self.session = Session(
            workload, rank=self.ctx.rank, world_size=world, local_rank=self.ctx.local_rank,
            device=self.ctx.device, group=self.ctx.group, backend=self.ctx.backend, seed=self.spec.get("seed"),
        )
        config = TuningConfig.from_dict(self.spec.get("config") or {})
        resume = self.spec.get("resume")
        if resume:
            state = RunDir.load_checkpoint(Path(resume))
            self.session.load_state_dict(state["session"])
            if self.spec.get("config") is None:
                config = TuningConfig.from_dict(state["session"]["config"])
            if self.ctx.rank == 0:
                rd.truncate_metrics(self.session.step)
        self.session.apply_config(config, self.tuners)
        self.applied: list[dict] = []  # configs replaced by user applies, newest last
        steps = self.spec.get("steps")
        self.total = int(steps) if steps is not None else None
        self.every = int(self.spec.get("checkpoint_every", 50))
        self.state = "running"
        self.controller = Controller(self) if self.ctx.rank == 0 else None
        if self.controller is not None:
            rd.log_event("started", step=self.session.step, world_size=world, config=config.to_dict(),
                         resumed=bool(resume))
            self.write_status()

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
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
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
            path = self.checkpoint()
            result = {"ok": True, "stopped_at": self.session.step, "checkpoint": str(path) if path else None}
            outcome = STOP
        elif op == RELAUNCH:
            path = self.checkpoint()
            if self.ctx.rank == 0:
                self.rd.relaunch_file.write_text(json.dumps(
                    {"config": cmd["config"], "nproc": cmd["nproc"], "checkpoint": str(path), "step": self.session.step}))
                self.rd.log_event("relaunch", step=self.session.step, nproc=cmd["nproc"], config=cmd["config"])
            result = {"ok": True, "relaunching": True, "step": self.session.step, "nproc": cmd["nproc"]}
            outcome = RELAUNCH
        else:
            result = {"ok": False, "error": f"unknown command {op}"}
        if self.controller is not None:
            self.controller.executed(cmd, result)
        return outcome

    def _hold(self, cmd: dict) -> str | None:
        """Every rank waits at this step boundary until rank 0 passes on a resume (or a stop).

        Rank 0 paces the wait; the others sit in the command broadcast, which
        an empty command every 0.1 s keeps well inside the group's timeout.
        """
        self.state = "paused"
        if self.controller is not None:
            self.controller.executed(cmd, {"ok": True, "paused_at": self.session.step})
            self.rd.log_event("paused", step=self.session.step, reason=self.controller.pause[1]["reason"])
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
                    self.rd.log_event("resumed", step=self.session.step)
                    self.write_status()
                return None
            outcome = self.execute(nxt)
            if outcome is not None:
                return outcome

    def _apply(self, cmd: dict) -> dict[str, Any]:
        s = self.session
        prev = s.config
        checkpoint = self.checkpoint() if cmd.get("source") == "user" else None
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
            return {"ok": False, "error": f"{why}; rolled back to the previous config", "rolled_back": True,
                    "config": prev.to_dict()}
        if cmd.get("source") == "user":
            self.applied.append(prev.to_dict())
        elif cmd.get("source") in ("rollback", "watch") and self.applied:
            self.applied.pop()
        return {"ok": True, "step": s.step, "config": s.config.to_dict(), "prev_config": prev.to_dict(),
                "prev_config_id": prev.config_id, "checkpoint": str(checkpoint) if checkpoint else None}

    # -- state ---------------------------------------------------------------------------

    def checkpoint(self) -> Path | None:
        """Flush every rank; rank 0 saves (data-parallel replicas are identical)."""
        state = self.session.state_dict()
        path = None
        if self.ctx.rank == 0:
            path = self.rd.save_checkpoint(self.session.step, {"session": state, "world_size": self.ctx.world_size})
        if self.control_group is not None:
            dist.barrier(group=self.control_group)
        return path or self.rd.checkpoints / f"step-{self.session.step:08d}.pt"

    def write_status(self) -> None:
        if self.controller is not None:
            self.rd.write_status(self.controller.status())

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
                if self.controller is not None:
                    self.controller.after_step(rec)
                if self.every and self.session.step % self.every == 0:
                    self.checkpoint()
            if outcome is None:
                self.checkpoint()
            self.state = {STOP: "stopped", RELAUNCH: "relaunching", None: "finished"}[outcome]
            self.write_status()
            if self.controller is not None:
                self.rd.log_event(self.state, step=self.session.step)
        finally:
            if self.controller is not None:
                self.controller.close()
            self.session.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tunekit.runtime.live RUN_DIR", file=sys.stderr)
        return 2
    return LiveJob(RunDir(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main())
