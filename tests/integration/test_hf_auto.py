"""`tunekit auto example:hf-gpt2`: a Hugging Face model tuned end to end, every tuner heard."""

import json

import pytest
from support import assert_every_tuner_heard_and_no_trial_crashed

pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'tunekit[hf]')"
)


@pytest.mark.slow
@pytest.mark.busy_ok  # it checks the pipeline end to end, not timings
@pytest.mark.timeout(900)  # torch.export capture, a layer profile and 3+ torchrun trials on 2 ranks
def test_auto_tunes_hf_gpt2_with_all_five_tuners_diagnosing_it(cli, workdir):
    # One candidate slot: each costs two torchrun trials or more (a search and its baseline),
    # and every rank imports transformers. --min-effect 1: no leader to confirm (two more
    # trials); what a decision does with its trials is the demo study's to check. Short trials
    # and searches (--steps 4, --search-steps 8): what this checks is that every tuner hears
    # the model and none of its trials crashes, not the figures.
    res = cli(
        "auto", "example:hf-gpt2", "--nproc", "2", "--trials", "1", "--min-effect", "1",
        "--steps", "4", "--warmup", "1", "--search-steps", "8", "--no-probe", timeout=840,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr + res.stdout
    report = json.loads((workdir / "tunekit-out" / "report.json").read_text())
    graph = report["observation"]["graph"]
    assert graph["method"] == "export", graph
    assert_every_tuner_heard_and_no_trial_crashed(report)
