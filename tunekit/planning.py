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

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, cast

from tunekit.config import TuningConfig, resolve
from tunekit.contract import Candidate, Diagnosis, Tuner
from tunekit.diagnosis_text import headline_of
from tunekit.events import Diagnosed, Planned, PluginProblem
from tunekit.observe.observation import Observation
from tunekit.observe.workload_process import (
    ChildRaised,
    ObservationFailed,
    WorkloadProcess,
    observation_parts,
)

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

    def event(self) -> PluginProblem:
        return PluginProblem(self.name, "", f"{self.hook} failed", self.problem)


TunerStep = TunerDiagnosed | TunerPlanned | TunerFailed


# -- how the hooks are called --------------------------------------------------------------


class HookFailed(Exception):
    """A tuner's hook failed; the message is the one line on why."""


class TunerHooks(Protocol):
    """Calls a tuner's hooks on the observation; a failure is :class:`HookFailed`."""

    async def diagnose(self, name: str) -> Diagnosis: ...

    async def plan(self, name: str, limit: int) -> list[Candidate]: ...


async def diagnose_and_plan(
    tuners: Mapping[str, Tuner], hooks: TunerHooks, limit: int
) -> AsyncIterator[TunerStep]:
    """For each tuner in order: its diagnosis (or failure), then, if it applies, its plan of at
    most ``limit`` candidates (or failure)."""
    for name, tuner in tuners.items():
        try:
            diagnosis = await hooks.diagnose(name)
        except HookFailed as exc:
            yield TunerFailed(name, "diagnose", str(exc))
            continue
        yield TunerDiagnosed(name, diagnosis)
        if not diagnosis.applies:
            continue
        try:
            candidates = [
                c
                for c in await hooks.plan(name, limit)
                if all(other in tuners for other in c.combined_with)
            ]
            configs = [candidate_config(tuner, c, tuners) for c in candidates]
        except HookFailed as exc:
            yield TunerFailed(name, "plan", str(exc), diagnosis)
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


class ChildHooks:
    """The hooks in the workload's process (the one that observed it; a fresh one, set up with
    the observation, after a tuner kills it), each under the process's timeout."""

    def __init__(self, child: WorkloadProcess, obs: Observation):
        self.child = child
        self.cache = obs.cache
        self.parts = observation_parts(obs, obs.cache.items() if obs.cache is not None else {})
        child.setup = {"op": "observation", "parts": self.parts}

    async def diagnose(self, name: str) -> Diagnosis:
        return Diagnosis(**(await self._call("diagnose", name))["diagnosis"])

    async def plan(self, name: str, limit: int) -> list[Candidate]:
        return [Candidate(**c) for c in (await self._call("plan", name, limit=limit))["candidates"]]

    async def _call(self, hook: str, name: str, **args: Any) -> dict[str, Any]:
        reply, problem = await tuner_hook(self.child, hook, name, self.parts, self.cache, **args)
        if problem:
            raise HookFailed(problem)
        return reply


async def tuner_hook(
    child: WorkloadProcess, hook: str, name: str, parts: dict[str, Any], cache, **args: Any
) -> tuple[dict[str, Any], str | None]:
    """One tuner hook's reply, or the one line on why it failed; keeps what the tuner cached."""
    try:
        reply = await child.call(hook, f"running {name}'s {hook}", plugin=name, **args)
    except ChildRaised as exc:
        return {}, exc.one_line()
    except ObservationFailed as exc:
        if (
            exc.setup
        ):  # the workload no longer loads: no tuner can run, and that is not theirs to report
            raise
        return {}, str(exc)
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
            raise HookFailed(f"{type(exc).__name__}: {exc}") from exc

    async def plan(self, name: str, limit: int) -> list[Candidate]:
        try:
            return self.tuners[name].plan(self.obs, limit)
        except Exception as exc:
            raise HookFailed(f"{type(exc).__name__}: {exc}") from exc


def diagnose_and_plan_here(
    tuners: Mapping[str, Tuner], obs: Observation, limit: int
) -> Iterator[TunerStep]:
    """:func:`diagnose_and_plan` with the hooks called in this process, blocking (the TUI's worker thread).

    No event loop runs it: the in-process hooks never wait on anything, so each step is driven
    by hand, and a tuner runs exactly as when called directly, free to start a loop of its own
    (``asyncio.run``), which it could not inside a running one.
    """
    steps = diagnose_and_plan(tuners, InProcessHooks(tuners, obs), limit)
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
