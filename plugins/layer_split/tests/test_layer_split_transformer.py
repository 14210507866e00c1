"""layer_split on transformers: the planned layers, the configs, and real training on 2 ranks."""

from __future__ import annotations

import json

import pytest
import torch

from tunekit.plugins.layer_split.model import SplitConfig, config_space, specs_from_graph
from tunekit.plugins.layer_split.runtime import PlanExecutor
from tunekit.plugins.layer_split.tests.ranks_layer_split import (
    TINY_GPT,
    tiny_gpt_workload,
    tiny_vit_workload,
    train_plans,
)
from tunekit.plugins.layer_split.units import split_graph
from tunekit.testing import EQUIVALENCE_RTOL, assert_states_close, run_ranks

GPT = "tunekit.plugins.layer_split.tests.ranks_layer_split:tiny_gpt_workload"
VIT = "tunekit.plugins.layer_split.tests.ranks_layer_split:tiny_vit_workload"


def _graph(model, tokens):
    from tunekit.observe.graph import trace_model

    return split_graph(trace_model(model, tokens[:2]))


def test_gpt_layers_and_configs():
    """Each attention core is one layer; arange and the position embedding have no batch
    dimension (every rank computes them whole); Embedding, LayerNorm and attention split
    by samples."""
    w = tiny_gpt_workload()
    model = w.model()
    tokens, _ = w.example_batch(4)
    graph = _graph(model, tokens)
    kinds = {v: lay.kind for v, lay in graph.layers.items()}
    assert [v for v, k in kinds.items() if k == "attention"] == ["blocks_0_attn", "blocks_1_attn"]
    assert graph.layers["blocks_0_attn"].inputs == ["blocks_0_attn_qkv"]
    assert graph.layers["blocks_0_attn_proj"].inputs == ["blocks_0_attn"]
    specs = specs_from_graph(graph, 8)
    for const in ("arange", "positions"):
        assert specs[const].replicated and not specs[const].batched
        assert config_space(specs[const], 2) == [SplitConfig()]
    assert specs["positions"].shape == (TINY_GPT["seq"], TINY_GPT["width"], 1, 1)
    for v in ("tokens_1", "blocks_0_ln1", "ln"):
        assert [c.label() for c in config_space(specs[v], 2)] == ["1", "n2"], v
    # attention by samples or by whole heads (its channels: 4 heads of 4)
    assert specs["blocks_0_attn"].heads == TINY_GPT["heads"]
    assert [c.label() for c in config_space(specs["blocks_0_attn"], 2)] == ["1", "h2", "n2"]
    assert [c.label() for c in config_space(specs["blocks_0_attn"], 4)] == [
        "1",
        "h2",
        "h4",
        "n2",
        "n2h2",
        "n4",
    ]
    assert specs["add"].uses[1].shape == (TINY_GPT["seq"], TINY_GPT["width"])
    # Reading the position embedding whole, the add splits by samples only; the residual
    # adds split any way.
    assert [c.label() for c in config_space(specs["add"], 2)] == ["1", "n2"]
    assert "c2" in [c.label() for c in config_space(specs["add_1"], 2)]


@pytest.mark.parametrize("factory", [tiny_gpt_workload, tiny_vit_workload])
def test_executor_matches_autograd_in_one_process(factory):
    """One rank, every layer on it: the executor's loss and gradients are autograd's."""
    f64 = torch.float64
    w = factory()
    torch.manual_seed(0)
    model = w.model().to(f64)
    tokens, targets = w.example_batch(4)
    tokens = tokens.to(f64) if tokens.is_floating_point() else tokens
    graph = _graph(model, tokens)
    specs = specs_from_graph(graph, 4)
    executor = PlanExecutor(model, graph, {v: SplitConfig() for v in specs}, 4, 0, 1)
    loss = executor.step(tokens, targets, w.loss)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = w.loss(model(tokens), targets)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_split_timer_times_transformer_layers_at_the_global_batch():
    """The timer runs a per-model constant whole and shape arithmetic at the slice's batch
    (it used to stretch the position embedding to the batch: "size of tensor a (64) must
    match the size of tensor b (8)", and time ``torch.arange`` nowhere)."""
    from tunekit.plugins.layer_split.measure import SplitTimer

    w = tiny_gpt_workload()
    model = w.model()
    tokens, _ = w.example_batch(4)
    graph = _graph(model, tokens)
    timer = SplitTimer(model, graph, batch_size=6, warmup=0, repeats=1)  # 6: no other dim
    seq, width = TINY_GPT["seq"], TINY_GPT["width"]
    assert timer.time("arange", (1, 1, 1, 1)).output_shape == [seq]
    assert timer.time("positions", (1, 1, 1, 1)).output_shape == [seq, width]
    assert timer.time("add", (2, 1, 1, 1)).output_shape == [3, seq, width]
    assert timer.time("blocks_0_attn", (2, 1, 1, 1)).output_shape == [3, seq, width]
    assert timer.time("blocks_0_attn", (1, 1, 1, 1)).output_shape == [6, seq, width]


def test_head_shares_make_the_core_and_other_attention_is_refused_by_name():
    """Every worker's share of the heads, side by side, is the fused core's output; a core
    that is not plain multi-head attention (here: another scale) keeps its sample splits."""
    from tunekit.errors import PluginError
    from tunekit.plugins.layer_split.heads import attend
    from tunekit.plugins.layer_split.slices import build_programs

    w = tiny_gpt_workload()
    model = w.model()
    tokens, _ = w.example_batch(4)
    graph = _graph(model, tokens)
    specs = specs_from_graph(graph, 4)
    programs, ops = build_programs(model, graph, specs)
    prog = programs["blocks_0_attn"]
    ops.check(prog, SplitConfig(h=2))
    assert prog.heads.causal and prog.heads.count == TINY_GPT["heads"]
    qkv = torch.randn(3, TINY_GPT["seq"], 3 * TINY_GPT["width"])
    whole = ops._region(prog, [(0, 3)], [qkv])
    shares = [attend(qkv, prog.heads, h, h + 1) for h in range(prog.heads.count)]
    torch.testing.assert_close(torch.cat(shares, dim=-1), whole)
    with pytest.raises(PluginError, match="cannot share 4 heads"):
        ops.check(prog, SplitConfig(h=3))

    from tunekit.examples import transformers as tr

    class Scaled(tr.Attention):  # scores scaled by 1/d, not 1/sqrt(d)
        def forward(self, x):
            n, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=2)
            q, k, v = (z.view(n, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            scores = (q @ k.transpose(-2, -1)) * (1.0 / (c // self.heads))
            out = scores.softmax(dim=-1) @ v
            return self.proj(out.transpose(1, 2).reshape(n, t, c))

    odd = w.model()
    for block in odd.blocks:
        scaled = Scaled(TINY_GPT["width"], TINY_GPT["heads"], causal=False)
        scaled.load_state_dict(block.attn.state_dict())
        block.attn = scaled
    graph = _graph(odd, tokens)
    specs = specs_from_graph(graph, 4)
    programs, ops = build_programs(odd, graph, specs)
    with pytest.raises(PluginError, match="not plain multi-head attention"):
        ops.check(programs["blocks_0_attn"], SplitConfig(h=2))
    ops.check(programs["blocks_0_attn"], SplitConfig(n=2))


def test_region_refuses_sample_mixing():
    """A fused subgraph that reads one sample's values into a batch-free tensor is refused,
    by name, not run wrongly."""
    from torch import nn

    from tunekit.errors import PluginError
    from tunekit.observe.graph import trace_model
    from tunekit.plugins.layer_split.slices import build_programs

    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 8)
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            s = self.qkv(x) @ x.transpose(1, 2)
            s = s.softmax(-1) * s[0].mean()  # sample 0's values reach every sample
            return self.out(s @ x)

    model = Leaky()
    graph = split_graph(trace_model(model, torch.randn(2, 5, 8)))
    specs = specs_from_graph(graph, 4)
    programs, ops = build_programs(model, graph, specs)
    (att,) = [v for v, s in specs.items() if s.kind == "attention"]
    with pytest.raises(PluginError, match="mixes samples"):
        ops.check(programs[att], SplitConfig(n=2))


# Sample splits everywhere, then a plan that moves the attention cores, a LayerNorm and the
# head onto one rank and back (re-splits between every kind of layer).
MIXED = {
    "tokens_1": "n2",
    "add": "n2",
    "blocks_0_ln1": "1",
    "blocks_0_attn_qkv": "n2",
    "blocks_0_attn": "1",
    "blocks_0_attn_proj": "n2",
    "add_1": "c2",
    "blocks_0_ln2": "n2",
    "blocks_0_mlp_fc": "1",
    "blocks_0_mlp_proj": "n2",
    "add_2": "n2",
    "blocks_1_ln1": "n2",
    "blocks_1_attn_qkv": "n2",
    "blocks_1_attn": "n2",
    "blocks_1_attn_proj": "1",
    "add_3": "h2",
    "blocks_1_ln2": "n2",
    "blocks_1_mlp_fc": "n2",
    "blocks_1_mlp_proj": "n2",
    "add_4": "n2",
    "ln": "1",
    "head": "n2",
    "output": "n2",
}


def _gpt_by_heads() -> dict[str, str]:
    """The tiny GPT split by samples, its attention cores by heads (two of four per rank):
    each core gathers its samples' whole q|k|v, the projection after it gathers both
    ranks' heads."""
    w = tiny_gpt_workload()
    tokens, _ = w.example_batch(4)
    specs = specs_from_graph(_graph(w.model(), tokens), 8)
    plan = {v: "n2" for v, s in specs.items() if not s.replicated}
    plan.update(blocks_0_attn="h2", blocks_1_attn="h2")
    return plan


def _vit_mixed() -> dict[str, str]:
    """The ViT's layers split by samples but for: the patch embedding and the final
    LayerNorm on one rank, the class-token concat split along the tokens, an attention core
    on one rank and the head split by its output features."""
    w = tiny_vit_workload()
    images, _ = w.example_batch(4)
    specs = specs_from_graph(_graph(w.model(), images), 8)
    plan = {v: "n2" for v, s in specs.items() if not s.replicated}
    plan.update(patches="1", cat="c2", blocks_1_attn="1", ln="1", head="c2")
    return plan


@pytest.mark.slow
@pytest.mark.equivalence
def test_transformer_plans_train_like_ddp():
    """On 2 gloo ranks in float64, with AdamW, warm-up + cosine and clipping at 1.0: the
    image plan and a mixed plan of the tiny GPT and the tiny ViT reach DDP's parameters
    and losses."""
    steps = 3
    cases = [
        (GPT, "ddp", steps),
        (GPT, "image", steps),
        (GPT, json.dumps(MIXED), steps),
        (GPT, json.dumps(_gpt_by_heads()), steps),
        (VIT, "ddp", steps),
        (VIT, "image", steps),
        (VIT, json.dumps(_vit_mixed()), steps),
    ]
    results = run_ranks(train_plans, 2, (cases,), timeout_s=600, dtype=torch.float64)
    for ddp, what, plans in ((0, "gpt", 3), (4, "vit", 2)):
        _check_like_ddp(results, ddp, what, plans)
    # It trained: the parameters moved.
    start = tiny_gpt_workload().model().state_dict()
    ref = results[0][0]
    assert any(not torch.allclose(start[k].double(), ref["params"][k]) for k in start)


def _check_like_ddp(results, ddp: int, model: str, plans: int) -> None:
    ref = results[0][ddp]
    # DDP reports each rank's own loss; the global loss is their mean (equal shares).
    global_losses = [
        (a + b) / 2 for a, b in zip(ref["losses"], results[1][ddp]["losses"], strict=True)
    ]
    names = ("image plan", "mixed plan", "plan by heads")[:plans]
    for i, what in ((ddp + 1 + j, f"{model}: {name}") for j, name in enumerate(names)):
        ranks = [results[0][i], results[1][i]]
        for r in ranks:
            assert_states_close(r["params"], ref["params"], what)
        for name in ref["params"]:
            assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        assert ranks[0]["losses"] == pytest.approx(global_losses, rel=EQUIVALENCE_RTOL), what


def _local_observation():
    from tunekit.observe.local import describe_local_machine
    from tunekit.observe.observation import Observation, summarize_model

    w = tiny_gpt_workload()
    x = w.example_batch(2)[0]
    hw = describe_local_machine(2, "cpu")
    return Observation("tiny_gpt", w, 2, "gloo", "cpu", hw, summarize_model(w.model(), x))


def test_diagnosis_plans_the_tiny_gpt_on_this_machine():
    """Measured compute for every layer (none dropped), and a plan of runnable configs."""
    from tunekit.plugins.layer_split.plugin import LayerSplit

    tuner = LayerSplit()
    obs = _local_observation()
    tuner.diagnose(obs)
    assert tuner.unsupported == []
    tables = tuner.tables(obs)
    assert [c.label() for c in tables.spaces["blocks_0_attn"]] == ["1", "h2", "n2"]
    assert tables.spaces["positions"] == [SplitConfig()]
    assert (tables.compute["blocks_0_attn"] > 0).all()
    # two heads of four per worker: the work of two samples of four
    heads, samples = (
        tables.spaces["blocks_0_attn"].index(SplitConfig(**k)) for k in ({"h": 2}, {"n": 2})
    )
    assert tables.compute["blocks_0_attn"][heads] == tables.compute["blocks_0_attn"][samples]


def test_a_layer_the_timer_cannot_run_is_named(monkeypatch):
    """A layer none of whose configs the split timer can run is refused by name (it used to
    end the search with "node 'arange' has no configurations")."""
    from tunekit.plugins.layer_split.measure import SplitTimer
    from tunekit.plugins.layer_split.plugin import LayerSplit

    real = SplitTimer.time

    def time(self, layer, split):
        if layer == "arange":
            raise RuntimeError("cannot")
        return real(self, layer, split)

    monkeypatch.setattr(SplitTimer, "time", time)
    tuner = LayerSplit()
    diag = tuner.diagnose(_local_observation())
    assert not diag.applies
    assert "layer 'arange' (other): the split timer cannot run any of its configs" in diag.summary
