"""Transformer blocks: which layers form one, and the report's figures per block."""

from __future__ import annotations

import math

import pytest

from tunekit.observe.blocks import (
    block_of,
    block_table,
    block_units,
    graph_units,
    path_units,
    unit_starts,
)
from tunekit.orchestrator import _observation_summary
from tunekit.report.markdown import _observation_section
from tunekit.testing import synthetic_observation, tiny_gpt_workload


def test_block_units_need_a_repeated_block_with_a_norm():
    gpt = [("tok", "Embedding"), ("blocks.0.ln1", "LayerNorm"), ("blocks.0.attn", "Linear"),
           ("blocks.1.ln1", "LayerNorm"), ("blocks.1.attn", "Linear"), ("head", "Linear")]  # fmt: skip
    assert block_units(gpt) == ["tok", "blocks.0", "blocks.0", "blocks.1", "blocks.1", "head"]
    assert unit_starts(block_units(gpt)) == (True, True, False, True, False, True)
    # a ResNet's repeated blocks hold no norm of a transformer's kind: no transformer blocks
    resnet = [("conv1", "Conv2d"), ("layer1.0.conv1", "Conv2d"), ("layer1.0.bn1", "BatchNorm2d")]
    assert block_units(resnet) is None
    assert block_of("blocks.3.attn.qkv") == "blocks.3" and block_of("head") is None


def test_functions_belong_to_the_block_they_run_in():
    # attention's matmuls and the residual adds have no module path: the block before them
    layers = [("tok", "tok", "Embedding"), ("add", None, ""), ("b0_ln", "blocks.0.ln1", "LayerNorm"),
              ("b0_qkv", "blocks.0.attn.qkv", "Linear"), ("matmul", None, ""),
              ("b0_fc", "blocks.0.mlp.fc", "Linear"), ("add_1", None, ""), ("ln", "ln", "LayerNorm")]  # fmt: skip
    assert path_units(layers) == ["tok", "add", "blocks.0", "blocks.0", "blocks.0", "blocks.0",
                                  "blocks.0", "ln"]  # fmt: skip


def test_block_table_sums_each_unit_in_model_order():
    rows = [
        {"name": "tok", "forward_s": 1.0, "backward_s": 2.0, "flops": None},
        {"name": "b0_ln", "forward_s": 0.5, "backward_s": 1.0, "flops": 10},
        {"name": "b0_mlp", "forward_s": 2.0, "backward_s": 4.0, "flops": 90},
        {"name": "head", "forward_s": 3.0, "backward_s": 6.0, "flops": 50},
    ]
    table = block_table(rows, {"b0_ln": "blocks.0", "b0_mlp": "blocks.0"})
    assert [r["unit"] for r in table] == ["tok", "blocks.0", "head"]
    assert table[1] == {
        "unit": "blocks.0",
        "layers": 2,
        "forward_s": 2.5,
        "backward_s": 5.0,
        "flops": 100,
    }
    assert table[0]["flops"] == 0  # no FLOPs counted: zero, not a made-up figure


def test_a_cnn_has_no_units():
    obs = synthetic_observation("example:cnn")
    assert graph_units(obs.graph) is None and _observation_summary(obs)["blocks"] is None


@pytest.fixture(scope="module")
def gpt_summary():
    obs = synthetic_observation(tiny_gpt_workload(), layer_profile=True)
    return obs, _observation_summary(obs)


def test_the_report_shows_a_transformer_by_block_with_its_gflop(gpt_summary):
    obs, summary = gpt_summary
    blocks = summary["blocks"]
    units = [r["unit"] for r in blocks]
    assert "blocks.0" in units and "blocks.1" in units
    by_unit = {r["unit"]: r for r in blocks}
    # every timed layer is in exactly one unit, and the times add up to the profile's
    assert sum(r["layers"] for r in blocks) == len(obs.layer_profile.layers)
    assert sum(r["forward_s"] for r in blocks) == pytest.approx(obs.layer_profile.forward_s)
    # a block's forward FLOPs at the job's batch: its layers', from the traced graph
    scale = obs.workload.batch_size / obs.graph.batch_size
    units = graph_units(obs.graph)
    block0 = [n for n in obs.layer_profile.layers if units[n] == "blocks.0"]
    assert by_unit["blocks.0"]["flops"] == pytest.approx(
        sum(obs.graph.layers[n].flops for n in block0) * scale
    )
    assert by_unit["blocks.0"]["flops"] > 0
    assert all(t["flops"] is not None for t in summary["top_layers"])

    md = "\n".join(_observation_section(summary))
    assert "## By transformer block" in md
    line = next(x for x in md.splitlines() if x.startswith("| blocks.0 |"))
    assert f"{by_unit['blocks.0']['flops'] / 1e9:.3f} |" in line
    assert "GFLOP (forward)" in md


def test_layer_norm_counts_five_flops_per_element():
    obs = synthetic_observation(tiny_gpt_workload())
    norms = {n: layer for n, layer in obs.graph.layers.items() if layer.kind == "norm"}
    assert norms
    for layer in norms.values():  # [batch, sequence, width], affine: 5 per element
        assert layer.flops == 5 * math.prod(layer.output_shape)


# -- Hugging Face models, captured by torch.export (issue 32, item 7) ----------------------


def _hf_blocks(fn: str):
    pytest.importorskip("transformers", reason="the Hugging Face models need tunekit[hf]")
    from support import DATA

    from tunekit.observe.blocks import profile_blocks
    from tunekit.observe.graph import trace_model
    from tunekit.observe.layer_profile import LayerProfile, LayerTiming
    from tunekit.workload import load_workload

    wl = load_workload(f"{DATA / 'hf_small.py'}:{fn}")
    graph = trace_model(wl.model(), wl.example_batch(wl.batch_size)[0])
    assert graph.method == "export"
    # Injected times (1 ms forward, 2 ms backward a layer): the claim is about grouping.
    timed = {
        name: LayerTiming(name, lay.kind, 1e-3, 2e-3)
        for name, lay in graph.layers.items()
        if lay.kind not in ("input", "output")
    }
    profile = LayerProfile(graph.graph_hash(), "cpu", graph.batch_size, 0, 1, timed)
    return graph, profile_blocks(graph, profile)


def _block_rows(rows, prefix: str) -> dict[str, dict]:
    return {r["unit"]: r for r in rows if r["unit"].startswith(prefix)}


def test_gpt2_blocks_are_listed_once_with_their_residual_adds_and_masks_grouped():
    graph, rows = _hf_blocks("gpt2")
    units = [r["unit"] for r in rows]
    assert len(units) == len(set(units))  # each unit once
    blocks = _block_rows(rows, "model.transformer.h.")
    assert sorted(blocks) == ["model.transformer.h.0", "model.transformer.h.1"]
    for unit, row in blocks.items():
        prefix = unit.replace(".", "_") + "_"
        inside = [n for n in graph.layers if n.startswith(prefix)]
        assert row["layers"] == len(inside)  # every layer of the block, its residual adds too
        assert any(graph.layers[n].kind == "add" for n in inside)
    # the causal mask GPT2Model builds (arange, le, and, index, ...) is one row, not twenty
    assert len(rows) <= 10
    mask = next(r for r in rows if r["unit"] == "model.transformer")
    assert mask["layers"] >= 15 and mask["flops"] == 0


def test_llama_gets_its_rmsnorm_blocks():
    graph, rows = _hf_blocks("llama")
    assert rows is not None
    blocks = _block_rows(rows, "model.model.layers.")
    assert sorted(blocks) == ["model.model.layers.0", "model.model.layers.1"]
    norms = [n for n in graph.layers if n.startswith("model_model_layers_0_") and "layernorm" in n]
    assert norms and graph.nodes[graph.layers[norms[0]].nodes[0]].module_type == "LlamaRMSNorm"
    assert blocks["model.model.layers.0"]["flops"] > 0
    assert len(rows) <= 10
