"""docs/workloads.md's examples run as written: each is a file `tunekit auto FILE.py:workload` takes."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
from support import rank_train_params

from tunekit.runtime.dist import single_rank_group
from tunekit.runtime.session import Session
from tunekit.testing import run_ranks
from tunekit.workload import load_workload

DOC = Path(__file__).resolve().parents[2] / "docs" / "workloads.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_its_six_examples():
    blocks = [b for b in examples() if "def workload" in b]
    assert len(blocks) == 6


@pytest.mark.parametrize("index", range(6))
def test_each_example_loads_and_trains(tmp_path, index):
    code = [b for b in examples() if "def workload" in b][index]
    if "transformers" in code:
        pytest.importorskip("transformers", reason="the Hugging Face example needs tunekit[hf]")
    path = tmp_path / f"example{index}.py"
    path.write_text(code)
    w = load_workload(f"{path}:workload")
    with single_rank_group():  # FSDP shards over a group, even of one rank
        session = Session(w)
        losses = [session.train_step().loss for _ in range(4)]
        if w.sharding == "fsdp":
            assert session.grad_sync.name == "fsdp" and session.checkpointed == [
                "blocks.0",
                "blocks.2",
            ]
        session.close()
    assert all(math.isfinite(x) for x in losses)


@pytest.mark.slow
@pytest.mark.busy_ok  # it checks that training runs, not how fast
def test_the_transformer_example_trains_on_two_ranks_with_its_features(tmp_path):
    code = next(b for b in examples() if "TinyLM" in b)
    path = tmp_path / "tiny_lm.py"
    path.write_text(code)
    w = load_workload(f"{path}:workload")
    assert w.features() == {"amp", "accumulation", "scheduler", "clipping"}
    r0, r1 = run_ranks(rank_train_params, 2, (f"{path}:workload", 3))
    assert all(math.isfinite(x) for x in r0["losses"] + r1["losses"])
    assert all(r0["params"][n].equal(r1["params"][n]) for n in r0["params"])  # replicas agree


def test_the_prepare_example_trains_the_gpt_example_in_its_own_loop(tmp_path, monkeypatch, capsys):
    """The "Your own training loop" script, beside the nanoGPT-style workload it imports
    (saved as gpt_job.py, as the page says), under a config that doubles the batch."""
    job = next(b for b in examples() if "class GPTWithLoss" in b)
    train = next(b for b in examples() if "tunekit.prepare(" in b)
    (tmp_path / "gpt_job.py").write_text(job)
    config = {"plugins": {"batch_ps_sizing": {"batch_size": 16}}}
    (tmp_path / "best_config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        exec(compile(train, "train.py", "exec"), {"__name__": "__main__"})
    finally:
        sys.modules.pop("gpt_job", None)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["step 0", "step 10"]
    first, last = (float(line.rsplit(" ", 1)[1]) for line in printed)
    assert math.isfinite(first) and last < first  # it learns
    assert (tmp_path / "ckpt.pt").is_file()
