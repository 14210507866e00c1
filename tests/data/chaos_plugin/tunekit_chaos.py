"""A test-only tuner whose candidates crash, hang or run out of memory on purpose.

Tests put this folder on PYTHONPATH; its ``tunekit_chaos-0.1.dist-info``
registers the entry point, so tunekit and every trial worker discover it
exactly as they would an installed third-party plugin.

``TUNEKIT_CHAOS_PLAN`` (JSON: a list of knob dicts, each with an optional
``predicted_s``) replaces its plan, so a test chooses both the candidates and
what the "cost model" predicts for them. ``TUNEKIT_CHAOS_DIAGNOSE`` (segfault,
hang or exit) makes its diagnose end the process it runs in.
"""

import json
import os
import time

import torch

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner


class Chaos(Tuner):
    name = "chaos"
    title = "Fault injection (tests only)"
    aspect = Aspect.DATA

    def knobs(self):
        return [
            Knob(
                "mode",
                "choice",
                "ok",
                "what the trial does",
                choices=("ok", "raise", "hang", "oom", "slow", "bad_hook", "hold_memory"),
            ),
            Knob(
                "sleep_s",
                "float",
                0.15,
                "seconds the slow mode adds to every step",
                low=0.0,
                high=600.0,
            ),
            Knob(
                "hold_mb",
                "int",
                0,
                "hold_memory mode: MiB the runtime hook allocates and keeps (a real peak)",
                low=0,
                high=4096,
            ),
        ]

    def diagnose(self, obs):
        fault = os.environ.get("TUNEKIT_CHAOS_DIAGNOSE")
        if fault == "segfault":
            import ctypes

            ctypes.string_at(0)
        elif fault == "hang":
            while True:
                time.sleep(1)
        elif fault == "exit":
            os._exit(0)
        return Diagnosis(True, "injects faults into trials", expected_gain=0.5)

    def plan(self, obs, limit):
        if os.environ.get("TUNEKIT_CHAOS_PLAN"):
            planned = json.loads(os.environ["TUNEKIT_CHAOS_PLAN"])
            return [
                Candidate(
                    {k: v for k, v in c.items() if k != "predicted_s"},
                    c.get("predicted_s"),
                    "planned by the test",
                )
                for c in planned
            ][:limit]
        modes = ["raise", "hang", "oom", "ok"]
        return [Candidate({"mode": m}, obs.baseline.median_s, f"mode {m}") for m in modes][:limit]

    def apply(self, session, knobs):
        mode = knobs["mode"]
        if mode == "ok":
            return
        if mode == "bad_hook":
            raise RuntimeError("chaos: the runtime hook failed")
        if mode == "hold_memory":  # memory held through every step: a real, measured peak
            session.chaos_held = torch.ones(knobs["hold_mb"] * 2**18)
            session.on_reset(lambda: setattr(session, "chaos_held", None))
            return

        def step(session, step):
            if mode == "slow":
                time.sleep(knobs["sleep_s"])  # a regression: same maths, slower steps
            elif step >= 1:
                if mode == "raise":
                    raise RuntimeError("chaos: injected failure")
                if mode == "oom":
                    raise torch.OutOfMemoryError("CUDA out of memory (chaos: injected)")
                while True:
                    time.sleep(1)
            inputs, targets = session.data.batch(step)
            loss = session.workload.loss(session.grad_sync.module(inputs), targets)
            loss.backward()
            session.grad_sync.step(session.optimizer)
            session.optimizer.zero_grad(set_to_none=True)
            return loss

        session.step_fn = step
