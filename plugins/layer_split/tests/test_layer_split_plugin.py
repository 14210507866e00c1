"""The tuner's surface: knob, plans on a shipped profile, measured tables, config space."""

from __future__ import annotations

import json

import pytest

from tunekit.config import TuningConfig, resolve
from tunekit.contract import Aspect, Diagnosis, Tuner
from tunekit.errors import ConfigError, PluginError
from tunekit.hardware import load_profile
from tunekit.observe.graph import trace_model
from tunekit.observe.local import describe_local_machine
from tunekit.observe.observation import Observation, summarize_model
from tunekit.plugins.layer_split.model import (
    SplitConfig,
    build_tables,
    config_space,
    owned_boxes,
    specs_from_graph,
)
from tunekit.plugins.layer_split.plugin import LayerSplit
from tunekit.plugins.layer_split.search import (
    cost_graph,
    decode_plan,
    evaluate,
    render_rich,
    search,
)
from tunekit.search.elimination import brute_force
from tunekit.workload import load_workload


def observation(spec="example:cnn", nproc=16, hardware=None, cache=None):
    wl = load_workload(spec)
    x = wl.example_batch(2)[0]
    hw = hardware or load_profile("k80x16")
    return Observation(
        spec, wl, nproc, "gloo", "cpu", hw, summarize_model(wl.model(), x), cache=cache
    )


def test_declares_placement_and_takes_over_grad_sync():
    tuner = LayerSplit()
    assert tuner.aspect is Aspect.PLACEMENT
    assert Aspect.GRAD_SYNC in tuner.excludes
    assert tuner.defaults() == {"plan": "image"}


def test_plan_knob_accepts_named_and_encoded_plans_only():
    tuner = LayerSplit()
    assert tuner.validate({"plan": "owt"})["plan"] == "owt"
    encoded = json.dumps({"_0": "n2", "_10": "c2", "_2": "h2w2"})
    assert tuner.validate({"plan": encoded})["plan"] == encoded
    assert decode_plan(encoded)["_2"] == SplitConfig(h=2, w=2)
    for bad in ("bogus", '{"_0": "x2"}', '{"_0": 2}', "[1]"):
        with pytest.raises(ConfigError):
            tuner.validate({"plan": bad})
    # A grad_sync tuner next to it is refused by the config resolver.
    cfg = TuningConfig({"layer_split": {"plan": "owt"}, "some_sync": {}})
    with pytest.raises(ConfigError, match="manages grad_sync"):
        resolve(cfg, {"layer_split": tuner, "some_sync": _SomeGradSync()})


class _SomeGradSync(Tuner):
    """A stand-in grad_sync tuner (plugins never import each other)."""

    name, title, aspect = "some_sync", "Some sync", Aspect.GRAD_SYNC

    def knobs(self):
        return []

    def diagnose(self, obs):
        return Diagnosis(False, "")

    def plan(self, obs, limit):
        return []

    def apply(self, session, knobs):
        pass


def test_config_space_counts_and_device_mapping():
    wl = load_workload("example:alexnet")
    specs = specs_from_graph(trace_model(wl.model(), wl.example_batch(1)[0]), 512)
    conv = config_space(specs["features_3"], 16)
    assert len(conv) == 70  # powers of two over (n, c, h, w) with product <= 16
    fc = config_space(specs["classifier_1"], 16)
    assert {c.h for c in fc} == {c.w for c in fc} == {1} and len(fc) == 15
    assert config_space(specs["x"], 16) == [SplitConfig()]  # the batch: every rank builds it
    # Worker k runs on device k; equal configs give equal slices on equal devices.
    boxes = owned_boxes(specs["features_3"], SplitConfig(n=2, c=2))
    assert boxes[1].tolist() == [[0, 256], [96, 192], [0, 27], [0, 27]]
    assert boxes[2].tolist() == [[256, 512], [0, 96], [0, 27], [0, 27]]


def test_plan_on_the_k80_profile_beats_image_and_owt():
    tuner = LayerSplit()
    obs = observation()
    diag = tuner.diagnose(obs)
    assert diag.applies and diag.expected_gain > 0
    cands = tuner.plan(obs, 5)
    assert cands and [c.predicted_step_s for c in cands] == sorted(
        c.predicted_step_s for c in cands
    )
    best = cands[0]
    details = best.details
    assert json.loads(json.dumps(details)) == details  # JSON-able
    totals = details["totals"]
    for baseline in ("owt", "image", "image_search"):
        assert totals["best"]["total_s"] <= totals[baseline]["total_s"]
    assert best.predicted_step_s == pytest.approx(totals["best"]["total_s"])
    # The candidate's knob value is a plan the tuner accepts, and Eq. 1 on it is the prediction.
    knobs = tuner.validate(best.knobs)
    tables = tuner.tables(obs)
    assert evaluate(tables, decode_plan(knobs["plan"])).cost_s == pytest.approx(
        best.predicted_step_s
    )
    md = tuner.explain(best)
    assert "DeePa (full space)" in md and "| _10 | linear |" in md
    assert render_rich(details).row_count == len(details["rows"]) + len(totals)


def test_search_on_a_real_model_equals_brute_force_on_small_spaces():
    """The example CNN on 2 devices: 5 configs per layer, small enough to enumerate."""
    wl = load_workload("example:cnn")
    specs = specs_from_graph(trace_model(wl.model(), wl.example_batch(2)[0]), 64)
    tables = build_tables(specs, load_profile("k80x16"), 2)
    g, _ = cost_graph(tables, "image_search")
    assert search(tables, "image_search").cost_s == pytest.approx(brute_force(g).cost)


def test_bad_plans_are_one_clear_error():
    wl = load_workload("example:cnn")
    specs = specs_from_graph(trace_model(wl.model(), wl.example_batch(2)[0]), 64)
    tables = build_tables(specs, load_profile("k80x16"), 2)
    plan = search(tables).configs
    with pytest.raises(ConfigError, match="no config for layer"):
        evaluate(tables, {k: v for k, v in plan.items() if k != "_3"})
    with pytest.raises(ConfigError, match="not a valid config"):
        evaluate(tables, {**plan, "_10": SplitConfig(h=2)})
    with pytest.raises(PluginError, match="positive integer"):
        SplitConfig(n=0)


class DictCache:
    def __init__(self):
        self.data, self.puts = {}, 0

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value):
        self.puts += 1
        self.data[key] = json.loads(json.dumps(value))


@pytest.mark.slow
def test_measured_compute_on_this_machine_is_cached():
    cache = DictCache()
    obs = observation(nproc=2, hardware=describe_local_machine(2, "cpu"), cache=cache)
    tuner = LayerSplit()
    tables = tuner.tables(obs)
    assert tables.compute_source.startswith("measured")
    assert cache.puts == 1
    conv = tables.compute["_3"]
    assert conv.min() > 0
    # A second tuner on the same store reads the table instead of timing again.
    again = LayerSplit().tables(
        observation(nproc=2, hardware=describe_local_machine(2, "cpu"), cache=cache)
    )
    assert cache.puts == 1
    assert (again.compute["_3"] == conv).all()


@pytest.mark.slow
def test_inception_v3_graph_reduces_to_two_nodes():
    wl = load_workload("example:inception_v3")
    graph = trace_model(wl.model(), wl.example_batch(1)[0])
    specs = specs_from_graph(graph, 512)
    tables = build_tables(specs, load_profile("k80x16"), 16)
    plan = search(tables)
    stats = plan.stats
    print(
        f"Inception-v3: {stats.nodes_before} nodes, {stats.edges_before} edges -> "
        f"{stats.nodes_after} nodes, {stats.edges_after} edge ({stats.node_eliminations} node and "
        f"{stats.edge_eliminations} edge eliminations, {stats.seconds * 1e3:.0f} ms)"
    )
    assert stats.nodes_before > 120
    assert stats.nodes_after == 2 and stats.edges_after == 1
    g, idx = cost_graph(tables)
    assert g.evaluate(
        {v: idx[v].index(tables.spaces[v].index(c)) for v, c in plan.configs.items()}
    ) == pytest.approx(plan.cost_s)


def test_a_model_the_executor_cannot_run_is_not_planned():
    import torch
    from torch import nn

    from tunekit.workload import Workload

    def model():
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Softmax(dim=1), nn.Linear(144, 10)
        )

    def make_batch(n, gen):
        return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(10, (n,), generator=gen)

    wl = Workload(name="ln", model=model, make_batch=make_batch, batch_size=8)
    obs = Observation(
        "ln",
        wl,
        4,
        "gloo",
        "cpu",
        load_profile("k80x16"),
        summarize_model(wl.model(), wl.example_batch(2)[0]),
    )
    tuner = LayerSplit()
    diag = tuner.diagnose(obs)
    assert not diag.applies and "op Softmax is not supported" in diag.summary
    assert tuner.plan(obs, 3) == []
