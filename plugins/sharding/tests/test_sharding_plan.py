"""Diagnosis and plan on observations of the small GPT with injected timings: predictions
reproduce the measured baseline, nothing predicted over the bound is proposed, knobs
round-trip through the layout hook, and the aspects combine as they should."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tunekit.api import Layout
from tunekit.config import TuningConfig, config_layout, resolve
from tunekit.diagnosis_text import HEADLINE_MAX
from tunekit.errors import ConfigError
from tunekit.plugin_loading import load_named, select
from tunekit.plugins.sharding.analysis import analyse
from tunekit.plugins.sharding.plugin import Sharding
from tunekit.plugins.sharding.search import margin, parse_variants
from tunekit.plugins.sharding.tests.observations_sharding import MiB, observation

# The other tuners as tunekit loads them (plugins never import each other).
OTHERS = select(load_named(["batch_ps_sizing", "overlap_chunking"]), None)
TUNERS = {"sharding": Sharding(), "overlap_chunking": OTHERS["overlap_chunking"]}


def layout_of(knobs, workload) -> Layout:
    plan = resolve(TuningConfig({"sharding": knobs}), TUNERS)
    return config_layout(plan, workload.layout())


def test_the_model_reproduces_the_measured_baseline_step_and_peak():
    obs = observation("sharded", step_s=0.3)
    a = analyse(obs)
    assert a.base.step_s == pytest.approx(0.3)
    assert a.base.peak_bytes == pytest.approx(obs.baseline_peak_bytes)
    assert sum(a.base.parts.values()) == pytest.approx(0.3)


@pytest.mark.parametrize("cap_mib", [40, 48, 60])
def test_nothing_predicted_over_the_bound_is_proposed(cap_mib):
    obs = observation("sharded", cap_mib=cap_mib)
    tuner = Sharding()
    tuner.diagnose(obs)
    candidates = tuner.plan(obs, 8)
    a = tuner.analysis(obs)
    base = a.model.base
    limit = {
        p.setting.describe(): cap_mib * MiB * (1 - margin(p.setting, base)) for p in a.predictions
    }
    for c in candidates:
        assert c.predicted_peak_bytes is not None
        assert c.predicted_peak_bytes <= limit[c.details["prediction"]["setting"]]
        assert c.predicted_step_s < a.base.step_s
    for c in candidates:  # every variant an in-job search would time fits too
        for v in c.details.get("variants", []):
            assert v["memory"]["peak_bytes"] <= limit[v["setting"]]
    over = [p for p in a.predictions if p.peak_bytes > limit[p.setting.describe()]]
    assert over  # the bound bites: some settings are left out
    proposed = {c.details["prediction"]["setting"] for c in candidates}
    assert not proposed & {p.setting.describe() for p in over}


def test_a_larger_bound_lets_faster_settings_in_and_the_fastest_leads():
    tight = Sharding().analysis(observation("sharded", cap_mib=48))
    loose = Sharding().analysis(observation("sharded", cap_mib=200))
    assert loose.best is not None and tight.best is not None
    assert loose.best.step_s <= tight.best.step_s
    base = loose.model.base
    fitting = [
        p for p in loose.predictions if p.peak_bytes <= 200 * MiB * (1 - margin(p.setting, base))
    ]
    assert loose.best.step_s == pytest.approx(min(p.step_s for p in fitting))


def test_candidates_knobs_round_trip_through_the_layout_hook():
    obs = observation("sharded", cap_mib=200)
    tuner = Sharding()
    tuner.diagnose(obs)
    candidates = tuner.plan(obs, 8)
    assert candidates
    for c in candidates:
        knobs = tuner.validate(c.knobs)
        expected = Layout.from_dict(c.details["prediction"]["layout"])
        assert layout_of(knobs, obs.workload) == expected
        assert (knobs["micro_batches"] or 1) == c.details["prediction"]["micro_batches"]


def test_the_first_candidate_is_an_in_job_search_over_its_build_layouts_variants():
    obs = observation("sharded", cap_mib=200)
    tuner = Sharding()
    tuner.diagnose(obs)
    first = tuner.plan(obs, 8)[0]
    assert first.search
    variants = parse_variants(first.knobs["search"])
    assert 1 <= len(variants) <= 4
    build = Layout.from_dict(first.details["prediction"]["layout"]).build_part()
    for v in first.details["variants"]:
        assert Layout.from_dict(v["layout"]).build_part() == build
    steps = [v["step_s"] for v in first.details["variants"]]
    assert steps == sorted(steps)


def test_the_diagnosis_says_what_fills_memory_and_what_each_lever_costs():
    obs = observation("sharded", cap_mib=48)
    d = Sharding().diagnose(obs)
    assert len(d.headline) <= HEADLINE_MAX
    assert "of the --memory-cap (48 MiB)" in d.summary
    assert "activations" in d.summary
    assert "no checkpointing needs" in d.summary  # the baseline checkpoints every block
    assert "micro-batches per step frees" in d.summary
    levers = {lever["lever"] for lever in d.details["levers"]}
    assert {"no checkpointing", "replicating with DDP"} <= levers


def test_a_replicated_job_near_its_bound_is_offered_sharding_and_checkpointing_levers():
    obs = observation("ddp", cap_mib=90)
    d = Sharding().diagnose(obs)
    assert "sharding with FSDP frees" in d.summary
    assert "checkpointing every block frees" in d.summary


def test_a_job_that_nothing_beats_is_not_tuned():
    # A slow link makes every FSDP setting and every extra pass slower; the cap keeps the
    # faster replicated settings out: nothing fits that beats the job.
    obs = observation("sharded", cap_mib=36, bandwidth=1e7)
    tuner = Sharding()
    d = tuner.diagnose(obs)
    assert not d.applies
    assert d.headline.startswith("does not apply")
    assert tuner.plan(obs, 8) == []


def test_without_memory_facts_nothing_is_proposed():
    obs = observation("sharded", cap_mib=48)
    obs.memory = None
    tuner = Sharding()
    assert not tuner.diagnose(obs).applies
    assert tuner.plan(obs, 8) == []


def test_fsdp_takes_over_gradient_synchronisation_ddp_still_combines():
    with pytest.raises(ConfigError, match="FSDP, which reduces its own gradients"):
        resolve(TuningConfig({"sharding": {"sharding": "fsdp"}, "overlap_chunking": {}}), TUNERS)
    plan = resolve(
        TuningConfig({"sharding": {"checkpointing": "full"}, "overlap_chunking": {}}), TUNERS
    )
    assert [t.name for t, _ in plan] == ["sharding", "overlap_chunking"]


def test_batch_then_layout_the_split_applies_to_the_batch_tuners_batch():
    tuners = {"sharding": Sharding(), "batch_ps_sizing": OTHERS["batch_ps_sizing"]}
    plan = resolve(
        TuningConfig({"sharding": {"micro_batches": 2}, "batch_ps_sizing": {"batch_size": 8}}),
        tuners,
    )
    assert [t.name for t, _ in plan] == ["batch_ps_sizing", "sharding"]


def test_bad_knobs_are_one_line_errors():
    tuner = Sharding()
    with pytest.raises(ConfigError, match="search variant 'full:x'"):
        tuner.validate({"search": "full:x"})
    with pytest.raises(ConfigError, match="not one of"):
        tuner.validate({"sharding": "zero3"})
    obs = observation("ddp")
    with pytest.raises(ConfigError, match="cpu_offload"):
        layout_of(tuner.validate({"cpu_offload": True}), obs.workload)  # offload needs FSDP


def test_the_recorded_memory_facts_are_of_this_model():
    from tunekit.plugins.sharding.tests.observations_sharding import recorded_memory_facts
    from tunekit.plugins.sharding.tests.workloads_sharding import gpt_ddp

    facts = recorded_memory_facts()
    model = gpt_ddp().model()
    assert facts.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert [b.name for b in facts.blocks] == [f"blocks.{i}" for i in range(4)]


def test_memory_freed_lets_the_batch_tuners_larger_batch_fit_planned_as_one():
    from tunekit.planning import candidate_config

    obs = observation("sharded", cap_mib=120, batch_range=(1, 64))
    tuner = Sharding()
    tuner.diagnose(obs)
    candidates = tuner.plan(obs, 8)
    together = [c for c in candidates if c.combined_with]
    assert together, [c.rationale for c in candidates]
    c = together[0]
    batch = c.combined_with["batch_ps_sizing"]["batch_size"]
    assert batch in (32, 64)
    assert c.global_batch == batch * obs.nproc
    assert c.predicted_peak_bytes <= 120 * MiB
    tuners = {"sharding": tuner, "batch_ps_sizing": OTHERS["batch_ps_sizing"]}
    config = candidate_config(tuner, c, tuners)
    assert config.plugins["batch_ps_sizing"]["batch_size"] == batch
    # Per sample it beats the plan's best at the job's own batch.
    first = candidates[0]
    assert c.predicted_step_s / batch < first.predicted_step_s / obs.workload.batch_size
    # Without a batch range the job's batch may not change: nothing is combined.
    plain = Sharding()
    obs = observation("sharded", cap_mib=120)
    plain.diagnose(obs)
    assert not any(c.combined_with for c in plain.plan(obs, 8))


def test_a_combined_candidate_is_dropped_where_its_partner_is_not_in_use():
    import asyncio

    from tunekit.planning import InProcessHooks, TunerPlanned, diagnose_and_plan

    obs = observation("sharded", cap_mib=120, batch_range=(1, 64))
    tuners = {"sharding": Sharding()}

    async def steps():
        return [s async for s in diagnose_and_plan(tuners, InProcessHooks(tuners, obs), 8)]

    planned = [s for s in asyncio.run(steps()) if isinstance(s, TunerPlanned)][0]
    assert planned.candidates and not any(c.combined_with for c in planned.candidates)
    assert all(list(cfg.plugins) == ["sharding"] for cfg in planned.configs)


@pytest.mark.parametrize("kind", ["sharded", "ddp"])
def test_with_memory_to_spare_a_larger_batch_comes_only_with_a_layout_of_its_own(kind):
    """The demo CNN, 33 MiB of 12 GiB: the job's own layout at a larger batch is the batch
    tuner's candidate, not this tuner's (it won the demo as "batch_ps_sizing(...) +
    sharding()", every sharding knob at the job's own); the gain is counted in samples/s."""
    obs = observation(kind, batch_range=(1, 256))
    tuner = Sharding()
    d = tuner.diagnose(obs)
    base = (obs.workload.layout(), 1)
    for c in tuner.plan(obs, 8):
        if c.combined_with:
            own = layout_of(c.knobs, obs.workload)
            assert (own, int(c.knobs.get("micro_batches") or 1)) != base, c.rationale
    if d.applies:
        a = tuner.analysis(obs)
        best = a.best
        rate = best.setting.samples / best.step_s
        assert d.expected_gain == pytest.approx(rate / (a.base.setting.samples / a.base.step_s) - 1)
        assert "more samples/s" in d.summary


def test_a_checkpointed_baselines_extra_compute_is_its_recomputation():
    """Scaling all compute alike left the passes holding recompute's excess: removing full
    checkpointing was predicted 20-30% slower than it measured (benchmarks/prediction_error)."""
    from tunekit.plugins.sharding.calibrated import base_setting, calibrate_job

    fractions = {"compute": 0.9, "comm_exposed": 0.05, "optimizer": 0.05}
    cm = calibrate_job(observation("sharded", fractions=fractions))
    assert 1.0 < cm.model.recompute_factor < 3.0
    assert cm.calibration.scales["compute"] == pytest.approx(1.0)  # the passes as timed
    base = base_setting(cm.obs)
    assert cm.obs.workload.layout().checkpointed
    plain = replace(base, layout=base.layout.with_changes({"checkpointing": "none"}))
    saved = cm.parts_of(base)["compute"] - cm.parts_of(plain)["compute"]
    recompute = base.samples * sum(cm.model.recompute_per_sample(base.layout).values())
    assert saved == pytest.approx(recompute)
    # A baseline without checkpointing has nothing to fit.
    assert calibrate_job(observation("ddp", fractions=fractions)).model.recompute_factor == 1.0


def test_a_layout_is_combined_with_a_larger_batch_only_where_it_needs_one():
    """Selective checkpointing at no cost beside a batch that fits anyway won a demo's budget
    as "batch_ps_sizing(batch_size=128) + sharding(checkpointing=selective)"."""
    from tunekit.plugins.sharding.model import Setting
    from tunekit.plugins.sharding.search import MIN_GAIN, combined

    obs = observation("ddp", batch_range=(1, 256))
    a = Sharding().analysis(obs)
    base = a.base
    own, other = base.setting.layout, base.setting.layout.with_changes({"sharding": "fsdp"})

    def at(layout, step_s, peak):
        p = a.model.predict(Setting(layout, 1, 4 * base.setting.samples))
        return replace(p, step_s=step_s, memory=replace(p.memory, peak_bytes=peak))

    step = base.step_s * 3  # 4x the batch in 3x the time: per sample, a gain over the job
    bound = 10 * base.peak_bytes
    no_gain = {4: [at(own, step, base.peak_bytes), at(other, step * (1 - MIN_GAIN / 2), 1.0)]}
    assert combined(no_gain, None, base, bound) == []
    gains = {4: [at(own, step, base.peak_bytes), at(other, step * (1 - 2 * MIN_GAIN), 1.0)]}
    assert [p.prediction.setting.layout for p in combined(gains, None, base, bound)] == [other]
    # Where the job's own layout does not fit at that batch, the layout is what lets it in.
    over = {4: [at(own, step, 2 * bound), at(other, step * 1.01, 1.0)]}
    assert [p.prediction.setting.layout for p in combined(over, None, base, bound)] == [other]
