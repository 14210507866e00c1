"""Graph capture of Hugging Face models (torch.fx cannot trace them; torch.export can).

Small GPT-2, BERT and Llama configs: the captured graph keeps the residual
branches and every attention matmul, its FLOPs match a training-mode
``FlopCounterMode`` and its parameters are exact. The reference runs a copy of
the model with eager attention: ``FlopCounterMode`` does not count PyTorch's
CPU flash-attention kernel, which SDPA picks when attention dropout is off.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tunekit.observe.graph import ModelGraph, trace_model

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tunekit[hf]')"
)
from tunekit.workloads.huggingface import HFModel  # noqa: E402 (after the skip)

VOCAB, SEQ, BATCH, BLOCKS = 256, 16, 2, 2


def _configs():
    return {
        "gpt2": (
            transformers.GPT2LMHeadModel,
            transformers.GPT2Config(
                vocab_size=VOCAB,
                n_positions=SEQ,
                n_embd=32,
                n_layer=BLOCKS,
                n_head=2,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "bert": (
            transformers.BertForSequenceClassification,
            transformers.BertConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=BLOCKS,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=SEQ,
            ),
        ),
        "llama": (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=BLOCKS,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=SEQ,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
    }


def _inputs(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1]) if name == "bert" else ids
    return {"input_ids": ids, "labels": labels}


def _reference_flops(cls, config, state, inputs) -> int:
    """A training-mode forward of the same weights with attention as plain matmuls."""
    eager = type(config).from_dict(config.to_dict())
    eager._attn_implementation = "eager"
    model = HFModel(cls(eager))
    model.load_state_dict(state)
    model.train()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(inputs)
    return counter.get_total_flops()


@pytest.fixture(scope="module", params=["gpt2", "bert", "llama"])
def captured(request) -> tuple[str, HFModel, ModelGraph, int]:
    torch.manual_seed(0)
    cls, config = _configs()[request.param]
    model = HFModel(cls(config)).eval()  # capture must switch to training mode itself
    inputs = _inputs(request.param)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = trace_model(model, inputs)
    assert not model.training, "the model's own mode is restored"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return request.param, model, graph, _reference_flops(cls, config, before, inputs)


def test_captured_with_torch_export_and_says_so(captured):
    _, _, graph, _ = captured
    assert graph.method == "export"
    assert "torch.fx could not trace HFModel" in graph.notice and "torch.export" in graph.notice


def test_parameters_are_exact(captured):
    _, model, graph, _ = captured
    assert graph.total_params() == sum(p.numel() for p in model.parameters())


def test_flops_match_a_training_forward(captured):
    name, _, graph, reference = captured
    assert reference > 0
    assert graph.total_flops() == pytest.approx(reference, rel=0.05), name


def _attention_matmuls(graph: ModelGraph) -> list:
    """Matmuls of activations by activations (no weights): attention's scores and values."""
    return [
        n
        for n in graph.nodes.values()
        if n.op in ("matmul", "bmm") and n.param_numel == 0 and n.flops > 0
    ]


def test_every_attention_matmul_is_a_node(captured):
    _, _, graph, _ = captured
    matmuls = _attention_matmuls(graph)
    assert len(matmuls) == 2 * BLOCKS  # scores (q·kᵀ) and values (p·v) in every block
    for n in matmuls:
        assert "attn" in n.name or "attention" in n.name, n.name
        assert n.output_shape[-2] == SEQ  # (batch, heads, queries, keys or head width)

    # each value matmul reads the layer that softmaxes the scores (dropout folded in, in training)
    def reads_softmax(n) -> bool:
        layers = {graph.nodes[i].layer for i in n.inputs}
        return any(
            graph.nodes[m].op == "softmax" for lay in layers if lay for m in graph.layers[lay].nodes
        )

    assert sum(reads_softmax(n) for n in matmuls) == BLOCKS


def test_residual_branches_are_kept(captured):
    _, _, graph, _ = captured
    # A residual add reads the block's input and the sublayer's output: two producer layers.
    residual = [
        lay
        for lay in graph.layers.values()
        if lay.kind == "add" and len(lay.inputs) == 2 and lay.output_shape == [BATCH, SEQ, 32]
    ]
    assert len(residual) >= 2 * BLOCKS
    # and a block's input fans out, to its sublayer and around it
    assert sum(len(graph.successors(lay)) >= 2 for lay in graph.layers) >= 2 * BLOCKS


def test_layers_name_their_blocks(captured):
    name, _, graph, _ = captured
    names = " ".join(graph.layers)
    block = {"gpt2": "transformer_h_1_", "bert": "encoder_layer_1_", "llama": "layers_1_"}[name]
    mlp = {"gpt2": "_mlp_", "bert": "_intermediate_", "llama": "_mlp_"}[name]
    assert block in names and mlp in names and ("attn" in names or "attention" in names)


def test_dropout_is_in_the_graph_because_capture_trains(captured):
    name, _, graph, _ = captured
    if name == "llama":
        pytest.skip("Llama has no dropout by default")
    assert any(n.op == "native_dropout" for n in graph.nodes.values())


def test_layers_of_an_export_graph_are_timed_one_by_one(captured):
    name, model, graph, _ = captured
    if name != "gpt2":
        pytest.skip("one model is enough for the layer runner")
    from tunekit.observe.layer_profile import profile_layers

    profile = profile_layers(model, _inputs(name), graph, warmup=0, repeats=1)
    computing = {n for n, lay in graph.layers.items() if lay.kind not in ("input", "output")}
    assert set(profile.layers) == computing
    scores = next(n.layer for n in _attention_matmuls(graph))
    assert profile.layers[scores].forward_s > 0 and profile.layers[scores].backward_s > 0


def test_the_docs_say_what_tunekit_counts_beyond_a_plain_flop_counter_for_llama():
    """docs/workloads.md: on a CPU, FlopCounterMode counts fused attention as 0 FLOPs; tunekit
    counts its matmuls. The figure the page gives for its Llama example is this one."""
    import re
    from pathlib import Path

    from torch.nn.attention import SDPBackend, sdpa_kernel

    doc = Path(__file__).resolve().parents[2] / "docs" / "workloads.md"
    text = doc.read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "LlamaConfig" in b)
    names: dict = {}
    exec(code, names)
    wl = names["workload"]()
    torch.manual_seed(0)
    model = wl.model()
    inputs, _ = wl.example_batch(wl.batch_size)
    tunekit_flops = trace_model(model, inputs).total_flops()
    model.train()
    with torch.no_grad(), FlopCounterMode(display=False) as plain:
        model(inputs)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as math:
        model(inputs)
    assert tunekit_flops == pytest.approx(math.get_total_flops(), rel=0.01)
    ratio = tunekit_flops / plain.get_total_flops()
    assert ratio > 1.01  # attention's matmuls, which the plain counter leaves out
    assert f"tunekit's total is {ratio:.3f}× that of a plain `FlopCounterMode`" in text
