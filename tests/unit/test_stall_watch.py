"""The launcher's stall watch: when silence from rank 0 means a hang."""

import pytest

from tunekit.trials.launcher import STALL_STEPS, LaunchOptions, StallWatch, TrialSpec


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def line(phase, index, total, step_s=0.1):
    return {"phase": phase, "index": index, "total": total, "step_s": step_s}


def test_silence_past_the_limit_after_a_step_is_a_hang():
    clock = Clock()
    watch = StallWatch(TrialSpec("example:cnn", warmup=2, steps=5), 30.0, clock)
    assert watch.stalled() is None  # start-up has no steps to show
    clock.now += 1000
    assert watch.stalled() is None
    watch.saw(line("warmup", 1, 2))
    clock.now += 30
    assert watch.stalled() is None
    clock.now += 1
    assert watch.stalled() == "no step finished for 31 s after warmup step 1/2; killed the trial's processes"


def test_the_limit_grows_with_the_slowest_step():
    clock = Clock()
    watch = StallWatch(TrialSpec("example:cnn", warmup=1, steps=5), 30.0, clock)
    watch.saw(line("warmup", 1, 1, step_s=8.0))
    watch.saw(line("measure", 1, 5, step_s=5.0))
    clock.now += STALL_STEPS * 8.0 - 1
    assert watch.stalled() is None
    clock.now += 2
    assert "after measure step 1/5" in watch.stalled()


@pytest.mark.parametrize(
    ("spec", "final"),
    [
        (TrialSpec("example:cnn", warmup=1, steps=4), ("measure", 4, 4)),
        (TrialSpec("example:cnn", warmup=1, steps=4, profile_steps=2), ("profile", 2, 2)),
    ],
)
def test_after_the_last_step_only_the_timeout_counts(spec, final):
    clock = Clock()
    watch = StallWatch(spec, 5.0, clock)
    watch.saw(line("measure", 3, 4))
    watch.saw(line(*final))  # what follows (trace export, teardown) has no step lines
    clock.now += 1000
    assert watch.stalled() is None


def test_an_in_job_search_disarms_it_until_timed_steps_start():
    clock = Clock()
    watch = StallWatch(TrialSpec("example:cnn", warmup=1, steps=4), 5.0, clock)
    watch.saw({"phase": "search", "index": 0, "total": 40})
    clock.now += 1000
    assert watch.stalled() is None
    watch.saw(line("warmup", 1, 1))
    clock.now += 6
    assert watch.stalled() is not None


def test_no_limit_never_stalls_and_a_bad_limit_is_refused():
    clock = Clock()
    watch = StallWatch(TrialSpec("example:cnn"), None, clock)
    watch.saw(line("warmup", 1, 3))
    clock.now += 10**6
    assert watch.stalled() is None
    with pytest.raises(ValueError, match="stall_s"):
        LaunchOptions(stall_s=0)
