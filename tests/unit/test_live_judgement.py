"""Rank 0's verdicts in a live job: the watch after an apply, and in-job trials."""

import numpy as np

from tunekit.runtime.control import Request
from tunekit.runtime.live import InJobTrial, Watch


def _steps(per_sample: float, n: int, seed: int) -> list[float]:
    return list(per_sample * np.random.default_rng(seed).normal(1, 0.01, n))


def _watch(before: list[float]) -> Watch:
    return Watch(
        before,
        window=8,
        warm=2,
        min_effect=0.02,
        step=100,
        prev={"p": 0},
        new={"p": 1},
        checkpoint=None,
    )


def test_watch_rolls_back_a_slowdown_beyond_noise():
    w = _watch(_steps(1e-3, 10, 0))
    verdicts = [w.update(x) for x in _steps(1.3e-3, 10, 1)]  # 30% less throughput
    assert verdicts[-1] is True and w.state == "rolling_back" and "slower beyond noise" in w.reason


def test_watch_keeps_a_bigger_batch_whose_steps_are_longer():
    # Batch 32 -> 64: steps take 1.6x longer, each sample 0.8x: per-sample times are what count.
    before = _steps(0.010 / 32, 10, 2)
    w = _watch(before)
    verdicts = [w.update(x) for x in _steps(0.016 / 64, 10, 3)]
    assert not any(verdicts) and w.state == "kept" and "samples/s" in w.reason


def test_watch_ignores_the_warm_steps_after_a_switch():
    w = _watch(_steps(1e-3, 10, 4))
    assert not w.update(5e-3) and not w.update(5e-3)  # two slow warm-up steps, not judged
    for x in _steps(1e-3, 8, 5):
        w.update(x)
    assert w.state == "kept"


def _run_trial(trial: InJobTrial, per_sample: dict[str, float]) -> list[dict]:
    commands = []
    for _ in range(200):
        cmd = trial.next_command()
        if cmd is not None:
            commands.append(cmd)
        if trial.finished:
            break
        phase = trial.phases[trial.phase]
        trial.update(
            per_sample[phase]
            * np.random.default_rng(len(commands) + trial.in_phase).normal(1, 0.01)
        )
    return commands


def test_in_job_trial_alternates_windows_and_keeps_the_higher_throughput():
    cand, cur = {"plugins": {"b": {"batch": 128}}}, {"plugins": {}}
    trial = InJobTrial(Request("trial", {}), cand, cur, window=6, warm=1, min_effect=0.02)
    # The candidate's steps are longer (bigger batch) but each sample is cheaper.
    commands = _run_trial(trial, {"candidate": 30e-6, "current": 47e-6})
    assert [c["config"] for c in commands] == [cand, cur, cand, cur, cand]  # X A X A, then keep X
    assert trial.result["kept"] == "candidate" and trial.result["speedup"] > 1.4
    assert len(trial.times["candidate"]) == len(trial.times["current"]) == 12  # warm steps excluded


def test_in_job_trial_keeps_the_current_config_without_a_clear_win():
    trial = InJobTrial(
        Request("trial", {}),
        {"plugins": {"x": {}}},
        {"plugins": {}},
        window=6,
        warm=1,
        min_effect=0.02,
    )
    commands = _run_trial(trial, {"candidate": 1e-3, "current": 1e-3})
    assert len(commands) == 4 and trial.result["kept"] == "current"
