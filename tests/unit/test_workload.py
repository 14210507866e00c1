import math
import sys

import pytest
import torch
from support import WORKLOADS

from tunekit.errors import WorkloadError
from tunekit.examples import EXAMPLES
from tunekit.workload import Workload, load_workload, resolve_spec


def test_example_loads_and_trains_one_step():
    w = load_workload("example:cnn")
    assert w.name == "cnn" and w.batch_size == 32
    model = w.model()
    x, y = w.example_batch(4)
    loss = w.loss(model(x), y)
    loss.backward()
    assert loss.item() > 0
    assert all(p.grad is not None for p in model.parameters())


def test_file_and_module_specs_load(tmp_path):
    assert load_workload(f"{WORKLOADS}:tiny").name == "tiny"
    assert load_workload("tunekit.examples.cnn:workload").name == "cnn"


def test_file_spec_resolves_to_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(WORKLOADS.parent)
    spec = resolve_spec("workloads.py:tiny")
    assert spec == f"{WORKLOADS.resolve()}:tiny"
    assert resolve_spec("example:cnn") == "example:cnn"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("example:nope", "unknown example 'nope'"),
        ("missing_file.py:fn", "workload file missing_file.py not found"),
        ("no_such_module_xyz:fn", "no module named 'no_such_module_xyz'"),
        (f"{WORKLOADS}:absent", "has no function 'absent'"),
        (
            f"{WORKLOADS}:not_a_workload",
            "returned int, expected a tunekit.Workload (see docs/workloads.md)",
        ),
        (f"{WORKLOADS}:factory_fails", "raised ValueError: cannot build this workload"),
        ("just-a-name", "is not of the form"),
    ],
)
def test_bad_specs_fail_with_one_clear_line(spec, message):
    with pytest.raises(WorkloadError) as err:
        load_workload(spec)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_workload_validation():
    def batch(n, g):
        return torch.zeros(n, 1), torch.zeros(n, dtype=torch.long)

    with pytest.raises(WorkloadError, match="exactly one of make_batch and dataset"):
        Workload("w", model=lambda: torch.nn.Linear(1, 1))
    with pytest.raises(WorkloadError, match="batch_range"):
        Workload(
            "w",
            model=lambda: torch.nn.Linear(1, 1),
            make_batch=batch,
            batch_size=8,
            batch_range=(16, 32),
        )
    with pytest.raises(WorkloadError, match="lr_scaling"):
        Workload("w", model=lambda: torch.nn.Linear(1, 1), make_batch=batch, lr_scaling="cubic")


def test_lr_scaling_rules():
    def batch(n, g):
        return torch.zeros(n, 1), torch.zeros(n, dtype=torch.long)

    base = dict(model=lambda: torch.nn.Linear(1, 1), make_batch=batch, batch_size=32, lr=0.1)
    assert Workload("a", lr_scaling="linear", **base).scaled_lr(64) == pytest.approx(0.2)
    assert Workload("b", lr_scaling="sqrt", **base).scaled_lr(128) == pytest.approx(0.2)
    assert Workload("c", lr_scaling="none", **base).scaled_lr(128) == pytest.approx(0.1)


def test_every_listed_example_is_registered():
    assert set(EXAMPLES) == {
        "cnn",
        "alexnet",
        "vgg16",
        "inception_v3",
        "googlenet",
        "resnet152",
        "lstm",
        "gpt",
        "gpt-sharded",
        "vit",
        "hf-gpt2",
    }


@pytest.mark.parametrize("name", ["lstm", "googlenet", "gpt", "vit"])
def test_paper_examples_build_and_run_forward(name):
    w = load_workload(f"example:{name}")
    model = w.model()
    x, y = w.example_batch(2)
    assert torch.isfinite(w.loss(model(x), y))


def test_alexnet_parameter_count():
    model = load_workload("example:alexnet").model()
    assert sum(p.numel() for p in model.parameters()) == 61_100_840


def test_session_lr_composes_batch_and_data_parallel_degree(monkeypatch):
    """A model-parallel tuner that halves the data-parallel degree and a batch tuner compose."""
    from tunekit.runtime.session import Session
    from tunekit.runtime.sync import LocalSync

    # Bookkeeping only: no process group, so no DDP.
    monkeypatch.setattr(Session, "default_grad_sync", lambda self: LocalSync())
    w = load_workload(f"{WORKLOADS}:tiny")  # batch 8, lr 0.1, linear
    s = Session(w, world_size=4)
    s.set_data_parallel(2)  # 2 x 2 mesh: global batch 16 instead of 32
    assert s.global_batch == 16 and s.lr == pytest.approx(0.05)
    s.set_batch_size(32)  # a batch tuner after it: global 64 = 2x the workload's 32
    assert s.global_batch == 64 and s.lr == pytest.approx(0.2)
    assert all(g["lr"] == pytest.approx(0.2) for g in s.optimizer.param_groups)
    s.reset()
    assert (s.global_batch, s.lr) == (32, pytest.approx(0.1))


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_transformer_examples_train_as_people_train_them(name):
    w = load_workload(f"example:{name}")
    assert {"scheduler", "clipping"} <= w.features()
    assert isinstance(w.optimizer(w.model().parameters(), w.lr), torch.optim.AdamW)
    if name == "gpt":
        n = sum(p.numel() for p in w.model().parameters())
        assert 10e6 <= n <= 30e6
        x, y = w.example_batch(2)
        assert float(w.loss(w.model()(x), y)) == pytest.approx(
            math.log(8192), rel=0.05
        )  # initialised small


def test_a_file_that_extends_sys_path_keeps_its_entry_for_later_imports(tmp_path):
    # The file puts its own library folder first and imports from it only when the model
    # is built; the loader must take out its own entry, not whatever sits at index 0.
    lib = tmp_path / "mylib"
    lib.mkdir()
    (lib / "gptlib_issue32.py").write_text("from torch import nn\nWIDTH = 4\n")
    (tmp_path / "job.py").write_text(
        "from __future__ import annotations\n\nimport sys\nfrom dataclasses import dataclass\nfrom pathlib import Path\n\n"
        "import torch\nfrom tunekit import Workload\n\n"
        "sys.path.insert(0, str(Path(__file__).parent / 'mylib'))\n\n\n"
        "@dataclass\nclass Config:  # a dataclass in a workload file (nanoGPT's GPTConfig)\n"
        "    width: int = 4\n\n\n"
        "def model():\n    import gptlib_issue32\n\n"
        "    return gptlib_issue32.nn.Linear(Config().width, gptlib_issue32.WIDTH)\n\n\n"
        "def workload():\n    return Workload(name='lazy', model=model,\n"
        "        make_batch=lambda n, g: (torch.randn(n, 4, generator=g), torch.zeros(n).long()))\n"
    )
    before = list(sys.path)
    try:
        wl = load_workload(f"{tmp_path / 'job.py'}:workload")
        assert str(tmp_path) not in sys.path  # the loader's own entry is gone
        assert wl.model().out_features == 4  # and the file's is still there for this import
    finally:
        sys.path[:] = before
        sys.modules.pop("gptlib_issue32", None)
