"""The CUDA path: pinned host buffers, D2H/H2D side streams, the communication thread.

Skipped without CUDA. Two ranks share one GPU through gloo, so one GPU is enough.
"""

from __future__ import annotations

import pytest
import torch

from tunekit.plugins.cgdp.runtime import CgdpSync
from tunekit.plugins.cgdp.tests.ranks_cgdp import train_params_many
from tunekit.runtime.session import Session
from tunekit.testing import assert_states_close, default_dtype, run_ranks
from tunekit.workload import load_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TINY = "tunekit.plugins.cgdp.tests.workloads_cgdp:tiny_bn"
WIDE = "tunekit.plugins.cgdp.tests.workloads_cgdp:wide"
CUDA = "cuda:0"
# Equivalence runs in float64 (see tunekit.testing.EQUIVALENCE_RTOL): GPU kernels
# sum in an order of their own (atomics, cuDNN's algorithm choice) from run to run.
F64 = torch.float64


def params_after(spec: str, sync_factory, steps: int = 4) -> list[torch.Tensor]:
    session = Session(load_workload(spec), device=torch.device(CUDA))
    if sync_factory is not None:
        session.set_grad_sync(sync_factory())
    for _ in range(steps):
        session.train_step()
    session.close()
    return [p.detach().cpu() for p in session.model.parameters()]


@pytest.mark.parametrize(
    "cfg", [{"chunk_size": 1}, {"chunk_size": 3}, {"chunk_size": 2, "offload_optimizer": True}]
)
def test_stream_path_matches_local_training(cfg):
    with default_dtype(F64):
        reference = params_after(WIDE, None)
        got = params_after(WIDE, lambda: CgdpSync(**cfg))
    assert_states_close(got, reference, f"CGDP {cfg} vs local training")


def test_buffers_are_pinned_and_streams_are_separate():
    session = Session(load_workload(TINY), device=torch.device(CUDA))
    sync = CgdpSync(chunk_size=2)
    session.set_grad_sync(sync)
    rec = session.train_step()
    assert all(t.is_pinned() for t in sync.buffers.flat.values())
    compute = torch.cuda.current_stream(sync.device)
    assert sync._d2h != compute and sync._h2d != compute and sync._d2h != sync._h2d
    assert sync._thread is not None and sync._thread.is_alive()
    assert len(rec.metrics["comm"]) == len(sync.chunks)
    assert sync.memory_report()["device_peak_bytes"] > 0
    session.close()
    assert sync._thread is None  # detach stopped the communication thread


def test_offload_frees_device_gradients_during_backward():
    session = Session(load_workload(WIDE), device=torch.device(CUDA))
    sync = CgdpSync(chunk_size=1, offload_optimizer=True)
    session.set_grad_sync(sync)
    session.train_step()
    inputs, targets = session.data.batch(1)
    session.workload.loss(session.model(inputs), targets).backward()
    assert all(p.grad is None for p in session.model.parameters())  # copied out, then freed
    sync.step(session.optimizer)
    assert all(
        not st or all(v.device.type == "cpu" for v in st.values() if torch.is_tensor(v))
        for st in session.optimizer.state.values()
    )
    session.close()


def peak_bytes(spec: str, sync_factory, steps: int = 3) -> int:
    session = Session(load_workload(spec), device=torch.device(CUDA))
    if sync_factory is not None:
        session.set_grad_sync(sync_factory())
    session.train_step()  # optimizer state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        session.train_step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    session.close()
    del session
    torch.cuda.empty_cache()
    return peak


def test_offload_lowers_peak_device_memory_by_at_least_the_optimizer_state():
    param_bytes = sum(p.numel() * 4 for p in load_workload(WIDE).model().parameters())
    plain = peak_bytes(WIDE, lambda: CgdpSync(chunk_size=1))
    offload = peak_bytes(WIDE, lambda: CgdpSync(chunk_size=1, offload_optimizer=True))
    assert plain - offload >= param_bytes  # momentum buffers (one per parameter) left the device


@pytest.mark.slow
def test_two_ranks_on_one_gpu_match_ddp():
    jobs = [
        (
            WIDE,
            [{"chunk_size": 1}, {"chunk_size": 2}, {"chunk_size": 2, "offload_optimizer": True}],
            3,
        )
    ]
    r0, r1 = run_ranks(train_params_many, 2, (jobs, CUDA), dtype=F64)
    for label in [k for k in r0[0] if k.startswith("cgdp") and ":" not in k]:
        assert_states_close(r0[0][label], r0[0]["ddp"], f"{label} vs DDP")
        assert_states_close(r0[0][label], r1[0][label], f"{label} replicas")
