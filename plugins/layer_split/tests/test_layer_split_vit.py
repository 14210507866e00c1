"""layer_split on Vision Transformers from small configs (tests/data/vit.py).

A timm-style ViT's ``forward(x, attn_mask=None)`` leaves a graph input no batch
fills; timing a slice that reads shape arithmetic (``B, N, C = x.shape``) rebuilt
the model's inputs from every graph input and crashed on that one ("'NoneType'
object is not subscriptable"), which failed the whole diagnosis.
"""

from __future__ import annotations

import pytest
import torch
from support import DATA

from tunekit.observe.local import describe_local_machine
from tunekit.plugins.layer_split.plugin import LayerSplit
from tunekit.testing.synthetic import synthetic_observation

VIT = DATA / "vit.py"


def _diagnose(fn: str):
    torch.manual_seed(0)
    obs = synthetic_observation(
        f"{VIT}:{fn}", nproc=2, hardware=describe_local_machine(2, "cpu"), breakdown=False
    )
    return obs, LayerSplit().diagnose(obs)


def test_a_timm_style_vit_is_diagnosed_not_crashed():
    obs, diag = _diagnose("workload")
    unfilled = [n for n in obs.graph.nodes.values() if n.op == "input" and n.output_shape is None]
    assert [n.name for n in unfilled] == ["attn_mask"]  # the input that crashed the timer
    # Every layer was timed: the attention core, whose batch is not its input's first dim
    # after timm's permute, is refused by name; nothing raised.
    assert not diag.applies
    assert "blocks_0_attn" in diag.summary and "Error" not in diag.summary


def test_torchvision_vit_is_diagnosed_with_its_reason():
    pytest.importorskip("torchvision")
    _, diag = _diagnose("torchvision_vit")
    assert not diag.applies
    assert "self_attention" in diag.summary
