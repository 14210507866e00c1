"""Every tuner's diagnose, then its plan where it applies, on one :class:`Observation`.

One loop, :func:`diagnose_and_plan`, for ``tunekit auto`` (the orchestrator keeps the
results for its schedule and the store), ``tunekit plan`` (one tuner, printed) and the
TUI (one result per tuner, in a worker thread). Each calls the tuners' hooks its own way
(:class:`TunerHooks`): in the workload's process (:class:`ChildHooks`; ``auto`` and
``plan``), or here (:func:`diagnose_and_plan_here`; the TUI, whose observation loaded the
workload in this process). A tuner that fails is one step saying so, and the next tuner
runs regardless: a broken plugin must not stop the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, cast

from tunekit.config import TuningConfig, resolve
from tunekit.contract import Candidate, Diagnosis, Tuner
from tunekit.diagnosis_text import headline_of
from tunekit.events import Diagnosed, Planned, PluginProblem
from tunekit.failures import Failure
from tunekit.observe.observation import Observation
from tunekit.observe.workload_process import (
    ChildRaised,
    ObservationFailed,
    WorkloadProcess,
    observation_parts,
)
from tunekit.timings import Timings

# -- what the loop yields, tuner by tuner --------------------------------------------------


@dataclass(frozen=True)
class TunerDiagnosed:
    """A tuner's diagnosis; its plan follows (as :class:`TunerPlanned` or :class:`TunerFailed`)
    when the diagnosis applies."""

    name: str
    diagnosis: Diagnosis

    def event(self) -> Diagnosed:
        d = self.diagnosis
        return Diagnosed(self.name, d.applies, d.summary, d.expected_gain, headline_of(d))


@dataclass(frozen=True)
class TunerPlanned:
    """A tuner's candidates as it planned them, each with its config (the knobs validated)."""

    name: str
    diagnosis: Diagnosis
    candidates: list[Candidate]
    configs: list[TuningConfig]
    """One per candidate: ``{name: tuner.validate(candidate.knobs)}``."""

    def event(self) -> Planned:
        return Planned(self.name, [asdict(c) for c in self.candidates])


@dataclass(frozen=True)
class TunerFailed:
    """A tuner's ``diagnose`` or ``plan`` failed (or planned knobs its own ``validate`` refuses)."""

    name: str
    hook: Literal["diagnose", "plan"]
    problem: str
    """One line."""
    diagnosis: Diagnosis | None = None
    """The diagnosis, when its plan failed."""
    where: str = ""
    """``file:line in function`` in the plugin where it raised (empty when it did not raise)."""
    traceback: str = ""

    def event(self) -> PluginProblem:
        where = f" (at {self.where})" if self.where else ""
        return PluginProblem(
            self.name, "", f"{self.hook} failed", self.problem + where, self.traceback
        )

    def to_dict(self) -> dict[str, Any]:
        """As the study keeps it (the report's problems)."""
        return {
            "plugin": self.name,
            "what": f"{self.hook} failed",
            "error": self.problem,
            "where": self.where,
            "traceback": self.traceback,
        }


TunerStep = TunerDiagnosed | TunerPlanned | TunerFailed


# -- how the hooks are called --------------------------------------------------------------


class HookFailed(Exception):
    """A tuner's hook failed; the message is the one line on why, ``where`` and ``traceback``
    say where in the plugin it raised (empty when it did not raise: a hang, a crash)."""

    def __init__(self, message: str, where: str = "", traceback: str = ""):
        super().__init__(message)
        self.where = where
        self.traceback = traceback


class TunerHooks(Protocol):
    """Calls a tuner's hooks on the observation; a failure is :class:`HookFailed`."""

    async def diagnose(self, name: str) -> Diagnosis: ...

    async def plan(self, name: str, limit: int) -> list[Candidate]: ...


async def diagnose_and_plan(
    tuners: Mapping[str, Tuner],
    hooks: TunerHooks,
    limit: int,
    plan_always: bool = False,
    in_use: Mapping[str, Tuner] | None = None,
) -> AsyncIterator[TunerStep]:
    """For each tuner in order: its diagnosis (or failure), then, if it applies (or
    ``plan_always``: ``tunekit plan --always-plan``), its plan of at most ``limit``
    candidates (or failure). A candidate planned with other tuners (``combined_with``) is kept
    when they are all ``in_use`` (default: ``tuners``)."""
    in_use = tuners if in_use is None else in_use
    for name, tuner in tuners.items():
        try:
            diagnosis = await hooks.diagnose(name)
        except HookFailed as exc:
            yield TunerFailed(name, "diagnose", str(exc), None, exc.where, exc.traceback)
            continue
        yield TunerDiagnosed(name, diagnosis)
        if not diagnosis.applies and not plan_always:
            continue
        try:
            candidates = [
                c
                for c in await hooks.plan(name, limit)
                if all(other in in_use for other in c.combined_with)
            ]
            configs = [candidate_config(tuner, c, in_use) for c in candidates]
        except HookFailed as exc:
            yield TunerFailed(name, "plan", str(exc), diagnosis, exc.where, exc.traceback)
            continue
        except Exception as exc:  # knobs its own validate refuses
            yield TunerFailed(name, "plan", f"{type(exc).__name__}: {exc}", diagnosis)
            continue
        yield TunerPlanned(name, diagnosis, candidates, configs)


def candidate_config(
    tuner: Tuner, candidate: Candidate, tuners: Mapping[str, Tuner]
) -> TuningConfig:
    """The config a candidate runs: its tuner's knobs, and those of the tuners it was planned
    with (``Candidate.combined_with``), each validated, the whole checked as a combination."""
    config = TuningConfig(
        {
            tuner.name: tuner.validate(candidate.knobs),
            **{n: tuners[n].validate(k) for n, k in candidate.combined_with.items()},
        }
    )
    if candidate.combined_with:
        resolve(config, tuners)
    return config


async def diagnose_and_plan_side_by_side(
    tuners: Mapping[str, Tuner], hooks: Sequence[TunerHooks], limit: int
) -> AsyncIterator[TunerStep]:
    """:func:`diagnose_and_plan` with the tuners shared out among ``hooks`` (each its own
    workload process): each takes the next tuner as soon as it is done with its last, and the
    steps come out in the tuners' order. An error that stops every tuner (the workload no
    longer loads) is raised where that tuner's steps would come."""
    loop = asyncio.get_running_loop()
    queue = deque(tuners)
    steps: dict[str, asyncio.Future[list[TunerStep]]] = {n: loop.create_future() for n in tuners}

    async def work(hook: TunerHooks) -> None:
        while queue:
            name = queue.popleft()
            try:
                one = {name: tuners[name]}
                got = [s async for s in diagnose_and_plan(one, hook, limit, in_use=tuners)]
            except Exception as exc:  # noqa: BLE001 - raised to the caller, in order
                steps[name].set_exception(exc)
                return
            steps[name].set_result(got)

    workers = [asyncio.create_task(work(h)) for h in hooks]
    try:
        for name in tuners:
            for step in await steps[name]:
                yield step
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        for future in steps.values():  # none left unretrieved
            if future.done() and not future.cancelled():
                future.exception()


class ChildHooks:
    """The hooks in the workload's process (the one that observed it; a fresh one, set up with
    the observation, after a tuner kills it), each under the process's timeout."""

    def __init__(
        self,
        child: WorkloadProcess,
        obs: Observation,
        timings: Timings | None = None,
        part_of: str = "",
    ):
        self.child = child
        self.timings = timings or Timings()
        self.part_of = part_of
        """The stage each hook's timing is part of, when it runs beside others' (see Stage)."""
        self.cache = obs.cache
        self.parts = observation_parts(obs, obs.cache.items() if obs.cache is not None else {})
        child.setup = {"op": "observation", "parts": self.parts}

    async def diagnose(self, name: str) -> Diagnosis:
        return Diagnosis(**(await self._call("diagnose", name))["diagnosis"])

    async def plan(self, name: str, limit: int) -> list[Candidate]:
        return [Candidate(**c) for c in (await self._call("plan", name, limit=limit))["candidates"]]

    async def _call(self, hook: str, name: str, **args: Any) -> dict[str, Any]:
        with self.timings.stage(f"{hook} {name}", part_of=self.part_of) as stage:
            reply, problem = await tuner_hook(
                self.child, hook, name, self.parts, self.cache, **args
            )
            stage.cpu_s = self.child.take_cpu_s()
        if problem:
            raise problem
        return reply


async def tuner_hook(
    child: WorkloadProcess, hook: str, name: str, parts: dict[str, Any], cache, **args: Any
) -> tuple[dict[str, Any], HookFailed | None]:
    """One tuner hook's reply, or why it failed (one line, and where it raised); keeps what
    the tuner cached."""
    try:
        reply = await child.call(hook, f"running {name}'s {hook}", plugin=name, **args)
    except ChildRaised as exc:
        return {}, HookFailed(exc.one_line(), exc.where, exc.traceback)
    except ObservationFailed as exc:
        if (
            exc.setup
        ):  # the workload no longer loads: no tuner can run, and that is not theirs to report
            raise
        return {}, HookFailed(str(exc))
    for key, value in reply.get("cache_puts", {}).items():
        parts["cache"][key] = value  # a fresh child, after a tuner killed this one, starts with it
        if cache is not None:
            cache.put(key, value)
    return reply, None


class InProcessHooks:
    """The hooks called in this process, on an observation whose workload was loaded here."""

    def __init__(self, tuners: Mapping[str, Tuner], obs: Observation):
        self.tuners = tuners
        self.obs = obs

    async def diagnose(self, name: str) -> Diagnosis:
        try:
            return self.tuners[name].diagnose(self.obs)
        except Exception as exc:  # the plugin's own code
            raise self._failed(name, exc) from exc

    async def plan(self, name: str, limit: int) -> list[Candidate]:
        try:
            return self.tuners[name].plan(self.obs, limit)
        except Exception as exc:
            raise self._failed(name, exc) from exc

    def _failed(self, name: str, exc: Exception) -> HookFailed:
        failure = Failure.of(exc, type(self.tuners[name]))
        return HookFailed(failure.line, failure.where, failure.traceback)


def diagnose_and_plan_here(
    tuners: Mapping[str, Tuner],
    obs: Observation,
    limit: int,
    plan_always: bool = False,
    hooks: TunerHooks | None = None,
) -> Iterator[TunerStep]:
    """:func:`diagnose_and_plan` with the hooks called in this process, blocking (the TUI's worker thread).

    No event loop runs it: the in-process hooks never wait on anything, so each step is driven
    by hand, and a tuner runs exactly as when called directly, free to start a loop of its own
    (``asyncio.run``), which it could not inside a running one. ``hooks`` (default
    :class:`InProcessHooks`) must not wait either; a subclass may say which hook runs.
    """
    steps = diagnose_and_plan(tuners, hooks or InProcessHooks(tuners, obs), limit, plan_always)
    try:
        while True:
            try:
                cast(Coroutine[Any, Any, TunerStep], steps.__anext__()).send(None)
            except StopIteration as done:
                yield done.value
            except StopAsyncIteration:
                return
            else:
                raise RuntimeError("an in-process tuner hook waited on something")
    finally:
        with contextlib.suppress(StopIteration, RuntimeError):
            cast(AsyncGenerator[TunerStep, None], steps).aclose().send(None)
