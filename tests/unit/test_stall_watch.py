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
    assert (
        watch.stalled()
        == "no step finished for 31 s after warmup step 1/2; killed the trial's processes"
    )


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


def test_at_the_timeout_steps_still_finishing_make_a_trial_too_slow_not_hung():
    clock = Clock()
    watch = StallWatch(TrialSpec("example:cnn", warmup=3, steps=16), 60.0, clock, started=clock.now)
    clock.now += 9.0 + 14.0  # start-up, then the first step
    watch.saw(line("warmup", 1, 3, step_s=14.0))
    assert watch.startup_s == pytest.approx(9.0)
    for i in range(2, 4):
        clock.now += 14.0
        watch.saw(line("warmup", i, 3, step_s=14.0))
    clock.now += 14.4
    watch.saw(line("measure", 1, 16, step_s=14.4))
    clock.now += 5.0  # mid-step when the timeout comes
    assert watch.timed_out(300) == (
        "too_slow",
        "too slow: 14.0 s per step, 4 of 19 steps done when the 300 s timeout came; killed the trial's processes",
    )


def test_at_the_timeout_a_trial_whose_steps_stopped_or_never_started_is_a_hang():
    clock = Clock()
    never = StallWatch(TrialSpec("example:cnn", warmup=1, steps=4), None, clock)
    clock.now += 300
    assert never.timed_out(300) == ("hang", "no result within 300 s; killed the trial's processes")
    assert never.startup_s is None
    stopped = StallWatch(TrialSpec("example:cnn", warmup=1, steps=4), None, clock)  # --stall off
    stopped.saw(line("warmup", 1, 1, step_s=0.1))
    clock.now += STALL_STEPS * 0.1 + 2  # silent for far longer than its pace
    assert stopped.timed_out(300)[0] == "hang"


def test_start_up_is_the_time_to_the_first_step():
    clock = Clock()
    watch = StallWatch(TrialSpec("example:cnn", warmup=1, steps=4), 60.0, clock, started=clock.now)
    clock.now += 8.5
    watch.saw(line("warmup", 1, 1, step_s=0.5))
    clock.now += 0.5
    watch.saw(line("measure", 1, 4, step_s=0.5))
    assert watch.startup_s == pytest.approx(8.0)
