"""The in-job search and the runtime hook on a real session of the tiny GPT (one rank): what
it tries, within its budget, what it drops over the cap, what it settles on; and the
contract, checked phase by phase."""

from __future__ import annotations

import pytest

from tunekit.errors import ConfigError
from tunekit.plugins.sharding.plugin import Sharding
from tunekit.plugins.sharding.search import (
    MEASURE_STEPS,
    WARMUP_STEPS,
    Variant,
    parse_variants,
    search_in_job,
)
from tunekit.plugins.sharding.tests.observations_sharding import observation
from tunekit.plugins.sharding.tests.workloads_sharding import gpt_tiny, gpt_tiny_dataset
from tunekit.runtime.session import Session
from tunekit.testing import check_conformance

PER_TRY = WARMUP_STEPS + MEASURE_STEPS


def session(**kwargs) -> Session:
    return Session(gpt_tiny(), rank=0, world_size=1, **kwargs)


def test_variants_read_and_write_back():
    text = "none:1,full/2:2,selective:4"
    variants = parse_variants(text)
    assert variants == [Variant("none", 1, 1), Variant("full", 2, 2), Variant("selective", 1, 4)]
    assert ",".join(v.text() for v in variants) == text
    with pytest.raises(ConfigError, match="POLICY"):
        parse_variants("zero3:1")
    with pytest.raises(ConfigError, match=">= 1"):
        parse_variants("full/0:1")


def test_the_search_times_every_variant_and_keeps_the_fastest_it_measured():
    s = session()
    variants = parse_variants("none:1,full:1,full/2:2")
    best, tried, reason = search_in_job(s, variants, max_steps=3 * PER_TRY)
    assert [t.variant for t in tried] == variants
    assert all(t.status == "ok" and t.step_s > 0 for t in tried)
    assert best == min(tried, key=lambda t: t.step_s).variant
    assert s.step == 3 * PER_TRY
    assert reason == "every variant measured"


def test_the_search_keeps_to_its_step_budget():
    s = session()
    best, tried, reason = search_in_job(s, parse_variants("none:1,full:2"), max_steps=PER_TRY + 1)
    assert [t.status for t in tried] == ["ok", "budget"]
    assert best == Variant("none", 1, 1)
    assert s.step == PER_TRY
    assert "budget" in reason


def test_a_variant_over_the_cap_is_dropped_and_the_job_goes_on():
    # The peaks of the two variants, measured; a cap between them.
    probe = session(track_memory=True)
    peaks = {}
    for v in parse_variants("none:1,full:2"):
        probe.reset()
        probe.memory.max = None
        probe.set_checkpointing(v.checkpointing, v.every)
        probe.set_micro_batches(v.micro_batches)
        for _ in range(2):
            probe.train_step()
        peaks[v.text()] = probe.memory.max
    assert peaks["full:2"] < peaks["none:1"]
    cap = int((peaks["full:2"] + peaks["none:1"]) / 2)
    s = session(memory_cap_bytes=cap)
    best, tried, _ = search_in_job(s, parse_variants("none:1,full:2"), max_steps=4 * PER_TRY)
    assert [t.status for t in tried] == ["over cap", "ok"]
    assert best == Variant("full", 1, 2)
    s.train_step()  # the job trains on


def test_the_hook_settles_on_knobs_that_validate_and_the_split_keeps_the_samples():
    tuner = Sharding()
    s = session()
    knobs = tuner.validate({"checkpointing": "full", "search": "full:1,none:2"})
    found = tuner.search(s, knobs, max_steps=2 * PER_TRY)
    assert found is not None
    chosen = tuner.validate(found.knobs)
    assert chosen["search"] == ""
    assert chosen["checkpointing"] in ("full", "none")
    assert len(found.trace) == 2 and found.summary
    tuner.apply(s, {"micro_batches": 2})
    assert (s.batch_size, s.accumulation, s.global_batch) == (2, 2, 4)
    s.reset()
    assert (s.batch_size, s.accumulation) == (4, 1)
    with pytest.raises(ConfigError, match="do not divide"):
        s.set_micro_batches(3)


def test_the_tuner_honours_the_contract():
    obs = observation("ddp", cap_mib=90)
    report = check_conformance(
        Sharding(),
        obs,
        # The runtime phase on the same model, smaller; its data a dataset, so the
        # equivalence phase's split into micro-batches trains on the whole step's samples.
        workload=gpt_tiny_dataset(),
        knob_sets=[
            {"checkpointing": "full", "micro_batches": 2, "search": "full:2,none:1"},
            {"checkpointing": "selective", "checkpoint_every": 2},
        ],
        nproc=1,
        steps=2,
        search_steps=PER_TRY + 1,
    )
    assert report.diagnosis.applies
    assert report.search is not None


def test_fsdps_own_compute_is_timed_on_one_rank_and_kept_in_the_study():
    from dataclasses import replace

    from tunekit.plugins.sharding.measure import fsdp_overhead, fsdp_overhead_key

    obs = observation("ddp")
    obs.workload = replace(gpt_tiny())  # the same kind of model, steps of milliseconds
    obs.cache.data.pop(fsdp_overhead_key(obs), None)
    found = fsdp_overhead(obs)
    assert set(found) == {"reshard", "keep"} and min(found.values()) >= 0
    assert obs.cache.get(fsdp_overhead_key(obs)) == found
