"""docs/workloads.md's examples run as written: each is a file `tunekit auto FILE.py:workload` takes."""

from __future__ import annotations

import math
import re
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


def test_the_doc_has_its_five_examples():
    blocks = [b for b in examples() if "def workload" in b]
    assert len(blocks) == 5


@pytest.mark.parametrize("index", range(5))
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
