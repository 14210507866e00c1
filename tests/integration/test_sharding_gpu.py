"""A sharded, checkpointed, bf16 job on a GPU (skipped without one): FSDP2 with a mixed-precision
policy on CUDA, its peaks from CUDA's allocator, CPU offload that moves the shards off the
device, and the memory cap failing a step as out of memory."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from tunekit.layout import Layout
from tunekit.observe.memory import MemoryCapExceeded
from tunekit.runtime.dist import single_rank_group
from tunekit.runtime.session import Session
from tunekit.trials.exits import is_oom
from tunekit.workload import load_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _session(layout: Layout, **kw) -> Session:
    w = replace(load_workload("example:gpt-sharded"), precision="bf16")
    nccl = torch.distributed.new_group(backend="nccl")  # FSDP gathers CUDA tensors
    return Session(w, device=torch.device("cuda", 0), group=nccl, layout=layout, **kw)


def test_fsdp_with_bf16_checkpointing_and_offload_on_a_gpu():
    with single_rank_group():
        peaks = {}
        for name, layout in {
            "ddp": Layout(),
            "fsdp": Layout(sharding="fsdp", checkpointing="full"),
            "offload": Layout(sharding="fsdp", checkpointing="full", cpu_offload=True),
        }.items():
            torch.cuda.empty_cache()
            s = _session(layout)
            losses = [s.train_step() for _ in range(3)]
            assert all(torch.isfinite(torch.tensor(r.loss)) for r in losses)
            assert s.memory.method == "cuda-allocator"
            peaks[name] = max(r.metrics["peak_bytes"] for r in losses)
            if layout.sharded:
                p = next(s.model.parameters())
                expected = "cpu" if layout.cpu_offload else "cuda"
                assert p.to_local().device.type == expected, (name, p.device)
            s.close()
            del s
            gc.collect()  # a session and its strategy refer to each other
        # Checkpointing frees activations; offload takes the shards and optimizer state away.
        assert peaks["fsdp"] < peaks["ddp"] and peaks["offload"] < peaks["fsdp"], peaks


def test_a_step_over_the_cap_is_out_of_memory_on_a_gpu():
    with single_rank_group():
        probe = _session(Layout(sharding="fsdp"))
        peak = max(probe.train_step().metrics["peak_bytes"] for _ in range(2))
        probe.close()
        del probe
        gc.collect()
        torch.cuda.empty_cache()
        tight = _session(Layout(sharding="fsdp"), memory_cap_bytes=int(peak * 0.5))
        with pytest.raises(MemoryCapExceeded) as err:
            tight.train_step()
        assert is_oom(err.value)
