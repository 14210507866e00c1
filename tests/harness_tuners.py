"""Tuners for the conformance harness's own tests, importable by spawned ranks (``tests`` is on
the path): a correct one whose hook changes nothing, and one whose hook changes the math."""

from __future__ import annotations

from tunekit.api import Session
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner


class Harmless(Tuner):
    """A correct plugin: its knob changes nothing the training computes."""

    name, title, aspect = "harmless", "Harmless (tests only)", Aspect.DATA
    api_version = 1

    def knobs(self):
        return [Knob("x", "int", 0, "a setting with no effect", low=0, high=1)]

    def diagnose(self, obs):
        return Diagnosis(True, "always applies (tests)", expected_gain=0.1)

    def plan(self, obs, limit):
        return [Candidate({"x": 1}, 0.05, "x=1")][:limit]

    def apply(self, session: Session, knobs):
        pass


class DetachesBlockInputs(Tuner):
    """What an activation-checkpointing plugin gets wrong: each transformer block's input
    is detached, so no gradient reaches what lies before the block. Its knob is not marked
    ``changes_math``."""

    name, title, aspect = "detaches_block_inputs", "Detaches block inputs (tests only)", Aspect.DATA
    api_version = 1

    def knobs(self):
        return [Knob("checkpoint_blocks", "bool", False, "recompute each block in backward")]

    def diagnose(self, obs):
        return Diagnosis(True, "blocks hold most activations (tests)", expected_gain=0.1)

    def plan(self, obs, limit):
        return [Candidate({"checkpoint_blocks": True}, 0.05, "checkpoint every block")][:limit]

    def apply(self, session: Session, knobs):
        if not knobs["checkpoint_blocks"]:
            return
        for block in session.model.blocks:
            handle = block.register_forward_pre_hook(
                lambda module, args: tuple(a.detach() for a in args)
            )
            session.on_reset(handle.remove)


class DetachesBesideAHarmlessKnob(DetachesBlockInputs):
    """Plans a knob set that moves the detaching knob and a harmless one together."""

    name = "detaches_beside"

    def knobs(self):
        return [*super().knobs(), Knob("verbose", "bool", False, "log each block (no effect)")]

    def plan(self, obs, limit):
        return [Candidate({"checkpoint_blocks": True, "verbose": True}, 0.05, "both")][:limit]


class NeverPlansItsKnob(DetachesBlockInputs):
    """Diagnoses, but plans nothing: the harness must try the bool knob itself."""

    name = "never_plans"

    def plan(self, obs, limit):
        return []


class SaysItChangesTheMath(DetachesBlockInputs):
    """The same hook with its knob marked ``changes_math``: trading exactness is its purpose."""

    name = "says_so"

    def knobs(self):
        return [
            Knob(
                "checkpoint_blocks",
                "bool",
                False,
                "stop gradients at each block (an approximation)",
                changes_math=True,
            )
        ]


def _used_mb(obs):
    memory = {"rss_bytes": 1}
    return memory["used_mb"]  # the bug: a key the telemetry never had


class RaisesInDiagnose(Harmless):
    """A diagnose with a bug in a helper of the plugin's own."""

    name = "raises_in_diagnose"

    def diagnose(self, obs):
        _used_mb(obs)
        return super().diagnose(obs)


class AppliesNever(Harmless):
    """Diagnoses that it does not apply, and still has a plan."""

    name = "applies_never"

    def diagnose(self, obs):
        return Diagnosis(False, "nothing to gain here (tests)")
