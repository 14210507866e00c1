"""Telemetry: NVML through a fake pynvml at the module boundary; host and py-spy on real children."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import types
from collections import namedtuple

import pytest

from tunekit.observe.telemetry import (
    HostSource,
    NvmlSource,
    PySpySource,
    TelemetrySampler,
    TimeSeries,
    classify,
    find_pyspy,
    read_pid_dir,
    summarize_pyspy,
)

# -- a fake pynvml -------------------------------------------------------------------------------

Memory = namedtuple("Memory", "total used free")
Util = namedtuple("Util", "gpu memory")
Proc = namedtuple("Proc", "pid usedGpuMemory")


class NVMLError(Exception):
    pass


def fake_pynvml(proc_pids: dict[int, list[tuple[int, int]]], power_supported: bool = True):
    """Three GPUs: 0 and 1 joined by two NVLinks, 2 on PCIe (no NVLink, no P2P)."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 1, 2
    m.NVML_PCIE_UTIL_TX_BYTES, m.NVML_PCIE_UTIL_RX_BYTES = 0, 1
    m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, m.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
    m.NVML_P2P_CAPS_INDEX_READ = (0,)  # as some nvidia-ml-py releases define it
    m.NVML_P2P_STATUS_OK = 0
    m.NVML_NVLINK_MAX_LINKS = 6
    m.NVML_FEATURE_ENABLED = 1
    m.calls = {"init": 0, "shutdown": 0, "fields": 0}
    handles = ["gpu0", "gpu1", "gpu2"]
    bus = {h: f"00000000:0{i}:00.0".encode() for i, h in enumerate(handles)}

    def idx(h):
        return handles.index(h)

    m.nvmlInit = lambda: m.calls.__setitem__("init", m.calls["init"] + 1)
    m.nvmlShutdown = lambda: m.calls.__setitem__("shutdown", m.calls["shutdown"] + 1)
    m.nvmlDeviceGetCount = lambda: 3
    m.nvmlDeviceGetHandleByIndex = lambda i: handles[i]
    m.nvmlSystemGetDriverVersion = lambda: b"535.104.05"
    m.nvmlDeviceGetName = lambda h: b"Tesla V100-SXM2-16GB"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=bus[h])
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 3
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetMemoryInfo = lambda h: Memory(16 * 2**30, (idx(h) + 1) * 2**30, 0)
    m.nvmlDeviceGetUtilizationRates = lambda h: Util(50 + 10 * idx(h), 20)

    def power(h):
        if not power_supported:
            raise NVMLError("Not Supported")
        return 150_000 + 1000 * idx(h)  # milliwatts

    m.nvmlDeviceGetPowerUsage = power
    m.nvmlDeviceGetClockInfo = lambda h, kind: 1530 if kind == 1 else 877
    m.nvmlDeviceGetPcieThroughput = lambda h, c: 1000 if c == 0 else 2000  # KB/s

    def nvlink_state(h, link):
        if idx(h) == 2 or link >= 2:
            raise NVMLError("Not Supported")
        return 1

    m.nvmlDeviceGetNvLinkState = nvlink_state
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(
        busId=bus[handles[1 - idx(h)]]
    )
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 30  # host bridge

    def p2p(a, b, index):
        assert index == 0
        return 0 if {idx(a), idx(b)} == {0, 1} else 1

    m.nvmlDeviceGetP2PStatus = p2p

    def fields(h, ids):
        m.calls["fields"] += 1
        assert [scope for _, scope in ids] == [0xFFFFFFFF] * 2
        return [
            types.SimpleNamespace(
                nvmlReturn=0 if idx(h) < 2 else 3,
                value=types.SimpleNamespace(ullVal=1000 * m.calls["fields"]),
            )
            for _ in ids
        ]

    m.nvmlDeviceGetFieldValues = fields
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        Proc(pid, mem) for pid, mem in proc_pids.get(idx(h), [])
    ]
    return m


def test_nvml_sampler_reads_every_metric_through_pynvml(monkeypatch):
    fake = fake_pynvml({0: [(111, 3 * 2**30), (999, 2**30)], 1: [(222, 2**30)]})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    src = NvmlSource()
    assert src.available and src.notice == ""
    st = src.static
    assert st["driver"] == "535.104.05"
    assert [d["name"] for d in st["devices"]] == ["Tesla V100-SXM2-16GB"] * 3
    assert (
        st["devices"][0]["pcie_gen"] == 3 and st["devices"][0]["memory_total_bytes"] == 16 * 2**30
    )
    assert st["topology"] == [["X", "NV2", "PHB"], ["NV2", "X", "PHB"], ["PHB", "PHB", "X"]]
    assert st["p2p"] == [["X", "OK", "NS"], ["OK", "X", "NS"], ["NS", "NS", "X"]]

    s = src.sample({0: 111, 1: 222})
    g0, g1, g2 = s["gpus"]
    assert g0["util_gpu_pct"] == 50 and g1["util_gpu_pct"] == 60
    assert g0["mem_used_bytes"] == 2**30 and g0["mem_total_bytes"] == 16 * 2**30
    assert g2["power_w"] == pytest.approx(152.0)
    assert (g0["sm_clock_mhz"], g0["mem_clock_mhz"]) == (1530, 877)
    assert (g0["pcie_tx_bytes_s"], g0["pcie_rx_bytes_s"]) == (1000 * 1024, 2000 * 1024)
    assert g0["nvlink_tx_bytes"] == g0["nvlink_rx_bytes"] == 1000 * 1024
    assert "nvlink_tx_bytes" not in g2  # the field returned an error for that GPU
    # Per-process memory mapped to ranks by pid; pid 999 is no rank of ours.
    assert s["ranks"] == {
        "0": {"pid": 111, "gpus": {"0": 3 * 2**30}},
        "1": {"pid": 222, "gpus": {"1": 2**30}},
    }
    src.close()
    assert fake.calls == {"init": 1, "shutdown": 1, "fields": 3}


def test_nvml_unsupported_metric_is_skipped_not_fatal(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({}, power_supported=False))
    src = NvmlSource()
    s = src.sample({})
    assert all("power_w" not in g for g in s["gpus"])
    assert "power" in src.unsupported()
    assert all("util_gpu_pct" in g for g in s["gpus"])


def test_no_driver_or_no_pynvml_is_one_notice(monkeypatch):
    broken = types.ModuleType("pynvml")

    def init():
        raise NVMLError("NVML Shared Library Not Found")

    broken.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    src = NvmlSource()
    assert not src.available
    assert (
        src.notice == "no NVIDIA GPU or driver (NVML Shared Library Not Found); host metrics only"
    )
    assert src.sample({0: 1}) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    src = NvmlSource()
    assert not src.available and "pynvml not importable" in src.notice


def test_nvml_summary_over_samples(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({0: [(111, 2**30)]}))
    with TelemetrySampler({0: 111}, interval_s=0.05, host=False, pyspy=False) as sampler:
        time.sleep(0.3)
    summary = sampler.summary()
    assert sampler.notices == []
    g0 = summary["nvml"]["gpus"]["0"]
    assert g0["util_gpu_pct_mean"] == 50 and g0["mem_used_bytes_max"] == 2**30
    assert g0["nvlink_tx_bytes_per_s"] > 0  # cumulative counters become a rate
    assert summary["nvml"]["rank_gpu_memory_max_bytes"] == {"0": 2**30}
    assert sampler.static()["nvml"]["topology"][0][1] == "NV2"
    json.dumps(sampler.to_dict())


# -- host, on real processes -----------------------------------------------------------------------

BUSY = "import time\nt = time.time()\nwhile time.time() - t < {secs}: sum(range(1000))\n"


@pytest.fixture
def busy_children():
    procs = [subprocess.Popen([sys.executable, "-c", BUSY.format(secs=20)]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_host_sampler_on_real_child_processes(busy_children):
    src = HostSource()
    pids = {r: p.pid for r, p in enumerate(busy_children)}
    first = src.sample(pids)
    assert set(first["ranks"]) == {"0", "1"}
    assert first["ranks"]["0"]["cpu_pct"] is None  # the first reading only starts the counter
    time.sleep(0.5)
    second = src.sample(pids)
    for r in ("0", "1"):
        assert second["ranks"][r]["pid"] == pids[int(r)]
        assert second["ranks"][r]["cpu_pct"] > 5  # a busy loop (on a shared 2-core machine)
        assert second["ranks"][r]["rss_bytes"] > 1_000_000
    assert 0 < second["system"]["mem_used_bytes"] <= second["system"]["mem_total_bytes"]
    busy_children[1].kill()
    busy_children[1].wait()
    third = src.sample(pids)
    assert set(third["ranks"]) == {"0"}  # a rank that exited disappears, no error


def test_sampler_reads_pids_from_a_trial_directory(tmp_path, busy_children, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    (tmp_path / "pids").mkdir()
    for r, p in enumerate(busy_children):
        (tmp_path / "pids" / f"rank{r}").write_text(str(p.pid))
    (tmp_path / "pids" / "rankX").write_text("junk")
    assert read_pid_dir(tmp_path) == {0: busy_children[0].pid, 1: busy_children[1].pid}
    with TelemetrySampler(tmp_path, interval_s=0.1, pyspy=False) as sampler:
        time.sleep(0.8)
    assert len(sampler.notices) == 1 and "host metrics only" in sampler.notices[0]
    host = sampler.series.samples("host")
    assert len(host) >= 4
    summary = sampler.summary()
    assert set(summary["host"]["ranks"]) == {"0", "1"}
    assert summary["host"]["ranks"]["0"]["cpu_pct_mean"] > 5
    data = json.loads(json.dumps(sampler.to_dict()))
    again = TimeSeries.from_dict(data["series"])
    assert again.samples("host") == host


def test_time_series_is_bounded():
    ts = TimeSeries(max_samples=3)
    for i in range(5):
        ts.add("host", float(i), {"i": i})
    assert [s["data"]["i"] for s in ts.samples("host")] == [2, 3, 4]
    assert ts.latest("host")["t"] == 4.0


# -- py-spy ---------------------------------------------------------------------------------------

LOOP = textwrap.dedent(
    """
    import time

    def make_batch():
        t = time.time()
        while time.time() - t < 0.02:
            pass

    def train_step():
        make_batch()
        s = 0
        for i in range(200000):
            s += i

    while True:
        train_step()
    """
)


def _pyspy_permitted() -> tuple[bool, str]:
    exe = find_pyspy()
    if exe is None:
        return False, "py-spy is not installed"
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    try:
        time.sleep(0.5)
        out = subprocess.run(
            [exe, "dump", "--pid", str(child.pid)], capture_output=True, text=True, timeout=20
        )
    finally:
        child.kill()
        child.wait()
    if out.returncode != 0:
        return False, f"py-spy cannot read another process here: {out.stderr.strip()[:200]}"
    return True, ""


def test_pyspy_on_a_real_child_process():
    ok, why = _pyspy_permitted()
    if not ok:
        pytest.skip(why)
    child = subprocess.Popen([sys.executable, "-c", LOOP])
    try:
        time.sleep(0.5)
        src = PySpySource()
        samples = []
        for _ in range(12):
            data = src.sample({0: child.pid})
            assert data is not None
            samples.append({"t": time.time(), "data": data})
            time.sleep(0.03)
    finally:
        child.kill()
        child.wait()
    assert src.available and src.errors <= 2  # a non-blocking read may catch a torn stack
    threads = samples[-1]["data"]["ranks"]["0"]["threads"]
    assert any(t["main"] for t in threads)
    summary = summarize_pyspy(samples)
    assert summary["samples"] >= 10
    names = " ".join(f["function"] for f in summary["top_functions"])
    assert "make_batch" in names or "train_step" in names
    assert set(summary["categories"]) <= {
        "data_loading",
        "python",
        "native",
        "idle",
        "optimizer_step",
    }
    assert (
        summary["categories"].get("data_loading", 0) + summary["categories"].get("python", 0) > 0.5
    )


def test_pyspy_not_permitted_is_one_notice(tmp_path):
    exe = tmp_path / "py-spy"
    exe.write_text(
        "#!/bin/sh\necho 'Error: Permission Denied: Try running again with elevated permissions' >&2\nexit 1\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    sampler = TelemetrySampler({0: os.getpid()}, nvml=False, host=False, pyspy_exe=str(exe))
    sampler.sample_once()
    sampler.sample_once()
    assert len(sampler.notices) == 1 and "not permitted" in sampler.notices[0]
    assert "pyspy" not in sampler.sources
    assert sampler.series.samples("pyspy") == []


def test_missing_pyspy_is_a_notice(monkeypatch):
    import tunekit.observe.telemetry.pyspy as pyspy_mod

    monkeypatch.setattr(pyspy_mod, "find_pyspy", lambda: None)
    sampler = TelemetrySampler({0: os.getpid()}, nvml=False, host=False)
    assert sampler.notices == ["py-spy not found; no Python stack samples"]
    sampler.sample_once()
    assert sampler.series.sources() == []


def _sample(frames, active=True, gil=True):
    return {
        "main": True,
        "active": active,
        "owns_gil": gil,
        "frames": [{"name": n, "file": f, "line": 1} for n, f in frames],
    }


def test_classify_and_summary_flags():
    loop = ("train_step", "/x/tunekit/runtime/session.py")
    data = _sample(
        [("__getitem__", "/d/ds.py"), ("fetch", "/t/torch/utils/data/_utils/fetch.py"), loop]
    )
    opt = _sample([("_single_tensor_sgd", "/t/torch/optim/sgd.py"), loop])
    native = _sample([("forward", "/t/torch/nn/modules/conv.py"), loop], gil=False)
    python = _sample([("helper", "/u/train.py"), loop])
    idle = _sample([("wait", "/t/threading.py"), loop], active=False)
    startup = _sample([("_compile_bytecode", "<frozen>")])  # before the loop: ignored
    assert [classify(t) for t in (data, opt, native, python, idle)] == [
        "data_loading",
        "optimizer_step",
        "native",
        "python",
        "idle",
    ]
    threads = [data, data, opt, native, native, native, python, idle, startup, startup] * 4
    samples = [
        {"t": i, "data": {"ranks": {"0": {"pid": 1, "threads": [t]}}}}
        for i, t in enumerate(threads)
    ]
    s = summarize_pyspy(samples, flag_fraction=0.2)
    assert s["samples"] == 32
    assert s["categories"] == {
        "data_loading": 0.25,
        "optimizer_step": 0.125,
        "native": 0.375,
        "python": 0.125,
        "idle": 0.125,
    }
    assert s["flags"] == ["data loading: 25% of stack samples"]
    assert s["top_functions"][0]["function"] == "forward (conv.py:1)"


def test_no_flags_from_a_handful_of_samples_nor_from_tunekit_measuring():
    """Issue 19: six samples raised flags, and the profiler exporting a trial's trace
    (tunekit's own work) counted as the job's Python overhead."""
    loop = ("train_step", "/x/tunekit/runtime/session.py")
    python = _sample([("helper", "/u/train.py"), loop])
    native = _sample([("forward", "/t/torch/nn/modules/conv.py"), loop], gil=False)
    export = _sample(
        [
            ("_save", "/t/torch/autograd/profiler.py"),
            ("export_chrome_trace", "/t/torch/profiler/profiler.py"),
            ("_profile", "/x/tunekit/runtime/worker.py"),
        ]
    )

    def summary(threads):
        return summarize_pyspy(
            [
                {"t": i, "data": {"ranks": {"0": {"pid": 1, "threads": [t]}}}}
                for i, t in enumerate(threads)
            ]
        )

    few = summary([python, python, python, native, native, native])
    assert few["categories"]["python"] == 0.5 and few["flags"] == []
    many = summary([python] * 5 + [native] * 30 + [export] * 40)
    assert many["samples"] == 35  # the trace export is left out
    assert "export_chrome_trace" not in " ".join(f["function"] for f in many["top_functions"])
    assert many["flags"] == ["Python overhead in the loop: 14% of stack samples"]
