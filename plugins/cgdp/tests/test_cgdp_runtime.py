"""The executor on one rank (the host path with a trivial reduction): hooks, layout, offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tunekit.errors import PluginError
from tunekit.observe.blocks import block_of
from tunekit.plugins.cgdp.runtime import CgdpSync, HostBuffers, parameterised_layers
from tunekit.runtime.session import Session
from tunekit.runtime.sync import LocalSync
from tunekit.testing import tiny_gpt_workload
from tunekit.workload import Workload, load_workload

TINY = "tunekit.plugins.cgdp.tests.workloads_cgdp:tiny_bn"


def params_after(sync_factory, steps: int = 3, spec: str = TINY) -> list[torch.Tensor]:
    session = Session(load_workload(spec))
    if sync_factory is not None:
        session.set_grad_sync(sync_factory())
    for _ in range(steps):
        session.train_step()
    session.close()
    return [p.detach().clone() for p in session.model.parameters()]


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "cfg",
    [
        {"chunk_size": 1},
        {"chunk_size": 2},
        {"chunk_size": 9},
        {"chunk_size": 2, "offload_optimizer": True},
    ],
)
def test_one_rank_matches_local_training(cfg):
    reference = params_after(None)
    got = params_after(lambda: CgdpSync(**cfg))
    for a, b in zip(reference, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_layers_are_parameterised_modules_in_backward_order():
    session = Session(load_workload(TINY))
    sync = CgdpSync(chunk_size=2)
    session.set_grad_sync(sync)
    # conv(0), bn(1), linear(4), linear(5): 4 layers; l=4, k=2 -> {4,3}, {2}, {1}
    assert [layer.name for layer in sync.layers] == ["5", "4", "1", "0"]
    assert sync.layout() == [["5", "4"], ["1"], ["0"]]
    sync.set_chunk_size(3)
    assert sync.layout() == [["5", "4", "1"], ["0"]]
    sync.set_chunk_size(100)
    assert sync.layout() == [["5"], ["4"], ["1"], ["0"]]
    session.close()


def test_chunks_by_blocks_hold_whole_transformer_blocks():
    session = Session(tiny_gpt_workload())
    sync = CgdpSync(chunk_size=1, chunk_by="blocks")
    session.set_grad_sync(sync)
    layout = sync.layout()
    blocks = {b for chunk in layout for name in chunk if (b := block_of(name))}
    assert blocks == {"blocks.0", "blocks.1"}
    for block in blocks:  # each block in one chunk, alone
        (chunk,) = [c for c in layout if any(block_of(n) == block for n in c)]
        assert {block_of(n) for n in chunk} == {block}
    assert sync.num_layers == len(layout)  # the units the chunk size counts
    sync.set_chunk_size(2)
    assert all(len({block_of(n) for n in c if block_of(n)}) <= 2 for c in sync.layout())
    assert len(sync.layout()) < len(layout)
    session.train_step()
    session.close()
    # a model without blocks chunks by layers, whatever chunk_by says
    session = Session(load_workload(TINY))
    sync = CgdpSync(chunk_size=2, chunk_by="blocks")
    session.set_grad_sync(sync)
    assert sync.layout() == [["5", "4"], ["1"], ["0"]]
    session.close()
    with pytest.raises(PluginError, match="chunk_by"):
        CgdpSync(chunk_by="heads")


def test_records_one_communication_per_chunk_each_step():
    session = Session(load_workload(TINY))
    session.set_grad_sync(CgdpSync(chunk_size=2))
    for _ in range(3):
        rec = session.train_step()
        comm = rec.metrics["comm"]
        assert [c["name"] for c in comm] == ["chunk0", "chunk1", "chunk2"]
        total = sum(p.numel() * 4 for p in session.model.parameters())
        assert sum(c["nbytes"] for c in comm) == total
        assert all(c["own_s"] >= 0 and c["blocked_s"] >= 0 for c in comm)
        assert rec.metrics["overlap_R"] is not None
    session.close()


def test_detach_removes_every_hook():
    session = Session(load_workload(TINY))
    sync = CgdpSync()
    session.set_grad_sync(sync)
    session.train_step()
    inputs, targets = session.data.batch(0)
    # With the hooks installed, a second backward before a step is refused ...
    for _ in range(2):
        loss = session.workload.loss(session.model(inputs), targets)
        if _ == 0:
            loss.backward()
        else:
            with pytest.raises(RuntimeError, match="accumulated twice"):
                loss.backward()
    session.optimizer.zero_grad(set_to_none=True)
    session.set_grad_sync(LocalSync())
    # ... and once detached, nothing of CGDP runs any more.
    for _ in range(2):
        session.workload.loss(session.model(inputs), targets).backward()
    assert all(not p._post_accumulate_grad_hooks for p in session.model.parameters())
    session.close()


@pytest.mark.equivalence
def test_observed_backward_order_replaces_registration_order():
    class Backwards(nn.Module):
        def __init__(self):
            super().__init__()
            self.late = nn.Linear(4, 2)  # registered first, runs last
            self.early = nn.Linear(4, 4)

        def forward(self, x):
            return self.late(torch.relu(self.early(x)))

    def batch(n, gen):
        return torch.randn(n, 4, generator=gen), torch.randint(2, (n,), generator=gen)

    session = Session(Workload(name="backwards", model=Backwards, make_batch=batch, batch_size=4))
    sync = CgdpSync(chunk_size=1)
    session.set_grad_sync(sync)
    assert [layer.name for layer in sync.layers] == ["early", "late"]  # the registration guess
    session.train_step()
    assert [layer.name for layer in sync.layers] == ["late", "early"]  # as backward ran
    reference = Session(Workload(name="backwards", model=Backwards, make_batch=batch, batch_size=4))
    reference.train_step()
    for _ in range(3):
        session.train_step()
        reference.train_step()
    for a, b in zip(reference.model.parameters(), session.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    session.close()


@pytest.mark.equivalence
def test_offload_keeps_state_on_the_host_and_gives_it_back():
    spec = TINY
    reference = Session(load_workload(spec))
    for _ in range(6):
        reference.train_step()

    session = Session(load_workload(spec))
    for _ in range(2):
        session.train_step()
    sync = CgdpSync(chunk_size=2, offload_optimizer=True)
    session.set_grad_sync(sync)
    for _ in range(2):
        session.train_step()
    report = sync.memory_report()
    state_bytes = sum(p.numel() * 4 for p in session.model.parameters())  # one momentum buffer each
    assert report["host_optimizer_state_bytes"] == state_bytes
    assert report["host_master_param_bytes"] == state_bytes
    # checkpoints taken meanwhile see the host state
    saved = session.state_dict()["optimizer"]["state"]
    assert sum(v["momentum_buffer"].numel() * 4 for v in saved.values()) == state_bytes
    session.set_lr(session.lr * 1.0)  # hyperparameters follow the session optimizer
    session.reset()  # back to local training: state returns to the session optimizer
    assert len(session.optimizer.state) == len(list(session.model.parameters()))
    for _ in range(2):
        session.train_step()
    for a, b in zip(reference.model.parameters(), session.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.equivalence
def test_offload_follows_learning_rate_changes():
    a, b = Session(load_workload(TINY)), Session(load_workload(TINY))
    b.set_grad_sync(CgdpSync(offload_optimizer=True))
    for s in (a, b):
        s.set_lr(0.2)
        for _ in range(2):
            s.train_step()
    for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_host_buffers_group_dtypes_into_contiguous_chunk_slices():
    params = [
        nn.Parameter(torch.zeros(3)),
        nn.Parameter(torch.zeros(2, dtype=torch.float64)),
        nn.Parameter(torch.zeros(4)),
    ]
    buf = HostBuffers(params, pin=False)
    assert buf.nbytes == 7 * 4 + 2 * 8
    slices = buf.slices(0, 3)
    assert sorted(s.numel() for s in slices) == [2, 7]
    buf.view(2, torch.Size([2, 2])).fill_(1.0)
    assert buf.flat[torch.float32][3:].sum() == 4


def test_shared_parameters_belong_to_their_first_layer():
    a = nn.Linear(3, 3)
    b = nn.Linear(3, 3)
    b.weight = a.weight
    layers = parameterised_layers(nn.Sequential(a, b))
    assert [len(layer.params) for layer in layers] == [2, 1]


def test_bad_chunk_size_is_one_clear_error():
    with pytest.raises(PluginError, match="chunk_size"):
        CgdpSync(chunk_size=0)


def test_a_failed_attach_leaves_no_hooks_behind():
    class Frozen(torch.optim.SGD):
        """An optimizer that cannot be rebuilt from its param groups alone."""

        def __init__(self, params, lr, secret):
            super().__init__(params, lr=lr)

    work = load_workload(TINY)
    work.optimizer = lambda params, lr: Frozen(params, lr, secret=1)
    session = Session(work)
    with pytest.raises(PluginError, match="cannot rebuild Frozen"):
        session.set_grad_sync(CgdpSync(offload_optimizer=True))
    assert all(not p._post_accumulate_grad_hooks for p in session.model.parameters())
