"""Models nobody here wrote, observed as their authors wrote them (issue 32).

An unmodified nanoGPT-style GPT (``tests/data/nanogpt.py``: its attention is
``F.scaled_dot_product_attention(...).transpose(1, 2).contiguous().view(B, T, C)``,
its forward has control flow fx cannot trace and computes its own loss), driven
through a workload whose inputs are the tuple ``(idx, targets)``; a loss that
cannot train, caught while observing.
"""

from __future__ import annotations

import pytest
import torch
from support import DATA, WORKLOADS
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tunekit.errors import WorkloadError
from tunekit.observe import workload_child
from tunekit.observe.graph import trace_model
from tunekit.workload import load_workload

NANOGPT = f"{DATA / 'nanogpt.py'}:workload"


@pytest.fixture(scope="module")
def nanogpt():
    torch.manual_seed(0)
    wl = load_workload(NANOGPT)
    return wl, wl.model(), wl.example_batch(4)


def test_nanogpt_is_captured_by_torch_export_with_its_attention_flops(nanogpt):
    _, wrapper, ((idx, _targets), _) = nanogpt
    gpt = wrapper.gpt  # nanoGPT's own GPT, called as nanoGPT calls it: gpt(idx)
    graph = trace_model(gpt, idx)
    # fx cannot follow `b, t = idx.size()`; torch.export can, and must not fail on the
    # `.transpose(1, 2).contiguous().view(B, T, C)` after tunekit decomposes attention.
    assert graph.method == "export", graph.notice
    gpt.train()
    # The reference counts attention as matmuls (PyTorch's math kernel): the CPU fused
    # kernel SDPA picks otherwise is counted as 0 FLOPs by FlopCounterMode.
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as c:
        gpt(idx)
    assert graph.total_flops() == pytest.approx(c.get_total_flops(), rel=0.05)
    attention = [
        n for n in graph.nodes.values() if n.op == "matmul" and n.param_numel == 0 and n.flops
    ]
    assert len(attention) == 2 * gpt.config.n_layer  # scores and values in every block
    assert all("attn" in n.name for n in attention)


def test_tuple_inputs_reach_the_model_as_one_argument_while_observing(nanogpt):
    wl, _, ((idx, _), _) = nanogpt
    state = workload_child._State()
    seen = workload_child.observe(state, {"workload": NANOGPT})
    # the same call the training ranks make, model((idx, targets)): no "takes 2 positional
    # arguments but 3 were given", and a real tracer rather than the hooks fallback
    assert seen["graph"]["method"] == "export"
    assert seen["summary"]["example_batch"] == wl.batch_size
    inputs = [n for n in seen["graph"]["nodes"] if n["op"] == "input"]
    assert [n["output_shape"] for n in inputs] == [list(idx.shape)] * 2  # idx and targets
    timed = workload_child.profile_layers(state, {"device": "cpu", "repeats": 1, "threads": 1})
    assert timed["notice"] is None and timed["layer_profile"]["layers"]


def test_a_loss_that_cannot_train_fails_observation_in_one_line():
    state = workload_child._State()
    with pytest.raises(WorkloadError) as info:
        workload_child.observe(state, {"workload": f"{WORKLOADS}:column_targets"})
    message = str(info.value)
    assert "\n" not in message
    assert "its loss fails on the example batch" in message
    assert "targets (8, 1) int64" in message and "model output (8, 2) float32" in message


def test_the_first_step_leaves_the_model_as_it_was():
    from tunekit.observe.first_step import try_first_step

    wl = load_workload(NANOGPT)
    model = wl.model().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    try_first_step(wl, model, wl.example_batch(2))
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
