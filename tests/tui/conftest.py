"""A backend with fixed data for the TUI's pilot and snapshot tests.

Everything it returns is in the core's own formats — ``status.json`` and
``metrics.jsonl`` records, the telemetry sampler's time series (NVML samples of
two GPUs stand in for a driver this machine does not have), ``profile_job``'s
report, the orchestrator's event classes — so the app's real conversion code
runs on it. Only the processes are missing: no job, no trials.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from tunekit.config import TuningConfig
from tunekit.errors import ControlError
from tunekit.events import (
    Decided,
    Diagnosed,
    Event,
    Notice,
    Observed,
    Planned,
    PluginProblem,
    ReportWritten,
    StudyFinished,
    StudyStarted,
    TrialFinished,
    TrialProgress,
    TrialStarted,
)
from tunekit.plugin_loading import PluginRecord
from tunekit.runtime.client import ApplyOutcome
from tunekit.tui.app import TunekitApp
from tunekit.tui.backend import Backend, DiagnosisResult, LiveSnapshot, TuneRequest
from tunekit.tui.state import BaselineView, candidate_view

T0 = 1_700_000_000.0
BASE = TuningConfig().to_dict()
BUCKETS = {
    "tunekit_config": 1,
    "plugins": {"overlap_chunking": {"bucket_cap_mb": 4.0, "mode": "ddp_buckets"}},
}
TWO_CHUNK = {"tunekit_config": 1, "plugins": {"overlap_chunking": {"k": 5, "mode": "two_chunk"}}}
BATCH = {"tunekit_config": 1, "plugins": {"batch_ps_sizing": {"batch_size": 64}}}
NO_GPU = "no NVIDIA GPU or driver (NVML Shared Library Not Found); host metrics only"


def step_time(i: int) -> float:
    return 0.230 + 0.02 * math.sin(i / 3) + (0.015 if i % 17 == 0 else 0.0)


def metrics(
    n: int = 60, config: Mapping[str, Any] = BASE, changes: Sequence[tuple[int, Mapping]] = ()
) -> list[dict[str, Any]]:
    """``n`` steps under ``config``, or, from each ``(step, config)`` of ``changes`` on, under
    that one (an applied config runs 8% faster steps here)."""

    def config_at(i: int) -> tuple[str, float]:
        now, factor = config, 1.0
        for step, cfg in changes:
            if i >= step:
                now, factor = cfg, (1.0 if cfg == BASE else 0.92)
        return TuningConfig.from_dict(dict(now)).config_id, factor

    out = []
    for i in range(n):
        cid, factor = config_at(i)
        out.append(
            {
                "step": i,
                "loss": 2.3 - 0.005 * i,
                "step_s": step_time(i) * factor,
                "samples_per_s": 64 / (step_time(i) * factor),
                "config_id": cid,
                "world_size": 2,
                "batch_size": 32,
                "t": T0 + i * 0.25,
            }
        )
    return out


def status(
    step: int = 60, config: Mapping[str, Any] = BASE, watch: dict | None = None
) -> dict[str, Any]:
    last = metrics(step, config)[-1]
    return {
        "status": "running",
        "run_id": "demo",
        "step": step,
        "total_steps": None,
        "world_size": 2,
        "config": dict(config),
        "config_id": TuningConfig.from_dict(dict(config)).config_id,
        "last": {k: last[k] for k in ("step", "loss", "step_s", "samples_per_s")},
        "watch": watch,
        "trial": None,
        "pid": 4242,
    }


def host_series(n: int = 30) -> list[dict[str, Any]]:
    return [
        {
            "t": T0 + i,
            "data": {
                "ranks": {
                    str(r): {
                        "pid": 4242 + r,
                        "cpu_pct": None if i == 0 else 95.0 + 4 * math.sin(i / 2 + r),
                        "rss_bytes": (410 + 3 * r) * 2**20,
                        "threads": 6,
                    }
                    for r in (0, 1)
                },
                "system": {
                    "cpu_pct": 97.0 + math.sin(i),
                    "mem_used_bytes": 3 * 2**30,
                    "mem_total_bytes": 8 * 2**30,
                    "mem_pct": 37.5,
                },
            },
        }
        for i in range(n)
    ]


def nvml_series(n: int = 30) -> list[dict[str, Any]]:
    def gpu(i: int, g: int) -> dict[str, Any]:
        return {
            "index": g,
            "util_gpu_pct": 70.0 + 20 * math.sin(i / 2 + g),
            "util_mem_pct": 30.0,
            "mem_used_bytes": (9 + g + 0.1 * i) * 2**30,
            "mem_total_bytes": 40 * 2**30,
            "power_w": 250.0 + 40 * math.sin(i / 3),
            "sm_clock_mhz": 1410,
            "mem_clock_mhz": 1215,
            "pcie_tx_bytes_s": (2.0 + math.sin(i)) * 2**30,
            "pcie_rx_bytes_s": 1.5 * 2**30,
            "nvlink_tx_bytes": int(i * 40 * 2**30),
            "nvlink_rx_bytes": int(i * 38 * 2**30),
        }

    return [{"t": T0 + i, "data": {"gpus": [gpu(i, 0), gpu(i, 1)], "ranks": {}}} for i in range(n)]


def pyspy_series() -> list[dict[str, Any]]:
    def thread(
        frames: list[tuple[str, str]], active: bool = True, gil: bool = False
    ) -> dict[str, Any]:
        return {
            "main": True,
            "name": "MainThread",
            "active": active,
            "owns_gil": gil,
            "frames": [{"name": n, "file": f, "line": 10} for n, f in frames],
        }

    loop = ("train_step", "/site/tunekit/runtime/session.py")
    conv = ("_conv_forward", "/site/torch/nn/modules/conv.py")
    wait = ("wait", "/site/torch/distributed/distributed_c10d.py")
    step = ("step", "/site/torch/optim/sgd.py")
    samples = []
    for i in range(36):  # enough to flag (MIN_FLAG_SAMPLES)
        r0 = thread([conv, loop]) if i % 3 else thread([step, loop], gil=True)
        r1 = thread([wait, loop], active=False) if i % 2 else thread([conv, loop])
        samples.append(
            {
                "t": T0 + i,
                "data": {
                    "ranks": {
                        "0": {"pid": 4242, "threads": [r0]},
                        "1": {"pid": 4243, "threads": [r1]},
                    }
                },
            }
        )
    return samples


def profile_report() -> dict[str, Any]:
    layers = [
        ("features.0", "conv2d", 0.0121, 0.0233, 3_211_264),
        ("features.3", "conv2d", 0.0302, 0.0611, 1_605_632),
        ("features.6", "conv2d", 0.0205, 0.0402, 802_816),
        ("classifier.0", "linear", 0.0041, 0.0083, 16_384),
        ("features.1", "relu", 0.0011, 0.0019, 3_211_264),
        ("classifier.2", "linear", 0.0003, 0.0005, 1_280),
    ]
    summary = {
        "ranks": 2,
        "total_s": 0.2300,
        "compute_s": 0.1518,
        "comm_exposed_s": 0.0552,
        "data_s": 0.0023,
        "optimizer_s": 0.0023,
        "idle_s": 0.0184,
        "comm_total_s": 0.0920,
        "overlap_R": 40.0,
        "measured_step_s": 0.2312,
        "slowest_rank": 1,
    }
    summary["fractions"] = {
        p: summary[f"{p}_s"] / summary["total_s"]
        for p in ("compute", "comm_exposed", "data", "optimizer", "idle")
    }
    return {
        "workload": "example:cnn",
        "nproc": 2,
        "device": "cpu",
        "steps": 3,
        "wall_s": 21.0,
        "graph": {"layers": 6},
        "layer_profile": {
            "layers": [
                {"name": n, "kind": k, "forward_s": f, "backward_s": b, "activation_bytes": a}
                for n, k, f, b, a in layers
            ]
        },
        "top_layers": [
            {"name": n, "kind": k, "forward_s": f, "backward_s": b, "flops": 1e9 * (f + b)}
            for n, k, f, b, _ in layers[:3]
        ],
        "breakdown": {"ranks": [], "summary": summary},
        "telemetry": {"notices": [NO_GPU]},
        "notices": [],
    }


def records() -> list[PluginRecord]:
    def rec(name: str, title: str, aspect: str) -> PluginRecord:
        return PluginRecord(
            name,
            "tunekit 0.1.0",
            f"tunekit.plugins.{name}.plugin:X",
            "ok",
            tuner=SimpleNamespace(title=title, aspect=aspect),
        )

    return [
        rec("batch_ps_sizing", "Batch size and parameter servers (Zou et al.)", "batch"),
        rec("cgdp", "Coarse-grained data parallelism (Le et al.)", "grad_sync"),
        PluginRecord(
            "fancy",
            "fancy-tuner 0.3",
            "fancy.plugin:Fancy",
            "failed",
            "import failed: ModuleNotFoundError: No module named 'fancy_deps'",
        ),
        rec("overlap_chunking", "Overlapped gradient chunks (Lee et al.)", "grad_sync"),
    ]


def diagnoses() -> dict[str, DiagnosisResult]:
    oc = candidate_view(
        "overlap_chunking",
        {
            "knobs": BUCKETS["plugins"]["overlap_chunking"],
            "predicted_step_s": 0.201,
            "rationale": "4 MiB buckets: 12.0 ms exposed, R~78",
        },
    )
    two = candidate_view(
        "overlap_chunking",
        {
            "knobs": TWO_CHUNK["plugins"]["overlap_chunking"],
            "predicted_step_s": 0.214,
            "rationale": "two chunks, k=5, f=0",
        },
    )
    bs = candidate_view(
        "batch_ps_sizing",
        {
            "knobs": BATCH["plugins"]["batch_ps_sizing"],
            "predicted_step_s": 0.41,
            "global_batch": 128,
            "predicted_peak_bytes": 96 * 2**20,
            "rationale": "batch 64 per rank: 1.3x samples/s",
        },
    )
    return {
        "overlap_chunking": DiagnosisResult(
            "overlap_chunking",
            True,
            "exposed communication ~24% of the step; 4 MiB buckets should recover ~13%",
            0.13,
            (oc, two),
        ),
        "batch_ps_sizing": DiagnosisResult(
            "batch_ps_sizing",
            True,
            "compute-bound at batch 32; larger batches amortise the all-reduce",
            0.22,
            (bs,),
        ),
        "cgdp": DiagnosisResult(
            "cgdp", error="RuntimeError: cgdp needs at least 4 ranks to model its groups"
        ),
    }


def tuning_events(
    plugins: Sequence[str], reason: str | None = None
) -> list[tuple[Event, dict | None]]:
    """A whole study: baseline, two candidates (one crashes), a second baseline, the decision
    (its ``reason`` replaced when given)."""
    evs: list[tuple[Event, dict | None]] = [
        (StudyStarted(7, "example:cnn", 2, "this machine (cpu x2)", False), None),
        (
            Observed(
                {
                    "workload": "example:cnn",
                    "baseline_median_s": 0.231,
                    "global_batch": 64,
                    "breakdown": profile_report()["breakdown"]["summary"],
                    "top_layers": profile_report()["layer_profile"]["layers"][:3],
                    "telemetry": {
                        "pyspy": {
                            "per_rank": {
                                "0": {"native": 8, "python": 2},
                                "1": {"idle": 6, "native": 4},
                            },
                            "top_functions": [
                                {
                                    "function": "_conv_forward (conv.py:10)",
                                    "samples": 8,
                                    "fraction": 0.4,
                                }
                            ],
                            "flags": [],
                        }
                    },
                }
            ),
            None,
        ),
    ]
    d = diagnoses()
    for name in plugins:
        r = d.get(name)
        if r is None or r.error:
            evs.append(
                (PluginProblem(name, "", "diagnose failed", r.error if r else "unknown"), None)
            )
            continue
        evs.append((Diagnosed(name, bool(r.applies), r.summary, r.expected_gain), None))
        evs.append(
            (
                Planned(
                    name,
                    [
                        {
                            "knobs": TuningConfig.from_dict(dict(c.config)).plugins[name],
                            "predicted_step_s": c.predicted_s,
                            "rationale": c.rationale,
                            "global_batch": c.global_batch,
                        }
                        for c in r.candidates
                    ],
                ),
                None,
            )
        )
    trials = [
        (1, 0, "baseline", None, "baseline", None, 0.231, 0.012, "ok", None, BASE),
        (
            2,
            1,
            "candidate",
            "overlap_chunking",
            "overlap_chunking(bucket_cap_mb=4.0)",
            0.201,
            0.209,
            0.010,
            "ok",
            None,
            BUCKETS,
        ),
        (
            3,
            2,
            "candidate",
            "batch_ps_sizing",
            "batch_ps_sizing(batch_size=64)",
            0.41,
            None,
            None,
            "crash",
            "RuntimeError: out of memory on rank 1",
            BATCH,
        ),
        (4, 3, "baseline", None, "baseline", None, 0.233, 0.011, "ok", None, BASE),
    ]
    corrected = {2: 0.207}  # as if an earlier trial of its tuner had corrected it
    for n, (tid, seq, role, plugin, desc, pred, med, spread, st, err, cfg) in enumerate(trials, 1):
        fix = corrected.get(tid, pred)
        evs.append((TrialStarted(tid, seq, role, plugin, desc, pred, n, len(trials), fix), None))
        for i in (1, 3):
            evs.append((TrialProgress(tid, "measure", i * 4, 16, med), None))
        rate = (128 if plugin == "batch_ps_sizing" else 64) / med if med else None
        evs.append(
            (
                TrialFinished(
                    tid,
                    seq,
                    role,
                    plugin,
                    desc,
                    st,
                    med,
                    spread,
                    pred,
                    err,
                    fix,
                    samples_per_s=rate,
                ),
                cfg,
            )
        )
    decision = {
        "baseline_median_s": 0.232,
        "baseline_global_batch": 64,
        "baseline_runs": 2,
        "min_effect": 0.01,
        "candidates": [],
        "winner": "overlap_chunking(bucket_cap_mb=4.0)",
        "winner_trial": 2,
        "winner_config": BUCKETS,
        "speedup": 1.11,
        "ci": [1.06, 1.15],
        "winner_median_s": 0.209,
        "reason": reason
        or "11.0% more samples/s than the baseline over 2 run(s) (95% CI 1.060-1.150x)",
    }
    evs += [
        (Notice("confirming the leader with a second run beside the baseline"), None),
        (Decided(decision), None),
        (ReportWritten({"report_md": "tunekit-out/report.md"}), None),
        (StudyFinished(7, decision["winner"], 1.11), None),
    ]
    return evs


class ManualClock:
    """The app's clock in tests: it moves only when the fixed tuning says a trial took time
    (30 s each), so that the time left on screen is the same in every run."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FixedBackend(Backend):
    """Serves the fixed data above; apply and roll back change the config it reports."""

    def __init__(self, gpu: bool = True):
        self.run_id = "demo"
        self.workload = "example:cnn"
        self.nproc = 2
        self.owns_job = True
        self.gpu = gpu
        self.config: dict[str, Any] = dict(BASE)
        self.history: list[dict[str, Any]] = []
        self.watch: dict | None = None
        self.applied: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        """The run's ``events.jsonl``: an apply at step 45, a rollback at step 52."""
        self.closed = False
        self.pyspy = pyspy_series()
        """What the sampler holds now (a test may slide it along)."""
        self.pause_after: int | None = None
        """When set, the tuning stops after this many events until :attr:`resume` is set."""
        self.resume = threading.Event()
        self.clock = ManualClock()
        self.hold_diagnosis: str | None = None
        """When set, the diagnosis waits at this tuner until :attr:`resume` is set."""
        self.decision_reason: str | None = None
        """The decision's reason, when a test needs another one."""

    def start(self) -> list[str]:
        return [] if self.gpu else [NO_GPU]

    def poll(self) -> LiveSnapshot:
        series = {"host": host_series(), "pyspy": list(self.pyspy)}
        static: dict[str, Any] = {"host": {"cpus_logical": 2}}
        if self.gpu:
            series["nvml"] = nvml_series()
            static["nvml"] = {
                "devices": [
                    {"index": 0, "name": "NVIDIA A100-SXM4-40GB"},
                    {"index": 1, "name": "NVIDIA A100-SXM4-40GB"},
                ]
            }
        changes = [(e["step"], e["config"]) for e in self.events]
        return LiveSnapshot(
            status(60, self.config, self.watch),
            metrics(60, BASE, changes),
            series,
            static,
            [] if self.gpu else [NO_GPU],
            list(self.events),
            len(self.history),
        )

    def plugins(self) -> list[PluginRecord]:
        return records()

    def diagnose(
        self, names: Sequence[str], limit: int, on_progress=lambda name, what: None
    ) -> Iterator[DiagnosisResult]:
        d = diagnoses()
        for stage in ("loading example:cnn", "timing 11 layers standalone (forward and backward)"):
            on_progress(None, stage)
        against = BaselineView(64, 0.231, "the live job's last 57 untuned steps")
        for name in names:
            on_progress(name, "diagnosing")
            while name == self.hold_diagnosis and not self.resume.is_set():
                time.sleep(0.01)  # this tuner "diagnosing" until the test resumes it
            r = d.get(name) or DiagnosisResult(name, False, "does not apply to this job")
            if r.applies:
                on_progress(name, "planning its candidates")
            yield dataclasses.replace(r, baseline=against)

    def profile(
        self, on_stage: Callable[[str], None]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        for stage in ("tracing the model graph", "timing each layer", "profiled run on 2 rank(s)"):
            on_stage(stage)
        return profile_report(), pyspy_series()

    async def tune(self, request: TuneRequest) -> AsyncIterator[Event]:
        events = tuning_events(request.plugins or [], self.decision_reason)
        if not self.gpu:  # the trials' samplers find no GPU either, as the real ones do
            events.insert(3, (Notice(NO_GPU), None))
        for i, (ev, _) in enumerate(events):
            while i == self.pause_after and not self.resume.is_set():
                await asyncio.sleep(0.01)  # a trial "in flight"; cancelling lands here
            await asyncio.sleep(0)
            if isinstance(ev, TrialFinished) and ev.status != "skipped":
                self.clock.now += 30.0  # each trial takes 30 s of the app's clock
            yield ev

    def trial_config(self, study_id: int, trial_id: int) -> dict[str, Any] | None:
        return next(
            (
                cfg
                for ev, cfg in tuning_events(["overlap_chunking", "batch_ps_sizing"])
                if isinstance(ev, TrialFinished) and ev.trial_id == trial_id
            ),
            None,
        )

    def apply(self, config: Mapping[str, Any]) -> ApplyOutcome:
        self.history.append(self.config)
        self.applied.append(dict(config))
        self.config = dict(config)
        self.events.append({"kind": "applied", "step": 45, "config": dict(config)})
        self.watch = {
            "state": "kept",
            "reason": "1.09x the samples/s of before (95% CI 1.04-1.13)",
            "before_s_per_sample": 0.231 / 64,
            "after_s_per_sample": 0.212 / 64,
            "applied_at": 60,
            "speedup": 1.09,
            "ci": [1.04, 1.13],
        }
        return ApplyOutcome(
            "applied at step 60; kept: 1.09x the samples/s of before (95% CI 1.04-1.13)",
            {"ok": True, "step": 60},
            rolled_back=False,
        )

    def rollback(self) -> ApplyOutcome:
        if not self.history:
            raise ControlError("nothing to roll back: no config was applied to this job")
        self.config = self.history.pop()
        self.events.append({"kind": "rolled_back", "step": 52, "config": dict(self.config)})
        self.watch = {
            **(self.watch or {}),
            "state": "rolled_back",
            "reason": "rolled back on request",
        }
        return ApplyOutcome("rolled back at step 61", {"ok": True, "step": 61})

    def close(self, stop_job: bool) -> None:
        self.closed = True


@pytest.fixture
def backend_factory() -> Callable[..., FixedBackend]:
    """``backend_factory(gpu=True)``: a fresh :class:`FixedBackend`."""
    return FixedBackend


@pytest.fixture
def fixed() -> SimpleNamespace:
    """The fixed data, for assertions."""
    return SimpleNamespace(
        BASE=BASE,
        BUCKETS=BUCKETS,
        TWO_CHUNK=TWO_CHUNK,
        BATCH=BATCH,
        NO_GPU=NO_GPU,
        metrics=metrics,
        status=status,
        host_series=host_series,
        nvml_series=nvml_series,
        pyspy_series=pyspy_series,
        profile_report=profile_report,
        records=records,
        tuning_events=tuning_events,
    )


class RecordingApp(TunekitApp):
    """The app, keeping every notification in :attr:`notes` (toasts expire; the record does not)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.notes: list[SimpleNamespace] = []

    def notify(
        self, message: str, *, title: str = "", severity: str = "information", **kwargs: Any
    ) -> None:
        self.notes.append(SimpleNamespace(message=message, title=title, severity=severity))
        super().notify(message, title=title, severity=severity, **kwargs)


def make_app(backend: Backend | None = None, **kwargs: Any) -> TunekitApp:
    """The app over fixed data, polling fast so tests need not wait; its clock the backend's
    (see :class:`ManualClock`)."""
    backend = backend or FixedBackend()
    app = RecordingApp(backend, TuneRequest(trials=2, steps=16, warmup=2), poll_s=0.2, **kwargs)
    if isinstance(backend, FixedBackend):
        app.clock = backend.clock
    return app


@pytest.fixture
def app_factory() -> Callable[..., TunekitApp]:
    return make_app


async def until(pilot, condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Let the app run until ``condition()`` holds; fail after ``timeout`` seconds: a bound
    on a hang, not on speed (a screen of 200x60 took over 10 s to answer a key beside two
    studies on two busy cores)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the app did not reach the expected state in time")
        await pilot.pause(0.02)


@pytest.fixture
def wait_for_app() -> Callable:
    return until


def plain(value: Any) -> str:
    """The text of a Static's content, a rendered Text, or a table cell."""
    return str(value.content if hasattr(value, "content") else value)


@pytest.fixture
def text_of() -> Callable[[Any], str]:
    return plain


def drawn(app) -> list[str]:
    """The screen as the terminal would show it, line by line."""
    return [
        "".join(segment.text for segment in strip).rstrip()
        for strip in app.screen._compositor.render_strips()
    ]


@pytest.fixture
def screen_lines() -> Callable[[Any], list[str]]:
    return drawn


def diagnosed(app) -> bool:
    """No tuner waits for its turn or diagnoses any more."""
    return bool(app.tuner_views) and all(
        t.state not in ("waiting", "diagnosing") for t in app.tuner_views
    )


@pytest.fixture
def diagnosis_over() -> Callable[[Any], bool]:
    return diagnosed
