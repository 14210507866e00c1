"""The tuner: knobs, diagnosis, plan and the worker-side apply, in one process."""

from __future__ import annotations

import json

import pytest

from tunekit.contract import Aspect
from tunekit.errors import ConfigError
from tunekit.hardware import load_profile
from tunekit.observe.observation import Measurement, Observation, summarize_model
from tunekit.plugins.hybrid_mp.inputs import model_graph
from tunekit.plugins.hybrid_mp.options import HybridOptions
from tunekit.plugins.hybrid_mp.placement_codec import (
    decode_placement,
    encode_placement,
    nodes_of,
    placement_nodes,
)
from tunekit.plugins.hybrid_mp.placers import worker_plan
from tunekit.plugins.hybrid_mp.plugin import HybridMp
from tunekit.plugins.hybrid_mp.render import format_decision_table, format_gantt
from tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp import branchy
from tunekit.runtime.session import Session
from tunekit.workload import load_workload


def observe(workload, nproc=4, profile="dgx1-v100x4", baseline=None) -> Observation:
    x, _ = workload.example_batch(2)
    return Observation(
        workload_spec=workload.name,
        workload=workload,
        nproc=nproc,
        backend="nccl",
        device_type="cuda",
        hardware=load_profile(profile),
        model=summarize_model(workload.model(), x),
        baseline=baseline,
    )


def with_options(workload, **opts):
    workload.extra = {**workload.extra, "hybrid_mp": opts}
    return workload


def test_declares_a_placement_tuner_that_owns_gradient_sync():
    t = HybridMp()
    assert t.name == "hybrid_mp" and t.aspect is Aspect.PLACEMENT
    assert Aspect.GRAD_SYNC in t.excludes
    knobs = t.knob_map()
    assert knobs["mp_degree"].default == 1 and knobs["mp_degree"].changes_math
    assert knobs["mp_degree"].live == "relaunch"
    assert knobs["placer"].choices == ("dlplacer", "pipeline")
    assert knobs["placement"].type == "str" and knobs["placement"].default == ""
    with pytest.raises(ConfigError):
        t.validate({"mp_degree": 0})


def test_a_chain_model_is_not_for_model_parallelism():
    d = HybridMp().diagnose(observe(load_workload("example:cnn")))
    assert not d.applies and "chain" in d.summary


def test_one_device_cannot_form_a_worker():
    assert not HybridMp().diagnose(observe(branchy(), nproc=1)).applies
    assert HybridMp().plan(observe(branchy(), nproc=1), 3) == []


def test_branchy_model_diagnosis_names_what_is_missing():
    d = HybridMp().diagnose(observe(branchy()))
    assert d.applies and d.details["su_bound"] > 1.5
    assert "epochs" in d.summary
    with_e = HybridMp().diagnose(observe(with_options(branchy(), epochs={2: 1, 4: 3})))
    assert with_e.applies and "Eq. 6" in with_e.summary and with_e.expected_gain > 0


def test_plan_scores_every_factorisation_and_carries_json_details():
    # a small model runs far below peak: 5 % makes its towers worth splitting over NVLink
    w = with_options(
        branchy(), epochs={1: 1.0, 2: 1.0, 4: 2.5}, time_limit_s=20, compute_efficiency=0.05
    )
    obs = observe(w, nproc=4, baseline=Measurement([0.1], 0.1, 0.0, 640.0))
    cands = HybridMp().plan(obs, 5)
    assert {c.knobs["mp_degree"] for c in cands} == {2, 4}
    best = cands[0]
    json.dumps(best.details)
    d = best.details
    assert d["global_batch"] == d["dp_degree"] * w.batch_size
    assert d["placement"]["status"] in ("optimal", "limit")
    # the baseline was not profiled: nothing to calibrate on, so no prediction, and why;
    # the paper's own figure (the measured step over SU^M) stays in the details
    assert best.predicted_step_s is None and "no prediction: " in best.rationale
    assert best.global_batch == d["global_batch"]
    assert d["paper_step_s"] == pytest.approx(0.1 / d["su_m"])
    rows = {(r["dp"], r["mp"]) for r in d["decision"]["rows"]}
    assert {(2, 2), (1, 4), (4, 1), (2, 1), (1, 1)} <= rows
    assert "<- best" in format_decision_table(d["decision"])
    assert format_gantt(d["placement"]).count("|") == 2 * len(d["placement"]["devices"])
    # ordered by time to converge against the best DP scale
    ttc = [c.details["time_to_converge_vs_best_dp"] for c in cands]
    assert ttc == sorted(ttc, reverse=True)
    # the planned placement travels exactly, as the placement knob
    placed = decode_placement(best.knobs["placement"])["devices"]
    assert set(placed) == {
        n for n, lay in model_graph(obs).layers.items() if lay.kind not in ("input", "output")
    }
    assert max(placed.values()) < best.knobs["mp_degree"]
    text = HybridMp().explain(best)
    assert "```" in text and "Hybrid decision" in text and "Placement" in text


def test_bad_options_are_one_clear_line():
    with pytest.raises(ConfigError, match="unknown setting 'epoch'"):
        HybridOptions.of(with_options(branchy(), epoch={2: 1}))
    with pytest.raises(ConfigError, match="target_loss"):
        HybridOptions.of(with_options(branchy(), epochs_from="measure"))
    with pytest.raises(ConfigError, match="scaling_efficiency"):
        HybridOptions.of(with_options(branchy(), scaling_efficiency="fast"))


def test_apply_without_model_parallelism_changes_nothing():
    s = Session(branchy())
    HybridMp().apply(s, HybridMp().validate({}))
    assert s.step_fn is None


def test_apply_refuses_a_degree_that_does_not_divide_the_world():
    s = Session(branchy())
    with pytest.raises(ConfigError, match="must divide"):
        HybridMp().apply(s, HybridMp().validate({"mp_degree": 2}))


def test_worker_plan_maps_every_layer_node_to_a_device():
    s = Session(branchy())
    plan = worker_plan(s, 2, "dlplacer", 10.0)
    assert set(plan["node_device"].values()) <= {0, 1}
    assert "fc" in plan["node_device"] and plan["order"]["fc"] >= plan["order"]["stem_0"]
    json.dumps(plan)
    pipe = worker_plan(s, 2, "pipeline", 10.0)
    assert pipe["node_device"]["stem_0"] == 0 and pipe["node_device"]["fc"] == 1


def test_placement_knob_round_trips_through_json_onto_fx_nodes():
    from tunekit.observe.graph import trace_model
    from tunekit.plugins.hybrid_mp.schedule import Placement, ScheduledTask

    w = branchy()
    x, _ = w.example_batch(2)
    graph = trace_model(w.model(), x)
    # a coarse op standing for two layers: both follow it
    p = Placement(
        devices=["d0", "d1"],
        assignment={"stem_0": "d0", "fc": "d1"},
        schedule=[
            ScheduledTask("stem_0", "fwd", "d0", 0.0, 1.0),
            ScheduledTask("fc", "fwd", "d1", 2.5, 3.0),
        ],
        routes={},
        makespan=3.0,
        serial_s=3.0,
        method="ilp",
        members={"stem_0": ["stem_0"], "fc": ["pool", "fc"]},
    )
    text = encode_placement(p)
    assert HybridMp().validate({"mp_degree": 2, "placement": text})["placement"] == text
    out = nodes_of(graph, p)
    fc_nodes = graph.layers["fc"].nodes
    assert all(out["node_device"][n] == 1 for n in fc_nodes)
    # a node's place in the order is the midpoint of its op's planned interval [2.5, 3]
    assert out["order"]["fc"] == 2.75 and out["node_device"]["stem_0"] == 0
    assert json.loads(text)["end"]["fc"] == 3.0
    # a hand-written placement with start times only orders by them
    given = decode_placement('{"devices": {"fc": 1}, "start": {"fc": 2.5}}')
    assert placement_nodes(graph, given, 2)["order"]["fc"] == 2.5
    with pytest.raises(ConfigError, match="does not have"):
        placement_nodes(graph, decode_placement('{"devices": {"nope": 0}}'), 2)
    with pytest.raises(ConfigError, match="mp_degree=2"):
        placement_nodes(graph, decode_placement('{"devices": {"fc": 2}}'), 2)
    for bad in (
        "{",
        '{"devices": {"fc": -1}}',
        '{"devices": {"fc": 0}, "start": {"fc": "x"}}',
        '{"devices": {"fc": 0}, "start": {"fc": 1}, "end": {"fc": true}}',
        "[]",
    ):
        with pytest.raises(ConfigError):
            HybridMp().validate({"placement": bad})


def test_modelled_scaling_efficiency_lowers_dp_rows():
    w = with_options(
        branchy(),
        epochs={1: 1.0, 2: 1.0, 4: 1.0},
        scaling_efficiency="model",
        time_limit_s=20,
        compute_efficiency=0.05,
    )
    obs = observe(w, nproc=4, baseline=Measurement([0.01], 0.01, 0.0, 6400.0))
    d = HybridMp().plan(obs, 1)[0].details["decision"]
    dp4 = next(r for r in d["rows"] if (r["dp"], r["mp"]) == (4, 1))
    assert 1.0 < dp4["speedup"] < 4.0  # SE_4 < 1: the gradient all-reduce is charged


def test_no_candidate_when_the_best_placement_does_not_split():
    # on NVLink a tiny model's transfers outweigh its towers: DLPlacer keeps it on one GPU
    obs = observe(branchy(), nproc=2)
    assert HybridMp().plan(obs, 3) == []


def test_placements_are_cached_in_the_study_store():
    class Cache(dict):
        def get(self, key):
            return super().get(key)

        def put(self, key, value):
            self[key] = json.loads(json.dumps(value))

    w = with_options(branchy(), time_limit_s=20, compute_efficiency=0.05)
    obs = observe(w, nproc=2)
    obs.cache = Cache()
    first = HybridMp().plan(obs, 1)
    assert len(obs.cache) == 1
    again = HybridMp().plan(obs, 1)
    assert again[0].details["placement"] == first[0].details["placement"]
