"""The diagnose-and-plan loop the CLI and the TUI share, and the apply outcome they print."""

import asyncio

from tunekit.contract import Candidate, Diagnosis
from tunekit.planning import TunerDiagnosed, TunerFailed, TunerPlanned, diagnose_and_plan_here
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
    assert [s.event().to_dict() for s in steps] == [
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
