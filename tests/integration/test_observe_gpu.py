"""Observation on a real NVIDIA GPU: CUDA memory per layer, a CUDA trace's breakdown, NVML, copies."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def test_layer_profile_uses_cuda_memory_statistics():
    from tunekit.examples import cnn
    from tunekit.observe.layer_profile import profile_layers

    w = cnn.workload()
    prof = profile_layers(w.model(), w.example_batch(32)[0], device="cuda", warmup=1, repeats=3)
    conv1 = prof.layers["_0"]
    assert conv1.memory_method == "cuda_memory"
    assert conv1.activation_bytes > 0 and conv1.peak_bytes >= conv1.activation_bytes
    assert all(t.forward_s > 0 for t in prof.layers.values())


def test_breakdown_of_a_real_cuda_trace(tmp_path):
    from torch.profiler import ProfilerActivity, profile, schedule

    from tunekit.examples import cnn
    from tunekit.observe.breakdown import analyze_rank, load_trace

    w = cnn.workload()
    model = w.model().cuda()
    opt = w.optimizer(model.parameters(), w.lr)
    x, y = (t.cuda() for t in w.example_batch(64))
    for _ in range(3):
        w.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts, schedule=schedule(wait=0, warmup=0, active=4)) as prof:
        for _ in range(3):
            w.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            prof.step()
    path = tmp_path / "rank0.json"
    prof.export_chrome_trace(str(path))
    rb = analyze_rank(load_trace(path), 0)
    assert rb.timeline == "gpu" and rb.steps_from == "markers" and len(rb.steps) == 3
    for s in rb.steps:
        assert s.parts_sum() == pytest.approx(s.total_s, rel=1e-9)
        assert s.compute_s > 0 and s.optimizer_s > 0


def test_nvml_samples_this_gpu():
    from tunekit.observe.telemetry import NvmlSource

    src = NvmlSource()
    assert src.available, src.notice
    s = src.sample({0: os.getpid()})
    assert "util_gpu_pct" in s["gpus"][0] and s["gpus"][0]["mem_total_bytes"] > 0
    assert src.static["topology"][0][0] == "X"
    src.close()


@pytest.mark.slow
def test_probe_measures_host_device_copies():
    from tunekit.observe.probe import probe_hardware

    res = probe_hardware(2, sizes=(2**16, 2**20, 2**24), repeats=2)
    ops = {s.op for s in res.sweeps}
    assert {"all_reduce", "p2p", "h2d", "d2h"} <= ops
    h2d = res.hardware.fit("h2d", 1)
    assert h2d is not None and h2d.bandwidth > 1e9
