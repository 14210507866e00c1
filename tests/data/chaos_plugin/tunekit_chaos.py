"""A test-only tuner whose candidates crash, hang or run out of memory on purpose.

Tests put this folder on PYTHONPATH; its ``tunekit_chaos-0.1.dist-info``
registers the entry point, so tunekit and every trial worker discover it
exactly as they would an installed third-party plugin.
"""

import time

import torch

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner


class Chaos(Tuner):
    name = "chaos"
    title = "Fault injection (tests only)"
    aspect = Aspect.DATA

    def knobs(self):
        return [Knob("mode", "choice", "ok", "what the trial does", choices=("ok", "raise", "hang", "oom", "slow", "bad_hook"))]

    def diagnose(self, obs):
        return Diagnosis(True, "injects faults into trials", expected_gain=0.5)

    def plan(self, obs, limit):
        modes = ["raise", "hang", "oom", "ok"]
        return [Candidate({"mode": m}, obs.baseline.median_s, f"mode {m}") for m in modes][:limit]

    def apply(self, session, knobs):
        mode = knobs["mode"]
        if mode == "ok":
            return
        if mode == "bad_hook":
            raise RuntimeError("chaos: the runtime hook failed")

        def step(session, step):
            if mode == "slow":
                time.sleep(0.15)  # a regression: same maths, slower steps
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
