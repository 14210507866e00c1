"""tunekit.testing: the pieces a plugin author tests with, and the conformance check.

The conformance check runs against every built-in tuner here, and against
deliberately broken tuners, each of which must be caught with a message that
names the plugin and the problem.
"""

import math
import threading

import pytest
import torch
from harness_tuners import (
    DetachesBesideAHarmlessKnob,
    DetachesBlockInputs,
    Harmless,
    NeverPlansItsKnob,
    SaysItChangesTheMath,
)

from tunekit import API_VERSION
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, Tuner
from tunekit.observe.breakdown import PARTS
from tunekit.plugin_loading import load_named
from tunekit.runtime.data import LoaderOptions
from tunekit.runtime.session import Session
from tunekit.runtime.sync import DDPSync
from tunekit.testing import (
    ConformanceError,
    MemoryCache,
    check_conformance,
    check_declaration,
    check_equivalence,
    check_runtime,
    compare_states,
    snapshot_session,
    synthetic_breakdown,
    synthetic_observation,
    synthetic_telemetry,
    tiny_dataset_workload,
    tiny_gpt_workload,
    tiny_hardware,
    tiny_workload,
)
from tunekit.testing.equivalence import equivalence_cases
from tunekit.workload import load_workload

# -- the pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [tiny_workload, tiny_dataset_workload])
def test_tiny_workloads_really_train(make):
    session = Session(make())
    try:
        losses = [session.train_step().loss for _ in range(40)]
    finally:
        session.close()
    assert sum(losses[-5:]) < sum(losses[:5])


def test_tiny_workloads_load_by_name_in_any_process():
    assert load_workload("tunekit.testing:tiny_workload").name == "tiny"
    data = load_workload("tunekit.testing:tiny_dataset_workload").dataset()
    assert torch.equal(data[3][0], data[3][0]) and len(data) == 256


def test_tiny_hardware_is_the_same_everywhere_and_uses_its_fit():
    hw = tiny_hardware(4)
    assert hw.fingerprint() == tiny_hardware(4).fingerprint()
    assert [d.name for d in hw.devices] == ["rank0", "rank1", "rank2", "rank3"]
    assert hw.allreduce_time(1e6, 4) == pytest.approx(50e-6 + 1e6 / 1e9)
    gpu = tiny_hardware(2, "cuda", cores=16)
    assert gpu.devices[0].kind == "gpu" and gpu.host.cores == 16
    assert gpu.fit("all_reduce", 2).backend == "nccl"


def test_synthetic_breakdown_parts_are_the_fractions_asked_for():
    fractions = {"compute": 0.5, "comm_exposed": 0.2, "data": 0.25, "optimizer": 0.05}
    summary = synthetic_breakdown(0.2, fractions, nproc=2).summary()
    for part in PARTS:
        assert summary["fractions"][part] == pytest.approx(fractions.get(part, 0.0))
    assert summary["total_s"] == pytest.approx(0.2)
    assert summary["comm_total_s"] == pytest.approx(0.08)
    # Lee et al. Eq. 11 over the synthetic collective: (T_c - T_b) / T_c = (0.08 - 0.04) / 0.08
    assert summary["overlap_R"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="sum to 1"):
        synthetic_breakdown(0.1, {"compute": 0.5})
    with pytest.raises(ValueError, match="unknown breakdown parts"):
        synthetic_breakdown(0.1, {"compute": 0.5, "loading": 0.5})


def test_synthetic_telemetry_goes_through_the_real_summarisers():
    tel = synthetic_telemetry({"data_loading": 0.4, "native": 0.5, "idle": 0.1}, nproc=2)
    spy = tel["pyspy"]
    assert spy["categories"] == pytest.approx({"data_loading": 0.4, "native": 0.5, "idle": 0.1})
    assert spy["flags"] == ["data loading: 40% of stack samples"]
    assert set(spy["per_rank"]) == {"0", "1"}
    assert tel["host"]["ranks"]["1"]["cpu_pct_mean"] == pytest.approx(95.0)
    assert "pyspy" not in synthetic_telemetry(None)


def test_synthetic_observation_is_real_where_it_can_be():
    workload = tiny_workload()
    obs = synthetic_observation(workload, nproc=1, step_s=0.04, pyspy={"native": 1.0})
    assert obs.baseline.median_s == pytest.approx(0.04)
    assert obs.baseline.samples_per_s == pytest.approx(8 / 0.04)
    assert obs.model.num_params == sum(p.numel() for p in workload.model().parameters())
    assert obs.graph is not None and obs.graph.method == "fx"
    assert obs.breakdown.summary()["fractions"]["comm_exposed"] == 0.0  # one rank
    assert obs.telemetry["pyspy"]["categories"] == {"native": 1.0}
    named = synthetic_observation("example:cnn", nproc=2, breakdown=False, graph=False)
    assert named.workload_spec == "example:cnn" and named.breakdown is None and named.graph is None


def test_memory_cache_keeps_only_json_as_the_store_does():
    cache = MemoryCache()
    cache.put("k", {"a": [1, 2.5]})
    assert cache.get("k") == {"a": [1, 2.5]} and cache.get("missing") is None
    with pytest.raises(TypeError):
        cache.put("bad", {"t": torch.zeros(1)})


def test_session_snapshots_see_what_a_hook_changes():
    session = Session(tiny_dataset_workload())
    try:
        fresh = snapshot_session(session)
        assert compare_states(fresh, snapshot_session(session)) == []
        session.data.set_options(LoaderOptions(num_workers=2))
        handle = session.model[0].register_forward_hook(lambda *a: None)
        session.set_lr(0.5)
        diffs = compare_states(fresh, snapshot_session(session))
        assert any(
            d.startswith("data.options changed") and "num_workers: 0 -> 2" in d for d in diffs
        )
        assert any(d.startswith("module hooks changed") for d in diffs)
        assert any(d.startswith("session.lr changed: 0.05 -> 0.5") for d in diffs)
        handle.remove()
    finally:
        session.close()


# -- conformance of the built-in tuners --------------------------------------------------------

ONE_RANK = (1,)
"""The float64 equivalence on one rank, in this process (two ranks: the slow tests below)."""
OVERLAP_KNOBS = [
    {
        "mode": "ddp_buckets",
        "bucket_cap_mb": 1,
        "first_bucket_mb": 0.5,
        "gradient_as_bucket_view": True,
    },
    {"mode": "two_chunk", "k": 2, "f": 1},
]
CGDP_KNOBS = [{"chunk_size": 2}, {"chunk_size": 1, "offload_optimizer": True}]


def builtin(name: str) -> Tuner:
    (record,) = load_named([name])
    assert record.ok, record.error
    return record.tuner


def test_overlap_chunking_conforms_in_both_modes():
    tuner = builtin("overlap_chunking")
    # Planned for two ranks; its hooks (DDP buckets, two-chunk reducer) run on a one-rank group.
    report = check_conformance(
        tuner,
        synthetic_observation(nproc=2),
        equivalence_ranks=ONE_RANK,
        knob_sets=OVERLAP_KNOBS,
    )
    assert report.diagnosis.applies and report.candidates
    assert all(math.isfinite(x) for run in report.losses for x in run)


def test_batch_ps_sizing_conforms_with_its_search():
    report = check_conformance(
        builtin("batch_ps_sizing"),
        synthetic_observation(nproc=2),
        search_steps=6,
        equivalence_ranks=ONE_RANK,
    )
    assert report.diagnosis.applies
    assert {k["batch_size"] for k in report.knob_sets} <= {16, 32, 64}
    assert report.search is not None and report.search.trace


def test_cgdp_conforms_on_one_rank():
    # The tiny MLP has too few gradients for CGDP to predict a gain; its hook still must behave.
    report = check_conformance(
        builtin("cgdp"),
        synthetic_observation(nproc=2),
        knob_sets=CGDP_KNOBS,
        equivalence_ranks=ONE_RANK,
    )
    assert not report.diagnosis.applies


def test_layer_split_conforms_with_its_planned_splits():
    report = check_conformance(
        builtin("layer_split"), synthetic_observation(nproc=2), equivalence_ranks=ONE_RANK
    )
    assert report.diagnosis.applies
    assert len(report.knob_sets) == 2


def test_hybrid_mp_conforms_on_one_rank_without_model_parallelism():
    # mp_degree > 1 needs as many ranks: see the two-rank test below.
    report = check_conformance(
        builtin("hybrid_mp"), synthetic_observation(nproc=2), equivalence_ranks=ONE_RANK
    )
    assert not report.diagnosis.applies and "chain" in report.diagnosis.summary


@pytest.mark.slow
def test_hybrid_mp_model_parallel_hook_conforms_on_two_ranks():
    problems, _, _ = check_runtime(
        builtin("hybrid_mp"),
        [{"mp_degree": 2, "placer": "pipeline"}, {"mp_degree": 1}],
        "tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp:branchy",
        nproc=2,
    )
    assert problems == []


# -- broken tuners are caught, by name -------------------------------------------------------


class Base(Tuner):
    name, title, aspect = "base", "Base (tests)", Aspect.DATA

    def knobs(self):
        return [Knob("level", "int", 0, "how much", low=0, high=3)]

    def diagnose(self, obs):
        return Diagnosis(True, "always", expected_gain=0.1)

    def plan(self, obs, limit):
        return [Candidate({"level": lv}, 0.05, f"level {lv}") for lv in (1, 2)][:limit]

    def apply(self, session, knobs):
        pass


class LeavesAHook(Base):
    name = "leaves_a_hook"

    def apply(self, session, knobs):
        session.model.register_forward_pre_hook(lambda module, args: None)


class FlipsAFlag(Base):
    name = "flips_a_flag"

    def apply(self, session, knobs):
        torch.backends.cudnn.benchmark = True  # and forgets session.on_reset


class LeavesLoaderOptions(Base):
    name = "leaves_loader_options"

    def apply(self, session, knobs):
        session.data.set_options(LoaderOptions(num_workers=knobs["level"]))


class ChangesWeights(Base):
    name = "changes_weights"

    def apply(self, session, knobs):
        with torch.no_grad():
            for p in session.model.parameters():
                p.mul_(1.0 + knobs["level"])


class SwapsTheModel(Base):
    name = "swaps_the_model"

    def apply(self, session, knobs):
        import copy

        session.model = copy.deepcopy(session.model)


class LeavesAThread(Base):
    name = "leaves_a_thread"
    stop = threading.Event()

    def apply(self, session, knobs):
        threading.Thread(target=self.stop.wait, name="forgotten-worker", daemon=True).start()


class CarriesStateBetweenTrials(Base):
    """Keeps the first strategy it built and installs it again for any knobs."""

    name = "carries_state"
    aspect = Aspect.GRAD_SYNC

    def __init__(self):
        self.sync_settings = None

    def apply(self, session, knobs):
        if self.sync_settings is None:
            self.sync_settings = 1.0 + knobs["level"]
        session.set_grad_sync(DDPSync(bucket_cap_mb=self.sync_settings))


class NoPrediction(Base):
    name = "no_prediction"

    def plan(self, obs, limit):
        return [Candidate({"level": 1}, None, "trust me")]


class OutOfRangeCandidate(Base):
    name = "out_of_range"

    def plan(self, obs, limit):
        return [Candidate({"level": 9}, 0.05)]


class UndeclaredRange(Base):
    name = "undeclared_range"

    def knobs(self):
        return [
            Knob("level", "int", 0, "how much", low=0),
            Knob("mode", "choice", "a", choices=("a", "b")),
        ]


class WrongSignature(Base):
    name = "wrong_signature"

    def plan(self, obs):  # no limit
        return []


class OldApi(Base):
    name = "old_api"
    api_version = API_VERSION[0] - 1


class GainAsPercent(Base):
    name = "gain_as_percent"

    def diagnose(self, obs):
        return Diagnosis(True, "25 percent", expected_gain=25.0, details={"obs": obs})


BROKEN = [
    (LeavesAHook, r"after knobs \{'level': 1\} and session.reset\(\): module hooks changed"),
    (FlipsAFlag, r"torch flags changed \(cudnn.benchmark: False -> True\)"),
    (LeavesLoaderOptions, r"data.options changed \(num_workers: 0 -> 1\)"),
    (ChangesWeights, r"apply with knobs \{'level': 1\} changed parameter values"),
    (SwapsTheModel, r"session.model is a different object than before"),
    (LeavesAThread, r"left 1 thread\(s\) running: forgotten-worker"),
    (
        CarriesStateBetweenTrials,
        r"\{'level': 2\} applied after \{'level': 1\} differs from it applied to a "
        r"fresh session: session.grad_sync changed",
    ),
    (NoPrediction, r"candidate 0 carries no prediction"),
    (
        OutOfRangeCandidate,
        r"candidate 0 knobs \{'level': 9\} do not validate: out_of_range.level: 9 is out of range",
    ),
    (
        UndeclaredRange,
        r"knob 'level': int knobs must declare both low and high(.|\n)*knob 'mode': no help line",
    ),
    (
        WrongSignature,
        r"plan\('self', 'obs'\) does not match the contract's plan\('self', 'obs', 'limit'\)",
    ),
    (OldApi, rf"api_version {API_VERSION[0] - 1}: this tunekit speaks {API_VERSION[0]}"),
    (
        GainAsPercent,
        r"expected_gain 25.0 is not a fraction(.|\n)*Diagnosis.details is not JSON-able",
    ),
]


@pytest.mark.parametrize(("cls", "message"), BROKEN, ids=[c.name for c, _ in BROKEN])
def test_a_broken_tuner_is_caught_and_named(cls, message):
    flag = torch.backends.cudnn.benchmark
    LeavesAThread.stop = threading.Event()
    try:
        with pytest.raises(ConformanceError, match=message) as err:
            check_conformance(cls(), synthetic_observation(nproc=1))
    finally:
        torch.backends.cudnn.benchmark = flag
        LeavesAThread.stop.set()
    assert str(err.value).startswith(f"plugin {cls.name!r} breaks the tuner contract:")
    assert isinstance(err.value, AssertionError)  # pytest shows it as a failed assertion


def test_a_tuner_that_undoes_its_changes_passes():
    class Clean(Base):
        name = "clean"

        def apply(self, session, knobs):
            previous = session.data.options
            session.data.set_options(
                LoaderOptions(num_workers=0, prefetch_factor=None, pin_memory=bool(knobs["level"]))
            )
            session.on_reset(lambda: session.data.set_options(previous))
            handle = session.model.register_forward_pre_hook(lambda module, args: None)
            session.on_reset(handle.remove)
            flag = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = True
            session.on_reset(lambda: setattr(torch.backends.cudnn, "benchmark", flag))

    report = check_conformance(  # a class inside a function: spawned ranks cannot build it
        Clean(),
        synthetic_observation(nproc=1),
        workload=tiny_dataset_workload(),
        equivalence_ranks=ONE_RANK,
    )
    assert report.knob_sets == [{"level": 1}, {"level": 2}]
    assert len(report.losses) == 2 and all(len(run) == 2 for run in report.losses)
    assert check_declaration(Clean()) == []


# -- workloads with a schedule, and hooks that change the math (issue 33) ----------------------


def test_a_reset_restores_the_learning_rate_where_the_schedule_has_moved_it():
    session = Session(tiny_gpt_workload())  # warm-up + cosine: the rate moves every step
    try:
        fresh = snapshot_session(session)
        for _ in range(3):
            session.train_step()
        session.set_lr(2 * session.workload.lr)  # as a hook may: the schedule's base doubles
        changed = compare_states(fresh, snapshot_session(session))
        assert any(d.startswith("optimizer.lr per group, as a multiple") for d in changed)
        session.reset()
        assert compare_states(fresh, snapshot_session(session)) == []
    finally:
        session.close()


def test_a_correct_plugin_passes_on_a_workload_with_a_scheduler():
    report = check_conformance(
        Harmless(), synthetic_observation(tiny_gpt_workload(), nproc=1), equivalence_ranks=ONE_RANK
    )
    assert report.knob_sets == [{"x": 0}, {"x": 1}]
    assert [(c.knobs, c.ranks, c.outcome) for c in report.equivalence] == [({"x": 1}, 1, "same")]


def test_a_hook_that_changes_the_math_is_caught_naming_the_knob_and_the_first_parameter():
    # Caught on one rank, so the two-rank run is never started.
    with pytest.raises(ConformanceError) as err:
        check_conformance(
            DetachesBlockInputs(), synthetic_observation(tiny_gpt_workload(), nproc=1)
        )
    message = str(err.value)
    assert (
        "knob 'checkpoint_blocks' (not marked changes_math) changes the training: "
        "{'checkpoint_blocks': True} trained 3 steps on 1 rank in float64" in message
    )
    # The first parameter in the model's order: the token embedding loses the blocks' gradient.
    assert "parameter 'tokens.weight' differs by" in message
    assert "the loss differs from step 1 on" in message


def test_the_knob_that_changes_the_math_is_named_among_harmless_ones():
    with pytest.raises(ConformanceError) as err:
        check_conformance(
            DetachesBesideAHarmlessKnob(), synthetic_observation(tiny_gpt_workload(), nproc=1)
        )
    assert "knob 'checkpoint_blocks' (not marked changes_math)" in str(err.value)
    assert "'verbose' (not marked" not in str(err.value)


def test_a_bool_knob_the_plan_never_moves_is_tried_by_the_harness():
    with pytest.raises(ConformanceError, match="knob 'checkpoint_blocks' .* changes the training"):
        check_conformance(
            NeverPlansItsKnob(),
            synthetic_observation(tiny_gpt_workload(), nproc=1),
            expect_candidates=False,
        )


def test_a_knob_marked_changes_math_is_not_held_to_the_untuned_job():
    report = check_conformance(
        SaysItChangesTheMath(), synthetic_observation(tiny_gpt_workload(), nproc=1)
    )
    assert report.equivalence == [] and report.unchecked_knobs == []


def test_the_equivalence_cases_are_the_knob_sets_without_their_math_and_each_untried_value():
    class Mixed(Base):
        name = "mixed"

        def knobs(self):
            return [
                Knob("batch", "int", 0, "samples", low=0, high=64, changes_math=True),
                Knob("level", "int", 0, "how much", low=0, high=3),
                Knob("pin", "bool", False, "pinned"),
                Knob("mode", "choice", "a", "how", choices=("a", "b", "c")),
                Knob("plan", "str", "", "a layout"),
            ]

    cases, unchecked = equivalence_cases(Mixed(), [{"batch": 32}, {"batch": 32, "level": 2}])
    base = {"batch": 0, "level": 0, "pin": False, "mode": "a", "plan": ""}
    assert cases == [
        ({**base, "level": 2}, False),  # the first set is the defaults once its batch is put back
        ({**base, "pin": True}, True),
        ({**base, "mode": "b"}, True),
        ({**base, "mode": "c"}, True),
    ]
    assert unchecked == ["plan"]


@pytest.mark.slow
def test_a_correct_plugin_passes_on_two_ranks_in_one_rank_group():
    # Runtime and equivalence share the two ranks; one rank runs here.
    report = check_conformance(
        Harmless(),
        synthetic_observation("tunekit.testing:tiny_gpt_workload", nproc=2),
        nproc=2,
    )
    assert sorted((c.ranks, c.outcome) for c in report.equivalence) == [(1, "same"), (2, "same")]


def _two_rank_knob_sets(name: str) -> list[dict]:
    if name == "overlap_chunking":
        return OVERLAP_KNOBS
    if name == "cgdp":
        return CGDP_KNOBS
    if name == "batch_ps_sizing":
        return [{"batch_size": 32, "cudnn_benchmark": True}]
    if name == "hybrid_mp":
        return [{"mp_degree": 2, "placer": "pipeline"}]
    return [c.knobs for c in builtin(name).plan(synthetic_observation(nproc=2), 2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["batch_ps_sizing", "cgdp", "hybrid_mp", "layer_split", "overlap_chunking"]
)
def test_built_in_knobs_keep_the_math_on_two_ranks(name):
    problems, checks, _ = check_equivalence(
        builtin(name), _two_rank_knob_sets(name), "tunekit.testing:tiny_workload", ranks=(2,)
    )
    assert problems == []
    assert checks and all(c.ranks == 2 and c.outcome in ("same", "refused") for c in checks)


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    ("name", "knob_sets"),
    [
        ("batch_ps_sizing", [{"batch_size": 32, "cudnn_benchmark": True}, {"batch_size": 16}]),
        (
            "overlap_chunking",
            [{"bucket_cap_mb": 1, "first_bucket_mb": 0.5}, {"mode": "two_chunk", "k": 2, "f": 1}],
        ),
        ("cgdp", [{"chunk_size": 2}, {"chunk_size": 1, "offload_optimizer": True}]),
    ],
)
def test_built_in_hooks_conform_on_a_gpu(name, knob_sets):
    problems, losses, _ = check_runtime(builtin(name), knob_sets, tiny_workload(), device="cuda")
    assert problems == []
    assert all(math.isfinite(x) for run in losses for x in run)
