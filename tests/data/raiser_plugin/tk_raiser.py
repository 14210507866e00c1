"""A test-only tuner whose diagnose raises where a plugin author's bug would: in a helper of
its own (``RAISER_DIAGNOSE=raise``). Otherwise it diagnoses that it does not apply and still
plans a candidate (``tunekit plan --always-plan`` shows it, marked "not applying")."""

import os

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner


def _used_mb(obs):
    memory = {"rss_bytes": 1}
    return memory["used_mb"]  # the bug: a key the telemetry never had


class Raiser(Tuner):
    name, title, aspect = "raiser", "Raises in diagnose (tests only)", Aspect.DATA
    api_version = 1

    def knobs(self):
        return [Knob("level", "int", 0, "how much", low=0, high=3)]

    def diagnose(self, obs):
        if os.environ.get("RAISER_DIAGNOSE") == "raise":
            _used_mb(obs)
        return Diagnosis(False, "the job has memory to spare (tests)")

    def plan(self, obs, limit):
        return [Candidate({"level": 1}, 0.05, "level 1, in case it helps")][:limit]

    def apply(self, session, knobs):
        pass
