import math

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
