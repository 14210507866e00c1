"""two_chunk on a transformer: chunk 1 starts at a block's border, never inside a block."""

from __future__ import annotations

from tunekit.observe.blocks import block_of
from tunekit.observe.observation import summarize_model
from tunekit.plugins.overlap_chunking.layers import block_boundaries, paper_layers
from tunekit.plugins.overlap_chunking.model import LayerCost, StepCosts
from tunekit.plugins.overlap_chunking.search import two_chunk_settings
from tunekit.testing import tiny_gpt_workload
from tunekit.workload import load_workload


def _gpt_layers():
    w = tiny_gpt_workload()
    return paper_layers(summarize_model(w.model(), w.example_batch(2)[0]))


def test_block_of():
    assert block_of("blocks.3.attn.qkv") == "blocks.3"
    assert block_of("layer1.0.conv1") == "layer1.0"
    assert block_of("ln") is None and block_of("features.0") is None


def test_gpt_boundaries_are_block_starts():
    layers = _gpt_layers()
    names = [layer.name for layer in layers]
    allowed = block_boundaries(layers)
    assert allowed is not None
    starts = {names[i] for i, ok in enumerate(allowed) if ok}
    # Each block's first layer, and every layer outside the blocks.
    assert {"blocks.0.ln1", "blocks.1.ln1"} <= starts
    assert {n for n in names if block_of(n) is None} <= starts
    assert not starts & {"blocks.0.attn.qkv", "blocks.0.ln2", "blocks.1.mlp.proj"}


def test_cnn_has_no_blocks():
    w = load_workload("example:cnn")
    assert block_boundaries(paper_layers(summarize_model(w.model(), w.example_batch(2)[0]))) is None


def test_two_chunk_settings_cut_only_at_block_borders():
    layers = _gpt_layers()
    n = len(layers)
    costs = StepCosts(
        tuple(LayerCost(layer.name, 1e-3, 2e-3, (4 * layer.param_numel,)) for layer in layers),
        1e-9,
        0.0,
        2,
        lambda b: 1e-4 + b / 1e9,
        lambda b: 1e-4 + b / 2e9,
    )
    allowed = block_boundaries(layers)
    free = {s.knobs["k"] for s in two_chunk_settings(costs)}
    aligned = {s.knobs["k"] for s in two_chunk_settings(costs, allowed)}
    assert aligned and aligned < free  # the block-internal cuts are gone, the others kept
    for k in aligned:
        assert allowed[n - k], layers[n - k].name
        assert (
            block_of(layers[n - k].name) != block_of(layers[n - k - 1].name)
            or block_of(layers[n - k].name) is None
        )
