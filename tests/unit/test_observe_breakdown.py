"""Step breakdown from Chrome traces: committed real gloo traces and hand-made CPU/CUDA ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tunekit.observe.breakdown import (
    PARTS,
    Breakdown,
    CollectiveTiming,
    analyze_rank,
    analyze_trial,
    load_trace,
    overlap_ratio,
)

TRACES = Path(__file__).parents[1] / "data" / "traces"


def _x(name, ts, dur, tid=100, pid=100, cat="cpu_op", **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def test_lee_eq11_worked_number():
    # NOTES.md, overlap_chunking: T_c = {4, 2}, T_b = {1, 0} -> R = 83.3
    r = overlap_ratio([CollectiveTiming("a", 0, 4, 1), CollectiveTiming("b", 0, 2, 0)])
    assert r == pytest.approx(83.333, abs=1e-3)
    assert overlap_ratio([]) is None


def cpu_trace() -> dict:
    """Two steps of a gloo rank, times in microseconds (worked out in the test below)."""
    ev = [
        {
            "ph": "M",
            "name": "thread_name",
            "pid": 100,
            "tid": 101,
            "args": {"name": "pt_gloo_runloop"},
        },
        _x("ProfilerStep#0", 0, 100, cat="user_annotation"),
        _x("tunekit.data", 0, 10, cat="user_annotation"),
        _x("DistributedDataParallel.forward", 10, 20, cat="user_annotation"),
        _x("aten::conv2d", 10, 20),
        _x("autograd::engine::evaluate_function: ConvolutionBackward0", 30, 14),
        _x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 44, 6),
        _x("c10d::allreduce_", 45, 3),  # posting the bucket, nested in AccumulateGrad
        _x("gloo:all_reduce", 46, 29, tid=101, cat="user_annotation"),
        # 50..75: the main thread waits for the bucket
        _x("Optimizer.step#SGD.step", 75, 10, cat="user_annotation"),
        _x("Optimizer.zero_grad#SGD.zero_grad", 85, 3, cat="user_annotation"),
        _x("aten::item", 88, 1),
        # step 2: the all-reduce hides entirely behind backward
        _x("ProfilerStep#1", 100, 100, cat="user_annotation"),
        _x("tunekit.data", 100, 5, cat="user_annotation"),
        _x("DistributedDataParallel.forward", 105, 45, cat="user_annotation"),
        _x("aten::conv2d", 105, 40),  # 145..150: Python between ops inside forward -> idle
        _x("autograd::engine::evaluate_function: ConvolutionBackward0", 150, 40),
        _x("c10d::allreduce_", 158, 1),
        _x("gloo:all_reduce", 160, 20, tid=101, cat="user_annotation"),
        _x("Optimizer.step#SGD.step", 190, 5, cat="user_annotation"),
        _x("ProfilerStep#2", 200, 0, cat="user_annotation"),  # opened by the last step()
    ]
    return {"traceEvents": ev, "distributedInfo": {"rank": 0, "backend": "gloo"}}


def test_handmade_cpu_trace_parts_and_overlap():
    rb = analyze_rank(load_trace(cpu_trace()))
    assert rb.timeline == "cpu" and rb.steps_from == "markers"
    assert len(rb.steps) == 2  # the empty trailing ProfilerStep is dropped
    s0, s1 = rb.steps
    us = 1e-6
    assert s0.total_s == pytest.approx(100 * us)
    assert s0.compute_s == pytest.approx(38 * us)  # 20 fwd + 14 bwd + 3 accumulate + 1 item
    assert s0.comm_exposed_s == pytest.approx(28 * us)  # 3 posting + 25 waiting
    assert s0.data_s == pytest.approx(10 * us)
    assert s0.optimizer_s == pytest.approx(13 * us)
    assert s0.idle_s == pytest.approx(11 * us)
    assert s0.comm_total_s == pytest.approx(29 * us)
    (c,) = s0.collectives
    assert (c.own_s, c.blocked_s) == (pytest.approx(29 * us), pytest.approx(25 * us))
    assert s0.overlap_R == pytest.approx(100 * 4 / 29)
    assert s1.compute_s == pytest.approx(79 * us)
    assert s1.comm_exposed_s == pytest.approx(1 * us)
    assert (s1.data_s, s1.optimizer_s, s1.idle_s) == (
        pytest.approx(5 * us),
        pytest.approx(5 * us),
        pytest.approx(10 * us),
    )
    assert s1.overlap_R == pytest.approx(100.0)
    assert rb.overlap_R == pytest.approx(100 * (4 + 20) / 49)
    for s in rb.steps:
        assert s.parts_sum() == pytest.approx(s.total_s)


def cuda_trace() -> dict:
    """One step of an NCCL rank: CPU launches, kernels on two streams of GPU 0."""
    cpu, gpu = 200, 0
    ev = [
        _x("ProfilerStep#0", 0, 100, tid=cpu, pid=cpu, cat="user_annotation"),
        _x("tunekit.data", 0, 20, tid=cpu, pid=cpu, cat="user_annotation"),
        _x("cudaMemcpyAsync", 15, 1, tid=cpu, pid=cpu, cat="cuda_runtime", correlation=1),
        _x("DistributedDataParallel.forward", 20, 20, tid=cpu, pid=cpu, cat="user_annotation"),
        _x("cudaLaunchKernel", 21, 1, tid=cpu, pid=cpu, cat="cuda_runtime", correlation=2),
        _x("cudaLaunchKernel", 25, 1, tid=cpu, pid=cpu, cat="cuda_runtime", correlation=3),
        _x("nccl:all_reduce", 41, 1, tid=cpu, pid=cpu, cat="user_annotation"),
        _x("cudaLaunchKernel", 41, 1, tid=cpu, pid=cpu, cat="cuda_runtime", correlation=4),
        _x("Optimizer.step#SGD.step", 80, 10, tid=cpu, pid=cpu, cat="user_annotation"),
        _x("cudaLaunchKernel", 81, 1, tid=cpu, pid=cpu, cat="cuda_runtime", correlation=5),
        _x(
            "Memcpy HtoD (Pinned -> Device)", 16, 6, tid=7, pid=gpu, cat="gpu_memcpy", correlation=1
        ),
        _x("volta_sgemm_128x64_nn", 22, 18, tid=7, pid=gpu, cat="kernel", correlation=2),
        _x("cudnn_convolution_bwd", 40, 20, tid=7, pid=gpu, cat="kernel", correlation=3),
        _x(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
            45,
            30,
            tid=20,
            pid=gpu,
            cat="kernel",
            correlation=4,
        ),
        _x("multi_tensor_apply_kernel", 82, 6, tid=7, pid=gpu, cat="kernel", correlation=5),
    ]
    return {"traceEvents": ev, "distributedInfo": {"rank": 3, "backend": "nccl"}}


def test_handmade_cuda_trace_uses_the_gpu_timeline():
    rb = analyze_rank(load_trace(cuda_trace()))
    assert rb.timeline == "gpu" and rb.rank == 3
    (s,) = rb.steps
    us = 1e-6
    assert s.data_s == pytest.approx(22 * us)  # GPU idle while the CPU loads, then the H2D copy
    assert s.compute_s == pytest.approx(38 * us)
    assert s.comm_exposed_s == pytest.approx(15 * us)  # NCCL 45..75, compute hides 45..60
    assert s.optimizer_s == pytest.approx(10 * us)  # its kernel plus the CPU around it
    assert s.idle_s == pytest.approx(15 * us)
    assert s.comm_total_s == pytest.approx(30 * us)
    assert s.overlap_R == pytest.approx(50.0)
    assert s.parts_sum() == pytest.approx(s.total_s)


@pytest.mark.parametrize("run", ["cnn_gloo_2rank", "cnn_gloo_2rank_marked"])
def test_real_gloo_traces_sum_to_the_measured_step_time(run):
    """Committed 2-rank gloo traces of example:cnn (tests/data/traces/make_traces.py)."""
    bd = analyze_trial(TRACES / run)
    assert [r.rank for r in bd.ranks] == [0, 1]
    for rb in bd.ranks:
        assert rb.timeline == "cpu"
        assert rb.steps_from == ("markers" if run.endswith("marked") else "forward+data_s")
        assert len(rb.steps) == len(rb.measured_step_s) == 3
        for step, measured in zip(rb.steps, rb.measured_step_s, strict=True):
            assert step.parts_sum() == pytest.approx(step.total_s, rel=1e-9)
            assert step.parts_sum() == pytest.approx(measured, rel=0.05)
            assert step.compute_s > 0 and step.data_s > 0 and step.optimizer_s > 0
            assert step.comm_total_s > 0 and step.collectives  # DDP buckets on gloo
            assert 0 <= step.overlap_R <= 100
            for c in step.collectives:
                assert c.name == "gloo:all_reduce" and 0 <= c.blocked_s <= c.own_s
        if rb.steps_from == "forward+data_s":  # the lead-in to each forward is the data time
            measured_data = json.loads((TRACES / run / f"rank{rb.rank}.json").read_text())["data_s"]
            assert [s.data_s for s in rb.steps] == pytest.approx(measured_data, rel=1e-6)
    summary = bd.summary()
    assert summary["total_s"] == pytest.approx(summary["measured_step_s"], rel=0.05)
    assert sum(summary["fractions"][p] for p in PARTS) == pytest.approx(1.0)


def test_breakdown_round_trips_through_json():
    bd = analyze_trial(TRACES / "cnn_gloo_2rank")
    again = Breakdown.from_dict(json.loads(json.dumps(bd.to_dict())))
    assert again == bd
    assert again.summary() == bd.summary()


def test_without_markers_or_data_times_the_window_is_one_block(tmp_path):
    trial = tmp_path / "trial"
    shutil.copytree(TRACES / "cnn_gloo_2rank" / "traces", trial / "traces")
    bd = analyze_trial(trial)  # no rank<R>.json: no measured data time
    for rb in bd.ranks:
        assert rb.steps_from == "window" and len(rb.steps) == 1
        assert rb.steps[0].parts_sum() == pytest.approx(rb.steps[0].total_s)


def test_missing_traces_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no traces"):
        analyze_trial(tmp_path)
