"""tunekit.workloads.huggingface and example:hf-gpt2: the helper, and the missing extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import run_cli

from tunekit.errors import WorkloadError

NO_TRANSFORMERS = Path(__file__).parents[1] / "data" / "no_transformers"


def _without_transformers() -> dict[str, str]:
    """PYTHONPATH with a `transformers` that fails to import first: the extra is missing."""
    path = os.pathsep.join([str(NO_TRANSFORMERS), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path.rstrip(os.pathsep)}


@pytest.mark.parametrize("command", [("profile", "example:hf-gpt2"), ("auto", "example:hf-gpt2")])
def test_missing_extra_is_one_line_and_exit_2(tmp_path, command):
    res = run_cli(*command, cwd=tmp_path, env_extra=_without_transformers(), timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in (res.stderr + res.stdout).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "pip install 'tunekit[hf]'" in lines[0]


def test_importing_the_helper_without_the_extra_names_it(tmp_path):
    code = (
        "try:\n    import tunekit.workloads.huggingface\n"
        "except ImportError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, **_without_transformers()}
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.stdout.startswith("MissingExtra "), res.stdout + res.stderr
    assert "pip install 'tunekit[hf]'" in res.stdout


transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tunekit[hf]')"
)
from tunekit.workload import load_workload  # noqa: E402
from tunekit.workloads.huggingface import hf_workload  # noqa: E402


def _bert():
    return transformers.BertConfig(
        vocab_size=128,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
    )


def test_example_trains_on_the_models_own_loss():
    w = load_workload("example:hf-gpt2")
    model = w.model()
    inputs, labels = w.example_batch(2)
    assert inputs["input_ids"].shape == (2, 64) and torch.equal(inputs["labels"], labels)
    out = model(inputs)
    loss = w.loss(out, labels)
    assert loss is out.loss and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_classification_from_a_config_and_a_class():
    w = hf_workload(_bert(), transformers.BertForSequenceClassification, seq_len=12, batch_size=4)
    assert w.extra["hf_task"] == "classification" and w.name == "hf-bert"
    inputs, labels = w.example_batch(4)
    assert inputs["input_ids"].shape == (4, 12) and labels.shape == (4,)
    assert int(labels.max()) < 3
    assert torch.isfinite(w.loss(w.model()(inputs), labels))


def test_a_users_tokenized_dataset():
    items = [{"input_ids": list(range(i, i + 8))} for i in range(10)]
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    w = hf_workload(config, transformers.GPT2LMHeadModel, dataset=lambda: items, batch_size=2)
    inputs, labels = w.example_batch(3)
    assert torch.equal(inputs["labels"], inputs["input_ids"]) and labels.shape == (3, 8)
    assert torch.isfinite(w.loss(w.model()(inputs), labels))


def test_bad_helper_input_is_one_line():
    with pytest.raises(WorkloadError, match="needs a transformers config"):
        hf_workload("gpt2")
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    with pytest.raises(WorkloadError, match="exceeds the config's 8 positions"):
        hf_workload(config, seq_len=32)
    with pytest.raises(WorkloadError, match="knows the labels of"):
        hf_workload(config, transformers.GPT2Model)
