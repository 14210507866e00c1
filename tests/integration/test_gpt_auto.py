"""`tunekit auto example:gpt` end to end on 2 gloo ranks (issue 17's done-when): every tuner
heard, the report by transformer block with the layers' GFLOP; `tunekit profile` lists the
transformer's layers with their FLOPs."""

import json

import pytest
from support import assert_every_tuner_heard_and_no_trial_crashed


@pytest.mark.slow
@pytest.mark.busy_ok  # it checks the pipeline end to end, not timings
@pytest.mark.timeout(900)
def test_auto_on_example_gpt_hears_every_tuner_and_reports_by_block(cli, workdir):
    # No candidate trials: a GPT step is ~0.5 s here, a batch tuner's candidate several seconds;
    # diagnoses, plans and the report are what this checks (trials are tested elsewhere). The
    # fewest measured steps (--steps 2): the blocks' FLOPs come from the traced graph.
    res = cli("auto", "example:gpt", "--nproc", "2", "--trials", "0", "--steps", "2",
              "--warmup", "1", "--no-probe", timeout=840)  # fmt: skip
    assert res.returncode == 0, res.stderr + res.stdout
    report = json.loads((workdir / "tunekit-out" / "report.json").read_text())
    # every tuner diagnosed the job: it applies, or it says why not
    assert_every_tuner_heard_and_no_trial_crashed(report)
    # by block: six blocks, each with its forward GFLOP, and the slowest layers' GFLOP
    blocks = {r["unit"]: r for r in report["observation"]["blocks"]}
    assert {f"blocks.{i}" for i in range(6)} <= set(blocks)
    assert all(blocks[f"blocks.{i}"]["flops"] > 0 for i in range(6))
    assert all(t["flops"] is not None for t in report["observation"]["top_layers"])
    md = (workdir / "tunekit-out" / "report.md").read_text()
    assert "## By transformer block" in md and "| blocks.5 |" in md

    prof = cli("profile", "example:gpt", "--nproc", "2", "--steps", "1", "--warmup", "1",
               "--top", "100", "--out", "prof", timeout=600)  # fmt: skip
    assert prof.returncode == 0, prof.stderr + prof.stdout
    profile = json.loads((workdir / "prof" / "profile.json").read_text())
    layers = profile["top_layers"]
    kinds = {t["kind"] for t in layers}
    assert {"embedding", "norm", "linear"} <= kinds, kinds
    attention = [t for t in layers if "_attn_" in t["name"]]
    mlp = [t for t in layers if "_mlp_" in t["name"]]
    assert attention and mlp, [t["name"] for t in layers]
    # attention's projections and the MLP count FLOPs (matmuls), LayerNorm its 5 per
    # element; an embedding is a lookup
    norms = [t for t in layers if t["kind"] == "norm"]
    assert all(t["flops"] > 0 for t in attention + mlp + norms)
    assert {f"blocks.{i}" for i in range(6)} <= {r["unit"] for r in profile["blocks"]}
    assert "by transformer block" in prof.stdout
