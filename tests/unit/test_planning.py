"""The diagnose-and-plan loop the CLI and the TUI share, and the apply outcome they print."""

import asyncio
import re

from tunekit.contract import Aspect, Candidate, Diagnosis
from tunekit.observe.workload_process import ObservationFailed
from tunekit.planning import (
    TunerDiagnosed,
    TunerFailed,
    TunerPlanned,
    diagnose_and_plan_here,
    diagnose_and_plan_side_by_side,
)
from tunekit.runtime.client import ApplyOutcome


class FakeTuner:
    def __init__(self, name, applies=True, fails=None, bad_knobs=False):
        self.name, self.applies, self.fails, self.bad_knobs = name, applies, fails, bad_knobs

    def diagnose(self, obs):
        if self.fails == "diagnose":
            raise ValueError("no model")
        asyncio.run(
            asyncio.sleep(0)
        )  # a tuner may start a loop of its own, as when called directly
        return Diagnosis(self.applies, f"{self.name} summary", 0.1)

    def plan(self, obs, limit):
        if self.fails == "plan":
            raise KeyError("k")
        return [Candidate({"k": i}, 0.5 + i, "why") for i in range(limit)]

    def validate(self, knobs):
        if self.bad_knobs:
            raise ValueError("k out of range")
        return {**knobs, "default": 1}


def test_each_tuner_diagnoses_then_plans_and_a_failing_one_leaves_the_rest_running():
    tuners = {
        t.name: t
        for t in (
            FakeTuner("a"),
            FakeTuner("b", applies=False),
            FakeTuner("c", fails="diagnose"),
            FakeTuner("d", fails="plan"),
            FakeTuner("e", bad_knobs=True),
            FakeTuner("f"),
        )
    }
    steps = list(diagnose_and_plan_here(tuners, object(), 2))
    assert [(type(s).__name__, s.name) for s in steps] == [
        ("TunerDiagnosed", "a"),
        ("TunerPlanned", "a"),
        ("TunerDiagnosed", "b"),
        ("TunerFailed", "c"),
        ("TunerDiagnosed", "d"),
        ("TunerFailed", "d"),
        ("TunerDiagnosed", "e"),
        ("TunerFailed", "e"),
        ("TunerDiagnosed", "f"),
        ("TunerPlanned", "f"),
    ]
    planned = steps[1]
    assert isinstance(planned, TunerPlanned)
    assert [c.knobs for c in planned.candidates] == [{"k": 0}, {"k": 1}]  # as planned
    assert [cfg.plugins["a"] for cfg in planned.configs] == [
        {"k": 0, "default": 1},
        {"k": 1, "default": 1},
    ]
    failed = {s.name: s for s in steps if isinstance(s, TunerFailed)}
    assert (failed["c"].hook, failed["c"].problem, failed["c"].diagnosis) == (
        "diagnose",
        "ValueError: no model",
        None,
    )
    assert (failed["d"].hook, failed["d"].problem) == ("plan", "KeyError: 'k'")
    assert (failed["e"].hook, failed["e"].problem) == ("plan", "ValueError: k out of range")
    assert failed["e"].diagnosis is not None


def test_the_steps_become_the_orchestrators_events():
    steps = list(
        diagnose_and_plan_here(
            {"a": FakeTuner("a"), "c": FakeTuner("c", fails="diagnose")}, object(), 1
        )
    )
    assert isinstance(steps[0], TunerDiagnosed)
    events = [s.event().to_dict() for s in steps]
    # A hook that raised: its one line says where in the plugin; the traceback goes with it.
    raised = events[-1]
    assert re.fullmatch(
        r"ValueError: no model \(at (unit/)?test_planning\.py:\d+ in diagnose\)", raised["error"]
    )
    assert raised.pop("traceback").startswith("Traceback (most recent call last)")
    raised["error"] = "ValueError: no model"
    assert events == [
        {
            "event": "Diagnosed",
            "plugin": "a",
            "applies": True,
            "summary": "a summary",
            "expected_gain": 0.1,
            "headline": "applies · +10% · a summary",
        },
        {
            "event": "Planned",
            "plugin": "a",
            "candidates": [
                {
                    "knobs": {"k": 0},
                    "predicted_step_s": 0.5,
                    "rationale": "why",
                    "details": {},
                    "predicted_range_s": None,
                    "global_batch": None,
                    "predicted_peak_bytes": None,
                    "combined_with": {},
                    "search": False,
                }
            ],
        },
        {
            "event": "PluginProblem",
            "plugin": "c",
            "package": "",
            "status": "diagnose failed",
            "error": "ValueError: no model",
        },
    ]


def test_an_apply_outcome_is_the_dict_apply_to_run_returned():
    reply = {"ok": True, "step": 60, "config": {}}
    waited = ApplyOutcome("applied at step 60; kept: faster", reply, rolled_back=False)
    assert list(waited.to_dict().items()) == [
        ("message", "applied at step 60; kept: faster"),
        ("rolled_back", False),
        ("ok", True),
        ("step", 60),
        ("config", {}),
    ]
    assert ApplyOutcome("applied at step 60; watching", reply).to_dict() == {
        "message": "applied at step 60; watching",
        **reply,
    }
    relaunch = ApplyOutcome("relaunching", {"ok": True, "relaunching": True, "nproc": 1, "step": 3})
    assert relaunch.relaunching and not waited.relaunching


class SlowHooks:
    """Hooks whose diagnose takes ``delays[name]`` seconds; records which tuners it ran."""

    def __init__(self, tuners, delays, broken=None):
        self.tuners, self.delays, self.broken, self.ran = tuners, delays, broken, []

    async def diagnose(self, name):
        self.ran.append(name)
        await asyncio.sleep(self.delays.get(name, 0.0))
        if name == self.broken:
            raise ObservationFailed("crash", "the workload no longer loads", setup=True)
        return Diagnosis(self.tuners[name].applies, f"{name} summary", 0.1)

    async def plan(self, name, limit):
        return self.tuners[name].plan(None, limit)


def test_side_by_side_the_tuners_are_shared_out_and_their_steps_come_in_order():
    tuners = {n: FakeTuner(n, applies=n != "c") for n in "abcde"}
    # a is slow: the other process takes b, c, d and e meanwhile.
    one, two = SlowHooks(tuners, {"a": 0.2}), SlowHooks(tuners, {})

    async def run():
        return [s async for s in diagnose_and_plan_side_by_side(tuners, [one, two], 1)]

    steps = asyncio.run(run())
    assert one.ran == ["a"] and two.ran == ["b", "c", "d", "e"]
    assert [(type(s).__name__, s.name) for s in steps] == [
        ("TunerDiagnosed", "a"), ("TunerPlanned", "a"), ("TunerDiagnosed", "b"),
        ("TunerPlanned", "b"), ("TunerDiagnosed", "c"), ("TunerDiagnosed", "d"),
        ("TunerPlanned", "d"), ("TunerDiagnosed", "e"), ("TunerPlanned", "e"),
    ]  # fmt: skip


class AspectTuner(FakeTuner):
    """A tuner of ``aspect``; with a ``partner``, it plans one candidate with the partner's
    knobs beside its own (``combined_with``)."""

    excludes = frozenset()

    def __init__(self, name, aspect, partner=None):
        super().__init__(name)
        self.aspect, self.partner = aspect, partner

    def plan(self, obs, limit):
        if self.partner is None:
            return super().plan(obs, limit)
        return [Candidate({"k": 1}, 0.4, "with", combined_with={self.partner: {"k": 2}})]


def test_side_by_side_a_candidate_planned_with_another_tuner_keeps_it():
    """Each process diagnoses one tuner at a time; a combined candidate is still checked
    against every tuner in use, not dropped for want of its partner."""
    tuners = {
        "a": AspectTuner("a", Aspect.LAYOUT, partner="b"),
        "b": AspectTuner("b", Aspect.BATCH),
        "c": AspectTuner("c", Aspect.DATA, partner="x"),
    }

    async def run():
        hooks = [SlowHooks(tuners, {}), SlowHooks(tuners, {})]
        return [s async for s in diagnose_and_plan_side_by_side(tuners, hooks, 1)]

    planned = {s.name: s for s in asyncio.run(run()) if isinstance(s, TunerPlanned)}
    assert [cfg.plugins for cfg in planned["a"].configs] == [
        {"a": {"k": 1, "default": 1}, "b": {"k": 2, "default": 1}}
    ]
    assert planned["c"].candidates == []  # its partner "x" is not in use


def test_side_by_side_a_workload_that_no_longer_loads_stops_at_its_tuner():
    tuners = {n: FakeTuner(n) for n in "abc"}
    hooks = [SlowHooks(tuners, {"a": 0.1}, broken="b"), SlowHooks(tuners, {}, broken="b")]

    async def run():
        seen = []
        try:
            async for s in diagnose_and_plan_side_by_side(tuners, hooks, 1):
                seen.append(s.name)
        except ObservationFailed as exc:
            return seen, str(exc)
        return seen, None

    assert asyncio.run(run()) == (["a", "a"], "the workload no longer loads")
