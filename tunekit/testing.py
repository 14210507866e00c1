"""Helpers for testing tuners and tunekit itself, with real components.

For plugin authors (see ``docs/plugins.md``, "Testing"):

* :func:`tiny_workload`, :func:`tiny_dataset_workload` — real
  :class:`~tunekit.workload.Workload` objects (a batch factory and a dataset
  variant) that train in milliseconds; also usable by name,
  ``tunekit.testing:tiny_workload``;
* :func:`tiny_hardware` — a deterministic :class:`~tunekit.hardware.Hardware`
  (``local_hardware`` describes this machine instead);
* :func:`synthetic_observation` — an :class:`~tunekit.observe.observation.Observation`
  as the orchestrator builds it (model summary, graph, baseline measurement,
  step breakdown, telemetry summarised by the real summarisers), with the
  numbers you choose;
* :func:`check_conformance` — the contract, checked phase by phase: knobs
  declared with types and ranges, ``diagnose`` and ``plan`` return what the
  orchestrator needs, and the runtime hook applies on a real
  :class:`~tunekit.runtime.session.Session`, is undone by ``session.reset()``
  and leaks nothing into the next trial. Failures raise
  :class:`ConformanceError` (an ``AssertionError``) naming the plugin and
  every problem found.

For multi-process tests, :func:`run_ranks` runs a function on N real
processes joined in a gloo process group on loopback, the way torchrun would,
and returns what each rank returned (equivalence tests: a gradient reducer
against DDP, a placement against single-process training). Equivalence tests
run in float64 (``run_ranks(..., dtype=torch.float64)``, :func:`default_dtype`
for the reference run) and compare with :func:`assert_states_close`: float
summation order then costs ~1e-15, so a tight tolerance holds on any CPU and
still catches a real mistake.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import re
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tunekit import API_VERSION, rank_pool
from tunekit.config import TuningConfig
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.hardware import GB, CollectiveFit, Device, Hardware, Host, Link
from tunekit.observe.breakdown import PARTS, Breakdown, CollectiveTiming, RankBreakdown, StepParts
from tunekit.observe.observation import Measurement, Observation, summarize_model
from tunekit.runtime.dist import single_rank_group  # re-exported: tests use it from here
from tunekit.runtime.session import Session
from tunekit.workload import Workload, load_workload

__all__ = [
    "ConformanceError",
    "ConformanceReport",
    "MemoryCache",
    "SessionState",
    "TinyDataset",
    "assert_states_close",
    "check_conformance",
    "check_declaration",
    "check_diagnose_and_plan",
    "check_runtime",
    "default_dtype",
    "local_hardware",
    "run_ranks",
    "snapshot_session",
    "synthetic_breakdown",
    "synthetic_observation",
    "synthetic_telemetry",
    "tiny_dataset_workload",
    "tiny_hardware",
    "tiny_workload",
]


# == real ranks ===========================================================================


_STORE_TIMEOUT = timedelta(seconds=120)


def _store(rank: int, world: int, out_dir: str) -> dist.TCPStore:
    """The call's rendezvous store, on a port rank 0 binds itself.

    Rank 0 asks the kernel for the port (0) and publishes it in ``out_dir``; a
    port picked earlier by the caller could be taken by any other process on the
    machine (a parallel test's ranks, a trial) while the ranks start.
    """
    published = Path(out_dir) / "store_port"
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False
        )
        staging = published.with_suffix(".tmp")
        staging.write_text(str(store.port))
        staging.replace(published)  # atomic: the others never read half a number
        return store
    deadline = time.monotonic() + _STORE_TIMEOUT.total_seconds()
    while not published.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no store port within {_STORE_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.01)
    port = int(published.read_text())
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=_STORE_TIMEOUT)


RANK_THREADS_ENV = "TUNEKIT_RANK_THREADS"
"""Intra-op threads per rank in :func:`run_ranks` (default 1): equivalence tests are run
under 1 and 2 to check that no tolerance depends on how a kernel splits its work."""


def rank_threads() -> int:
    return int(os.environ.get(RANK_THREADS_ENV, "1"))


def _rank_main(
    rank: int, fn: Callable, world: int, out_dir: str, args: tuple, dtype: torch.dtype | None = None
) -> None:
    torch.set_num_threads(rank_threads())
    if dtype is not None:
        torch.set_default_dtype(dtype)  # a pooled rank returns to float32 at its next call
    result_path = Path(out_dir) / f"rank{rank}.pt"
    try:
        store = _store(rank, world, out_dir)
        # What a torchrun rank sees, for code that reads it.
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_STORE_TIMEOUT)
        value = fn(rank, world, *args)
        torch.save({"ok": True, "value": value}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc(), "t": time.time()}, result_path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn_ranks(
    fn: Callable[..., Any], nproc: int, out_dir: str, args: tuple, timeout_s: float, dtype
) -> None:
    ctx = mp.start_processes(
        _rank_main,
        args=(fn, nproc, out_dir, args, dtype),
        nprocs=nproc,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        # A rank that raised or died: its own result file says what happened.
        with contextlib.suppress(mp.ProcessRaisedException, mp.ProcessExitedException):
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def run_ranks(
    fn: Callable[..., Any],
    nproc: int = 2,
    args: tuple = (),
    timeout_s: float = 180,
    *,
    dtype: torch.dtype | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo ranks; return each rank's value.

    ``dtype`` sets each rank's default dtype before ``fn`` runs (models and
    synthetic batches are then built in it): equivalence tests pass
    ``torch.float64``. Each rank runs :func:`rank_threads` intra-op threads.

    ``fn`` must be importable by name (a module-level function) because each
    rank is a fresh interpreter. Values travel back with ``torch.save``, so
    tensors are fine. A failure on any rank raises ``RuntimeError`` with that
    rank's traceback. With ``TUNEKIT_REUSE_RANKS=1`` the ranks are kept for the
    next call (:mod:`tunekit.rank_pool`; tunekit's own test suite does this).
    """
    with tempfile.TemporaryDirectory(prefix="tunekit-ranks-") as out_dir:
        if rank_pool.enabled():
            rank_pool.run_on_pool(nproc, _rank_main, (fn, nproc, out_dir, args, dtype), timeout_s)
        else:
            _spawn_ranks(fn, nproc, out_dir, args, timeout_s, dtype)
        paths = [Path(out_dir) / f"rank{rank}.pt" for rank in range(nproc)]
        found = [torch.load(p, weights_only=False) if p.exists() else None for p in paths]
    failed = [(res["t"], rank, res["error"]) for rank, res in enumerate(found) if res and not res["ok"]]
    if failed:  # the first to fail; the others mostly fail because it left them waiting
        _, rank, error = min(failed)
        raise RuntimeError(f"rank {rank} failed:\n{error}")
    for rank, res in enumerate(found):
        if res is None:
            raise RuntimeError(f"rank {rank} died without a result")
    return [res["value"] for res in found]


# == numerical equivalence ================================================================

EQUIVALENCE_RTOL = 1e-9
"""Relative tolerance of a float64 equivalence check (see :func:`assert_states_close`).

Why this value: float64's unit roundoff is u = 2**-53 ~ 1.1e-16. Two runs of the
same mathematics differ only in summation order (a gradient reduced in chunks,
a model-parallel split, a gathered batch, another kernel or thread split), and
a sum of n terms in another order differs by at most ~n*u of the sum of the
terms' magnitudes. Our reductions are at most ~1e5 terms deep (batch x spatial
positions), so one step differs by <= ~1e-11 of the tensor's scale, and a few
steps compound that additively. 1e-9 leaves a 100x margin on any CPU, while a
real mistake (a gradient contribution missed, doubled or stale, a wrong
learning rate) moves parameters by ~lr x |grad| >= 1e-5 of their scale."""


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build models and synthetic batches in ``dtype`` for the duration (a reference run)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def assert_states_close(actual: Any, expected: Any, what: str, *, rtol: float = EQUIVALENCE_RTOL) -> None:
    """Assert two training states (nested dicts/lists of tensors and values) agree.

    Floating tensors must be float64 (the claim is "the same mathematics", see
    :data:`EQUIVALENCE_RTOL`) and agree elementwise within ``rtol`` of their own
    value plus ``rtol`` of the tensor's scale (a bias near zero is compared at its
    weight's precision, not its own); integer tensors and other values exactly.
    """
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and actual.keys() == expected.keys(), (
            f"{what}: keys differ: {sorted(map(str, actual))} vs {sorted(map(str, expected))}"
        )
        for key in expected:
            assert_states_close(actual[key], expected[key], f"{what}.{key}", rtol=rtol)
    elif isinstance(expected, list | tuple):
        assert isinstance(actual, list | tuple) and len(actual) == len(expected), (
            f"{what}: lengths differ"
        )
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_states_close(a, e, f"{what}[{i}]", rtol=rtol)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__} is no tensor"
        if not expected.is_floating_point():
            assert torch.equal(actual, expected), f"{what} differs"
            return
        assert expected.dtype == actual.dtype == torch.float64, (
            f"{what}: compared in {actual.dtype}/{expected.dtype}; equivalence runs in float64"
        )
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(
            actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what} differs: {m}"
        )
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


# == workloads ============================================================================

TINY_FEATURES = 16
TINY_CLASSES = 4


def _tiny_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(TINY_FEATURES, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, TINY_CLASSES),
    )


def _tiny_labels(x: torch.Tensor) -> torch.Tensor:
    # A fixed linear "teacher": the task is learnable, so losses really fall.
    w = torch.linspace(-1.0, 1.0, TINY_FEATURES * TINY_CLASSES).reshape(TINY_FEATURES, TINY_CLASSES)
    return (x @ w).argmax(dim=-1)


def _tiny_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, TINY_FEATURES, generator=gen)
    return x, _tiny_labels(x)


class TinyDataset(torch.utils.data.Dataset):
    """``n`` samples, each a pure function of its index (loader workers see the same data)."""

    def __init__(self, n: int = 256, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(
            TINY_FEATURES, generator=torch.Generator().manual_seed(self.seed * 100_003 + i)
        )
        return x, _tiny_labels(x)


def tiny_workload() -> Workload:
    """A three-layer MLP on synthetic batches (``make_batch``); trains in milliseconds.

    Batch changes are allowed (``batch_range=(2, 64)``), so batch tuners can be checked too.
    """
    return Workload(
        name="tiny",
        model=_tiny_model,
        make_batch=_tiny_batch,
        batch_size=8,
        lr=0.05,
        batch_range=(2, 64),
        description="tunekit.testing: MLP 16-32-32-4 on synthetic batches",
        extra={"family": "mlp"},
    )


def tiny_dataset_workload() -> Workload:
    """:func:`tiny_workload` fed by a map-style dataset, so loader options take effect."""
    return Workload(
        name="tiny_dataset",
        model=_tiny_model,
        dataset=TinyDataset,
        batch_size=8,
        lr=0.05,
        batch_range=(2, 64),
        description="tunekit.testing: MLP 16-32-32-4 on a 256-sample dataset",
        extra={"family": "mlp"},
    )


# == hardware =============================================================================


def tiny_hardware(
    nproc: int = 2,
    device_type: str = "cpu",
    *,
    cores: int = 8,
    allreduce_latency_s: float = 50e-6,
    allreduce_bandwidth: float = 1.0 * GB,
) -> Hardware:
    """A small, deterministic machine: ``nproc`` devices on one host with a fitted all-reduce.

    The same on every machine, so plans made in tests do not depend on where
    they run. ``device_type="cuda"`` gives 16 GB GPUs on PCIe.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', not {device_type!r}")
    devices, links = [], []
    for i in range(nproc):
        if device_type == "cuda":
            devices.append(Device(f"gpu{i}", "gpu", "test GPU 16GB", 16 * GB, 15e12))
            links.append(Link(f"gpu{i}", "cpu0", 12 * GB, 5e-6, "pcie"))
        else:
            devices.append(Device(f"rank{i}", "cpu", "test CPU rank", 4 * GB, 100e9))
            links.append(Link(f"rank{i}", "cpu0", 2 * GB, 25e-6, "loopback"))
    backend = "nccl" if device_type == "cuda" else "gloo"
    fits = tuple(
        CollectiveFit(backend, "all_reduce", p, allreduce_latency_s, allreduce_bandwidth)
        for p in range(2, max(nproc, 2) + 1)
    )
    return Hardware(
        name=f"test-{device_type}x{nproc}",
        devices=tuple(devices),
        links=tuple(links),
        host=Host(cores=cores, memory_bytes=64 * GB, sockets=("cpu0",)),
        collectives=fits,
        description="tunekit.testing.tiny_hardware",
        source="test",
    )


def local_hardware(nproc: int = 2, device_type: str = "cpu") -> Hardware:
    """This machine as tunekit describes it before a probe (``describe_local_machine``)."""
    from tunekit.observe.local import describe_local_machine

    return describe_local_machine(nproc, device_type)


# == observations =========================================================================


class MemoryCache:
    """``obs.cache`` without a study store; values go through JSON, as the store's do."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def get(self, key: str) -> Any:
        text = self.data.get(key)
        return None if text is None else json.loads(text)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = json.dumps(value)


DEFAULT_FRACTIONS = {
    "compute": 0.8,
    "comm_exposed": 0.1,
    "data": 0.05,
    "optimizer": 0.05,
    "idle": 0.0,
}


def synthetic_breakdown(
    step_s: float,
    fractions: Mapping[str, float] | None = None,
    *,
    nproc: int = 2,
    steps: int = 3,
    comm_total_s: float | None = None,
) -> Breakdown:
    """A step breakdown whose parts are ``fractions`` of ``step_s`` on every rank.

    ``fractions`` maps parts of :data:`~tunekit.observe.breakdown.PARTS` to
    shares of the step (missing parts are 0; they must sum to 1). Exposed
    communication becomes one all-reduce per step that took ``comm_total_s``
    (default: twice the exposed time) and blocked the rank for the exposed part.
    """
    shares = {p: 0.0 for p in PARTS}
    shares.update(DEFAULT_FRACTIONS if fractions is None else fractions)
    unknown = set(shares) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown breakdown parts {sorted(unknown)}; parts are {', '.join(PARTS)}")
    if not math.isclose(sum(shares.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"breakdown fractions must sum to 1, not {sum(shares.values()):.4f}")
    parts = {p: shares[p] * step_s for p in PARTS}
    comm_total = parts["comm_exposed"] * 2 if comm_total_s is None else comm_total_s
    ranks = []
    for rank in range(nproc):
        steps_ = []
        for i in range(steps):
            colls = []
            if comm_total > 0:
                start = parts["data"] + parts["compute"] * 0.5
                colls = [CollectiveTiming("allreduce", start, comm_total, parts["comm_exposed"])]
            steps_.append(
                StepParts(
                    step=i,
                    total_s=step_s,
                    compute_s=parts["compute"],
                    comm_exposed_s=parts["comm_exposed"],
                    data_s=parts["data"],
                    optimizer_s=parts["optimizer"],
                    idle_s=parts["idle"],
                    comm_total_s=comm_total,
                    collectives=colls,
                )
            )
        ranks.append(RankBreakdown(rank, "cpu", "markers", steps_, [step_s] * steps))
    return Breakdown(ranks)


# A frame that marks a py-spy sample as inside the training loop, and what each
# category's innermost frames look like (as tunekit's classifier reads them).
_LOOP_FRAME = {"name": "train_step", "file": "tunekit/runtime/session.py", "line": 1}
_CATEGORY_SAMPLES: dict[str, tuple[list[dict[str, Any]], bool, bool]] = {
    # category: (frames above the loop frame, active, owns_gil)
    "data_loading": (
        [
            {"name": "__getitem__", "file": "dataset.py", "line": 1},
            {"name": "batch", "file": "tunekit/runtime/data.py", "line": 1},
        ],
        True,
        True,
    ),
    "optimizer_step": ([{"name": "step", "file": "torch/optim/sgd.py", "line": 1}], True, True),
    "python": ([{"name": "loss_fn", "file": "train.py", "line": 1}], True, True),
    "native": ([{"name": "forward", "file": "torch/nn/modules/linear.py", "line": 1}], True, False),
    "idle": (
        [{"name": "wait", "file": "torch/distributed/distributed_c10d.py", "line": 1}],
        False,
        False,
    ),
}


def synthetic_telemetry(
    pyspy: Mapping[str, float] | None = None,
    *,
    nproc: int = 2,
    samples: int = 40,
    cpu_pct: float = 95.0,
    rss_bytes: int = 500 * 2**20,
) -> dict[str, Any]:
    """A telemetry summary shaped exactly like the sampler's, from synthetic samples.

    ``pyspy`` maps py-spy categories (``data_loading``, ``optimizer_step``,
    ``python``, ``native``, ``idle``) to shares of the stack samples; the
    samples are summarised by the real :func:`~tunekit.observe.telemetry.summarize_pyspy`
    (so flags such as ``data loading: 40% of stack samples`` appear as in a
    real run). Without ``pyspy`` the summary has host metrics only, as when
    py-spy is unavailable.
    """
    from tunekit.observe.telemetry import summarize_host, summarize_pyspy

    host_samples = [
        {
            "t": float(i),
            "data": {
                "ranks": {
                    str(r): {
                        "pid": 1000 + r,
                        "cpu_pct": cpu_pct,
                        "rss_bytes": rss_bytes,
                        "threads": 4,
                    }
                    for r in range(nproc)
                },
                "system": {
                    "cpu_pct": cpu_pct,
                    "mem_used_bytes": rss_bytes * nproc,
                    "mem_total_bytes": 64 * 2**30,
                    "mem_pct": 1.0,
                },
            },
        }
        for i in range(samples)
    ]
    out: dict[str, Any] = {
        "interval_s": 0.5,
        "duration_s": samples * 0.5,
        "notices": [],
        "errors": {},
        "samples": {"host": samples},
        "host": summarize_host(host_samples),
    }
    if pyspy:
        unknown = set(pyspy) - set(_CATEGORY_SAMPLES)
        if unknown:
            raise ValueError(
                f"unknown py-spy categories {sorted(unknown)}; known: {', '.join(_CATEGORY_SAMPLES)}"
            )
        cats = [c for c, share in pyspy.items() for _ in range(round(share * samples))]
        spy_samples = []
        for i, cat in enumerate(cats):
            frames, active, gil = _CATEGORY_SAMPLES[cat]
            thread = {
                "main": True,
                "name": "MainThread",
                "active": active,
                "owns_gil": gil,
                "frames": [*frames, _LOOP_FRAME],
            }
            spy_samples.append(
                {
                    "t": float(i),
                    "data": {
                        "ranks": {
                            str(r): {"pid": 1000 + r, "threads": [thread]} for r in range(nproc)
                        }
                    },
                }
            )
        out["samples"]["pyspy"] = len(spy_samples)
        out["pyspy"] = summarize_pyspy(spy_samples)
    return out


def synthetic_observation(
    workload: Workload | str | None = None,
    *,
    nproc: int = 2,
    hardware: Hardware | None = None,
    device_type: str = "cpu",
    step_s: float = 0.05,
    spread: float = 0.02,
    steps: int = 8,
    breakdown: Breakdown | Mapping[str, float] | bool = True,
    telemetry: Mapping[str, Any] | None = None,
    pyspy: Mapping[str, float] | None = None,
    graph: bool = True,
    layer_profile: bool = False,
    cache: bool = True,
) -> Observation:
    """An Observation as the orchestrator hands it to ``diagnose`` and ``plan``.

    The model summary and graph are real (traced from the workload); the
    baseline measurement, step breakdown and telemetry are made up from the
    arguments:

    * ``workload`` — a Workload, a workload name (``example:cnn``), or None
      for :func:`tiny_workload`;
    * ``step_s``, ``spread`` — the baseline's median step time and its
      relative step-to-step variation (``steps`` measured steps);
    * ``breakdown`` — a :class:`Breakdown`, fractions of the step per part
      (see :func:`synthetic_breakdown`), True for the defaults
      (80% compute, 10% exposed communication, 5% data, 5% optimizer on
      several ranks), or False for none (not profiled);
    * ``telemetry`` or ``pyspy`` — a ready summary, or py-spy category shares
      for :func:`synthetic_telemetry`;
    * ``layer_profile`` — True to time every layer for real (slower);
    * ``cache`` — give the observation a :class:`MemoryCache` (as in a study).
    """
    spec = "tunekit.testing:tiny_workload"
    if isinstance(workload, str):
        spec, workload = workload, load_workload(workload)
    elif workload is None:
        workload = tiny_workload()
    else:
        spec = f"<{workload.name}>"
    hardware = hardware or tiny_hardware(nproc, device_type)
    model = workload.model()
    example = workload.example_batch(workload.batch_size)[0]
    summary = summarize_model(model, example)
    traced = None
    if graph or layer_profile:
        from tunekit.observe.graph import trace_model

        traced = trace_model(model, example)
    profile = None
    if layer_profile:
        from tunekit.observe.layer_profile import profile_layers

        profile = profile_layers(
            model,
            example,
            traced,
            device="cpu",
            warmup=1,
            repeats=3,
            hardware_fingerprint=hardware.fingerprint(),
        )
    # Deterministic step-to-step variation around the median: +-spread, evenly spaced.
    offsets = [spread * (2 * i / max(steps - 1, 1) - 1) for i in range(steps)]
    times = sorted(step_s * (1 + o) for o in offsets)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    baseline = Measurement(
        step_s=times,
        median_s=statistics.median(times),
        spread_s=q[2] - q[0],
        samples_per_s=workload.batch_size * nproc / statistics.median(times),
    )
    if breakdown is True:
        fractions = dict(DEFAULT_FRACTIONS)
        if nproc < 2:  # one rank: no communication, that share is compute
            fractions["compute"] += fractions.pop("comm_exposed")
        breakdown = synthetic_breakdown(step_s, fractions, nproc=nproc)
    elif breakdown is False:
        breakdown = None
    elif isinstance(breakdown, Mapping):
        breakdown = synthetic_breakdown(step_s, breakdown, nproc=nproc)
    if telemetry is None and pyspy is not None:
        telemetry = synthetic_telemetry(pyspy, nproc=nproc)
    return Observation(
        workload_spec=spec,
        workload=workload,
        nproc=nproc,
        backend="nccl" if device_type == "cuda" else "gloo",
        device_type=device_type,
        hardware=hardware,
        model=summary,
        baseline=baseline,
        graph=traced,
        layer_profile=profile,
        breakdown=breakdown,
        telemetry=dict(telemetry) if telemetry is not None else None,
        cache=MemoryCache() if cache else None,
    )


# == session state: what a runtime hook may change and reset must restore ==================


def torch_flags() -> dict[str, Any]:
    """Process-wide torch settings a hook might flip (and must put back)."""
    b = torch.backends
    flags = {
        "cudnn.enabled": b.cudnn.enabled,
        "cudnn.benchmark": b.cudnn.benchmark,
        "cudnn.deterministic": b.cudnn.deterministic,
        "cudnn.allow_tf32": b.cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": b.cuda.matmul.allow_tf32,
        "cuda.matmul.allow_fp16_reduced_precision_reduction": b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "mkldnn.enabled": b.mkldnn.enabled,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "num_threads": torch.get_num_threads(),
        "grad_enabled": torch.is_grad_enabled(),
        "anomaly_detection": torch.is_anomaly_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
    }
    return flags


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _public_settings(obj: Any) -> dict[str, Any]:
    """An object's public attributes with plain values (a strategy's settings)."""
    return {k: v for k, v in sorted(vars(obj).items()) if not k.startswith("_") and _plain(v)}


def _qualname(obj: Any) -> str | None:
    if obj is None:
        return None
    target = getattr(obj, "__func__", obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(obj).__qualname__)}"


_MODULE_HOOKS = {
    "forward": "_forward_hooks",
    "forward_pre": "_forward_pre_hooks",
    "backward": "_backward_hooks",
    "backward_pre": "_backward_pre_hooks",
    "state_dict": "_state_dict_hooks",
    "load_state_dict_pre": "_load_state_dict_pre_hooks",
}


def _hook_counts(module: nn.Module) -> dict[str, int]:
    """Hooks registered on ``module``, by kind (kinds with none left out)."""
    counts = {kind: len(getattr(module, attr, None) or {}) for kind, attr in _MODULE_HOOKS.items()}
    return {kind: n for kind, n in counts.items() if n}


def _param_hook_counts(p: torch.Tensor) -> dict[str, int]:
    counts = {
        "grad": len(p._backward_hooks or {}),
        "post_accumulate_grad": len(getattr(p, "_post_accumulate_grad_hooks", None) or {}),
    }
    return {kind: n for kind, n in counts.items() if n}


@dataclass
class SessionState:
    """A comparable picture of a session's state.

    ``identity`` holds object ids (comparable within one session only);
    ``structure`` holds types, settings, shapes and hook counts (comparable
    across sessions).
    """

    identity: dict[str, Any]
    structure: dict[str, Any]


def snapshot_session(session: Session) -> SessionState:
    """What a runtime hook may change, in a form :func:`compare_states` can diff."""
    model, opt, data = session.model, session.optimizer, session.data
    params = list(model.named_parameters())
    mod = nn.modules.module
    structure: dict[str, Any] = {
        "model.modules": [(n, type(m).__qualname__) for n, m in model.named_modules()],
        "model.training": model.training,
        "model.forward overridden on": [
            n or "<root>" for n, m in model.named_modules() if "forward" in vars(m)
        ],
        "model.parameters": [
            (n, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad) for n, p in params
        ],
        "model.buffers": [
            (n, tuple(b.shape), str(b.dtype), str(b.device)) for n, b in model.named_buffers()
        ],
        "module hooks": {
            n or "<root>": c for n, m in model.named_modules() if (c := _hook_counts(m))
        },
        "parameter hooks": {n: c for n, p in params if (c := _param_hook_counts(p))},
        "global module hooks": {
            name: len(getattr(mod, name))
            for name in (
                "_global_forward_hooks",
                "_global_forward_pre_hooks",
                "_global_backward_hooks",
                "_global_backward_pre_hooks",
            )
            if hasattr(mod, name)
        },
        "optimizer.type": type(opt).__qualname__,
        "optimizer.lr per group": [g["lr"] for g in opt.param_groups],
        "optimizer.group sizes": [len(g["params"]) for g in opt.param_groups],
        "optimizer hooks": (
            len(getattr(opt, "_optimizer_step_pre_hooks", {})),
            len(getattr(opt, "_optimizer_step_post_hooks", {})),
        ),
        "session.batch_size": session.batch_size,
        "session.dp_world_size": getattr(session, "dp_world_size", session.world_size),
        "session.lr": session.lr,
        "session.step_fn": _qualname(session.step_fn),
        "session.grad_sync": (
            type(session.grad_sync).__qualname__,
            _public_settings(session.grad_sync),
        ),
        "session.config": session.config.canonical(),
        "session.reset callbacks": len(getattr(session, "_reset_callbacks", ())),
        "data.type": type(data).__qualname__,
        "data.batch_size": data.batch_size,
        "data.options": asdict(data.options),
        "torch flags": torch_flags(),
    }
    identity = {
        "session.model": id(model),
        "model parameters": [id(p) for _, p in params],
        "session.optimizer": id(opt),
        "optimizer parameters": [id(p) for g in opt.param_groups for p in g["params"]],
        "session.data": id(data),
        "session.workload": id(session.workload),
    }
    return SessionState(identity, structure)


def compare_states(
    expected: SessionState, actual: SessionState, *, identity: bool = True
) -> list[str]:
    """Lines naming each difference (empty when the states match)."""
    out = []
    for key, want in expected.structure.items():
        got = actual.structure.get(key)
        if got != want:
            out.append(_describe_difference(key, want, got))
    if identity:
        for key, want in expected.identity.items():
            if actual.identity.get(key) != want:
                out.append(f"{key} is a different object than before")
    return out


class _Absent:
    def __repr__(self) -> str:
        return "none"


_ABSENT = _Absent()


def _describe_difference(key: str, want: Any, got: Any) -> str:
    parts = _differences(want, got)
    if len(parts) == 1 and not isinstance(want, dict | tuple | list):
        text = f"{key} changed: {parts[0]}"
    else:
        text = f"{key} changed ({'; '.join(parts[:6])}{'; ...' if len(parts) > 6 else ''})"
    return text if len(text) < 400 else text[:397] + "..."


def _differences(want: Any, got: Any) -> list[str]:
    """``a -> b`` for each differing leaf: dict keys are named, equal-length sequences walked."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got), key=str):
            a, b = want.get(k, _ABSENT), got.get(k, _ABSENT)
            if a != b:
                inner = (
                    _differences(a, b)
                    if isinstance(a, dict) and isinstance(b, dict)
                    else [f"{a!r} -> {b!r}"]
                )
                out += [f"{k}: {d}" for d in inner]
        return out
    if isinstance(want, tuple | list) and isinstance(got, tuple | list) and len(want) == len(got):
        walked = [d for a, b in zip(want, got, strict=True) if a != b for d in _differences(a, b)]
        if walked and all(
            isinstance(a, dict | tuple | list) for a, b in zip(want, got, strict=True) if a != b
        ):
            return walked
    return [f"{want!r} -> {got!r}"]


def _param_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def _changed_params(before: Mapping[str, torch.Tensor], model: nn.Module) -> list[str]:
    now = dict(model.named_parameters())
    return [
        n for n, v in before.items() if n not in now or not torch.equal(v, now[n].detach().cpu())
    ]


SINGLETON_THREADS = ("tqdm_monitor",)
"""Process-wide helper threads libraries start once (not a per-trial leak)."""


def _python_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name not in SINGLETON_THREADS}


def _children() -> set[int]:
    """Live child processes, minus multiprocessing's own long-lived helpers."""
    out = set()
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "resource_tracker" in cmd or "semaphore_tracker" in cmd or "forkserver" in cmd:
            continue
        out.add(child.pid)
    return out


def _leftovers(
    threads: set[threading.Thread], children: set[int], grace_s: float = 5.0
) -> list[str]:
    """Threads and processes started since ``threads``/``children`` that outlive a reset."""
    deadline = time.monotonic() + grace_s
    while True:
        new_threads = [t for t in _python_threads() - threads if t.is_alive()]
        new_children = _children() - children
        if (not new_threads and not new_children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out = []
    if new_threads:
        out.append(
            f"left {len(new_threads)} thread(s) running: {', '.join(sorted(t.name for t in new_threads))}"
        )
    if new_children:
        out.append(
            f"left {len(new_children)} child process(es) running (pids {sorted(new_children)})"
        )
    return out


# == conformance ==========================================================================


class ConformanceError(AssertionError):
    """A plugin does not honour the tuner contract; the message lists every problem."""


@dataclass
class ConformanceReport:
    """What :func:`check_conformance` saw, for further assertions in a plugin's own tests."""

    plugin: str
    diagnosis: Diagnosis | None = None
    candidates: list[Candidate] = field(default_factory=list)
    knob_sets: list[dict[str, Any]] = field(default_factory=list)
    """The validated knob values whose runtime hook was checked, in order."""
    losses: list[list[float]] = field(default_factory=list)
    """Per checked knob set, the losses of the steps trained under it."""
    search: SearchResult | None = None
    problems: list[str] = field(default_factory=list)

    def fail_if_problems(self) -> None:
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            raise ConformanceError(f"plugin {self.plugin!r} breaks the tuner contract:\n{lines}")


_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_HOOKS = ("knobs", "diagnose", "plan", "apply", "search", "snippet", "explain")


def check_declaration(tuner: Tuner) -> list[str]:
    """Phase 1: class attributes, hook signatures, knobs with types, ranges and valid defaults."""
    problems: list[str] = []
    cls = type(tuner)
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        problems.append(f"name {name!r} must be lower_case_with_underscores (it is a config key)")
    if not getattr(cls, "title", None):
        problems.append("declares no title")
    aspect = getattr(cls, "aspect", None)
    if not isinstance(aspect, Aspect):
        problems.append(f"aspect {aspect!r} is not a tunekit.contract.Aspect")
    excludes = getattr(cls, "excludes", frozenset())
    if not all(isinstance(a, Aspect) for a in excludes):
        problems.append(f"excludes {excludes!r} must hold tunekit.contract.Aspect values")
    elif aspect in excludes:
        problems.append(f"excludes its own aspect {aspect}")
    if getattr(cls, "api_version", None) != API_VERSION[0]:
        problems.append(
            f"api_version {getattr(cls, 'api_version', None)!r}: this tunekit speaks {API_VERSION[0]}"
        )
    for hook in _HOOKS:
        want = list(inspect.signature(getattr(Tuner, hook)).parameters)
        got = list(inspect.signature(getattr(cls, hook)).parameters)
        if got != want:
            problems.append(f"{hook}{tuple(got)} does not match the contract's {hook}{tuple(want)}")
    try:
        knobs = list(tuner.knobs())
    except Exception as exc:
        return [*problems, f"knobs() raised {type(exc).__name__}: {exc}"]
    names = [getattr(k, "name", None) for k in knobs]
    if len(set(names)) != len(names):
        problems.append(
            f"declares a knob name twice: {sorted(n for n in names if names.count(n) > 1)}"
        )
    for k in knobs:
        if not isinstance(k, Knob):
            problems.append(f"knobs() returned {k!r}, not a tunekit.contract.Knob")
            continue
        where = f"knob {k.name!r}"
        if not k.name.isidentifier():
            problems.append(f"{where}: name must be an identifier")
        if not k.help.strip():
            problems.append(f"{where}: no help line (shown by `tunekit plugins --knobs`)")
        if k.type in ("int", "float"):
            if k.low is None or k.high is None:
                problems.append(f"{where}: {k.type} knobs must declare both low and high")
            elif k.low > k.high:
                problems.append(f"{where}: low {k.low} is above high {k.high}")
        if k.type == "choice" and len(set(k.choices)) != len(k.choices):
            problems.append(f"{where}: repeated choices {k.choices}")
        try:
            k.check(k.default)
        except Exception as exc:
            problems.append(f"{where}: default {k.default!r} is not valid: {exc}")
    if not problems:
        try:
            if tuner.validate({}) != tuner.defaults():
                problems.append("validate({}) does not give the defaults")
        except Exception as exc:
            problems.append(f"validate({{}}) raised {type(exc).__name__}: {exc}")
    return problems


def _json_problem(what: str, value: Any) -> list[str]:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        return [f"{what} is not JSON-able (the study store keeps it as JSON): {exc}"]
    return []


def check_diagnose_and_plan(
    tuner: Tuner,
    obs: Observation,
    limit: int = 4,
    expect_candidates: bool | None = None,
) -> tuple[list[str], Diagnosis | None, list[Candidate]]:
    """Phases 2 and 3: a Diagnosis, and candidates that validate and carry predictions.

    ``expect_candidates``: None (default) requires at least one candidate
    when the diagnosis applies; True always; False never.
    """
    problems: list[str] = []
    try:
        diag = tuner.diagnose(obs)
    except Exception as exc:
        return [f"diagnose raised {type(exc).__name__}: {exc}"], None, []
    if not isinstance(diag, Diagnosis):
        return (
            [f"diagnose returned {type(diag).__name__}, not a tunekit.contract.Diagnosis"],
            None,
            [],
        )
    if not isinstance(diag.applies, bool):
        problems.append(f"Diagnosis.applies is {diag.applies!r}, not a bool")
    if not isinstance(diag.summary, str) or not diag.summary.strip():
        problems.append("Diagnosis.summary is empty (people read it in the report)")
    gain = diag.expected_gain
    if gain is not None and not (
        isinstance(gain, int | float) and math.isfinite(gain) and 0 <= gain <= 1
    ):
        problems.append(
            f"Diagnosis.expected_gain {gain!r} is not a fraction of step time in [0, 1]"
        )
    problems += _json_problem("Diagnosis.details", diag.details)
    if not diag.applies and expect_candidates is not True:
        return problems, diag, []
    try:
        candidates = tuner.plan(obs, limit)
    except Exception as exc:
        return [*problems, f"plan raised {type(exc).__name__}: {exc}"], diag, []
    if not isinstance(candidates, list):
        return [*problems, f"plan returned {type(candidates).__name__}, not a list"], diag, []
    if len(candidates) > limit:
        problems.append(f"plan returned {len(candidates)} candidates for limit={limit}")
    if not candidates and expect_candidates is not False:
        problems.append("the diagnosis applies but plan returned no candidates")
    for i, c in enumerate(candidates):
        where = f"candidate {i}"
        if not isinstance(c, Candidate):
            problems.append(f"{where} is {type(c).__name__}, not a tunekit.contract.Candidate")
            continue
        try:
            tuner.validate(c.knobs)
        except Exception as exc:
            problems.append(f"{where} knobs {c.knobs!r} do not validate: {exc}")
        p = c.predicted_step_s
        if not (
            isinstance(p, int | float) and not isinstance(p, bool) and math.isfinite(p) and p > 0
        ):
            problems.append(
                f"{where} carries no prediction (predicted_step_s={p!r}); the cost model must price it"
            )
        problems += _json_problem(f"{where} details", c.details)
        for hook, arg in (("snippet", c.knobs), ("explain", c)):
            try:
                text = getattr(tuner, hook)(tuner.validate(c.knobs) if hook == "snippet" else arg)
            except Exception as exc:
                problems.append(f"{hook}({where}) raised {type(exc).__name__}: {exc}")
                continue
            if text is not None and not isinstance(text, str):
                problems.append(f"{hook}({where}) returned {type(text).__name__}, not str or None")
    return problems, diag, candidates


def _tuner_path(tuner: Tuner) -> str:
    cls = type(tuner)
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_tuner(path: str) -> Tuner:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj()


def _any_rank(flag: bool, world: int) -> bool:
    """Whether ``flag`` holds on any rank: ranks must take the same path through the checks."""
    if world <= 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _close(session: Session) -> list[str]:
    try:
        session.close()
    except Exception as exc:
        return [f"session.close() raised {type(exc).__name__}: {exc}"]
    return []


def _one_trial(
    session: Session,
    tuner: Tuner,
    knobs: Mapping[str, Any],
    steps: int,
    fresh: SessionState,
    threads: set[threading.Thread],
    children: set[int],
) -> tuple[list[str], SessionState | None, list[float]]:
    """Apply ``knobs``, train, reset; return the problems, the applied state and the losses."""
    label = f"knobs {dict(knobs)}"
    before = _param_values(session.model)
    try:
        session.apply_config(TuningConfig({tuner.name: dict(knobs)}), {tuner.name: tuner})
    except Exception as exc:
        return [f"apply with {label} raised {type(exc).__name__}: {exc}"], None, []
    problems = []
    applied = snapshot_session(session)
    changed = _changed_params(before, session.model)
    if changed:
        problems.append(
            f"apply with {label} changed parameter values ({', '.join(changed[:4])}); "
            "model state must carry over"
        )
    losses: list[float] = []
    try:
        for _ in range(steps):
            losses.append(session.train_step().loss)
    except Exception as exc:
        return (
            [*problems, f"training under {label} raised {type(exc).__name__}: {exc}"],
            applied,
            losses,
        )
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"training under {label} gave non-finite losses {losses}")
    session.flush()
    trained = _param_values(session.model)
    try:
        session.reset()
    except Exception as exc:
        return (
            [*problems, f"session.reset() after {label} raised {type(exc).__name__}: {exc}"],
            applied,
            losses,
        )
    diffs = compare_states(fresh, snapshot_session(session)) + _leftovers(threads, children)
    problems += [f"after {label} and session.reset(): {d}" for d in diffs]
    changed = _changed_params(trained, session.model)
    if changed:
        problems.append(
            f"session.reset() after {label} changed parameter values ({', '.join(changed[:4])})"
        )
    return problems, applied, losses


def _runtime_problems(
    tuner: Tuner,
    workload: Workload,
    knob_sets: Sequence[Mapping[str, Any]],
    steps: int,
    search_steps: int | None,
    rank: int,
    world: int,
    device: str = "cpu",
) -> tuple[list[str], list[list[float]], SearchResult | None]:
    """Apply, train, reset, in the sequence A, B, A (then B on a fresh session); diff every state."""
    problems: list[str] = []
    losses: list[list[float]] = []
    found = None
    session = Session(workload, rank=rank, world_size=world, device=torch.device(device))
    fresh = snapshot_session(session)
    threads, children = _python_threads(), _children()
    sequence = list(knob_sets) + ([knob_sets[0]] if len(knob_sets) > 1 else [])
    applied: list[SessionState | None] = []
    try:
        for i, knobs in enumerate(sequence):
            trial_problems, state, run = _one_trial(
                session, tuner, knobs, steps, fresh, threads, children
            )
            problems += trial_problems
            applied.append(state)
            if i < len(knob_sets):
                losses.append(run)
            if _any_rank(bool(problems), world):
                break  # later trials would only repeat what this one left behind
        if not _any_rank(bool(problems), world) and len(knob_sets) > 1:
            problems += _leak_problems(tuner, workload, knob_sets, applied, rank, world, device)
        if (
            not _any_rank(bool(problems), world)
            and search_steps is not None
            and (type(tuner).search is not Tuner.search)
        ):
            found, search_problems = _search_problems(tuner, session, knob_sets[0], search_steps)
            problems += search_problems
    finally:
        problems += _close(session)
    return problems, losses, found


def _leak_problems(
    tuner: Tuner,
    workload: Workload,
    knob_sets: Sequence[Mapping[str, Any]],
    applied: list[SessionState | None],
    rank: int,
    world: int,
    device: str,
) -> list[str]:
    """A applied twice gives one state; B after A gives the state B gives in a fresh trial."""
    a, b = dict(knob_sets[0]), dict(knob_sets[1])
    problems = [
        f"applying {a} a second time differs from the first: {d}"
        for d in compare_states(applied[0], applied[-1], identity=False)
    ]
    # A fresh trial: a new session and, where it can be built without arguments, a new tuner.
    other = Session(workload, rank=rank, world_size=world, device=torch.device(device))
    try:
        other.apply_config(TuningConfig({tuner.name: b}), {tuner.name: _fresh(tuner)})
        problems += [
            f"{b} applied after {a} differs from it applied to a fresh session: {d}"
            for d in compare_states(snapshot_session(other), applied[1], identity=False)
        ]
    finally:
        problems += _close(other)
    return problems


def _fresh(tuner: Tuner) -> Tuner:
    try:
        return type(tuner)()
    except TypeError:
        return tuner


def _search_problems(
    tuner: Tuner,
    session: Session,
    knobs: Mapping[str, Any],
    max_steps: int,
) -> tuple[SearchResult | None, list[str]]:
    session.apply_config(TuningConfig({tuner.name: dict(knobs)}), {tuner.name: tuner})
    start = session.step
    try:
        found = tuner.search(session, knobs, max_steps)
    except Exception as exc:
        return None, [f"search raised {type(exc).__name__}: {exc}"]
    problems = []
    if session.step - start > max_steps:
        problems.append(
            f"search trained {session.step - start} steps, more than max_steps={max_steps}"
        )
    if found is None:
        return None, problems
    if not isinstance(found, SearchResult):
        return None, [
            *problems,
            f"search returned {type(found).__name__}, not a SearchResult or None",
        ]
    try:
        tuner.validate(found.knobs)
    except Exception as exc:
        problems.append(f"search settled on knobs that do not validate: {exc}")
    problems += _json_problem("SearchResult.trace", found.trace)
    problems += _json_problem("SearchResult.details", found.details)
    session.reset()
    return found, problems


def _runtime_rank(
    rank: int,
    world: int,
    tuner_path: str,
    workload_spec: str,
    knob_sets: list[dict[str, Any]],
    steps: int,
    search_steps: int | None,
    device: str,
) -> list[str]:
    tuner = _load_tuner(tuner_path)
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    problems, _, _ = _runtime_problems(
        tuner, load_workload(workload_spec), knob_sets, steps, search_steps, rank, world, device
    )
    return problems


def check_runtime(
    tuner: Tuner,
    knob_sets: Sequence[Mapping[str, Any]],
    workload: Workload | str | None = None,
    *,
    nproc: int = 1,
    steps: int = 2,
    search_steps: int | None = None,
    device: str = "cpu",
) -> tuple[list[str], list[list[float]], SearchResult | None]:
    """Phase 4: the runtime hook on a real Session, undone by reset, leaking nothing.

    With the knob sets A, B (validated here), on one session: apply A, train
    ``steps`` steps, reset; apply B, train, reset; apply A again, reset. After
    every reset the session must equal a fresh one (the same model,
    parameters, optimizer and data objects; no hooks, threads or processes
    left; grad sync, batch size, learning rate, step function, loader options
    and torch flags back to the defaults); applying must not change parameter
    values, nor resetting. A applied twice must give the same state, and B
    applied after A the state B gives on a fresh session. Then, if the tuner
    has a ``search`` and ``search_steps`` is given, the search runs for at
    most that many steps and must settle on knobs that validate.

    ``nproc=1`` runs in this process inside a one-rank gloo group (so DDP and
    collectives work); ``nproc>1`` runs on real gloo ranks via
    :func:`run_ranks`, which needs the tuner class importable by name and
    ``workload`` given by name. ``device="cuda"`` trains on the GPU (each
    rank on GPU ``rank % count``).
    """
    knob_sets = [tuner.validate(k) for k in knob_sets]
    if not knob_sets:
        raise ValueError("check_runtime needs at least one knob set")
    if nproc > 1:
        spec = workload if isinstance(workload, str) else "tunekit.testing:tiny_workload"
        if workload is not None and not isinstance(workload, str):
            raise ValueError(
                "with nproc > 1 give the workload by name (module:fn), so ranks can build it"
            )
        results = run_ranks(
            _runtime_rank,
            nproc,
            (_tuner_path(tuner), spec, knob_sets, steps, search_steps, device),
            timeout_s=300,
        )
        problems = []
        for rank, rank_problems in enumerate(results):
            problems += [f"rank {rank}: {p}" for p in rank_problems]
        return problems, [], None
    wl = load_workload(workload) if isinstance(workload, str) else (workload or tiny_workload())
    with single_rank_group():
        return _runtime_problems(
            tuner, wl, knob_sets, steps, search_steps, dist.get_rank(), 1, device
        )


def check_conformance(
    tuner: Tuner,
    obs: Observation | None = None,
    *,
    workload: Workload | str | None = None,
    knob_sets: Sequence[Mapping[str, Any]] | None = None,
    nproc: int = 1,
    limit: int = 4,
    steps: int = 2,
    expect_candidates: bool | None = None,
    search_steps: int | None = 6,
    device: str = "cpu",
) -> ConformanceReport:
    """Check ``tuner`` against the contract, phase by phase; raise :class:`ConformanceError` on any problem.

    * declare — name, title, aspect, api_version, hook signatures; every knob
      typed, int and float knobs with both bounds, defaults valid;
    * diagnose — returns a Diagnosis with a summary, a gain in [0, 1] or
      None, JSON-able details;
    * plan — at most ``limit`` Candidates (at least one when the diagnosis
      applies, unless ``expect_candidates=False``), each with knobs that
      validate and a predicted step time; ``snippet`` and ``explain`` return
      text or None;
    * runtime — see :func:`check_runtime`, with ``knob_sets`` (default: the
      first two candidates, or the defaults and the first candidate, or the
      defaults alone).

    ``obs`` defaults to :func:`synthetic_observation` of ``workload`` at
    ``nproc`` ranks; ``workload`` defaults to :func:`tiny_workload`;
    ``device="cuda"`` runs the runtime checks on the GPU. Returns a
    :class:`ConformanceReport` for further assertions.
    """
    report = ConformanceReport(getattr(type(tuner), "name", type(tuner).__name__))
    report.problems += check_declaration(tuner)
    if report.problems:
        report.fail_if_problems()
    if obs is None:
        obs = synthetic_observation(workload, nproc=nproc)
    problems, report.diagnosis, report.candidates = check_diagnose_and_plan(
        tuner, obs, limit, expect_candidates
    )
    report.problems += problems
    if report.problems:
        report.fail_if_problems()
    if knob_sets is None:
        proposed = [c.knobs for c in report.candidates[:2]]
        knob_sets = proposed if len(proposed) == 2 else [tuner.defaults(), *proposed]
    report.knob_sets = [tuner.validate(k) for k in knob_sets]
    runtime_workload = workload if workload is not None else (obs.workload if nproc == 1 else None)
    problems, report.losses, report.search = check_runtime(
        tuner,
        report.knob_sets,
        runtime_workload,
        nproc=nproc,
        steps=steps,
        search_steps=search_steps,
        device=device,
    )
    report.problems += problems
    report.fail_if_problems()
    return report


# -- toy transformers (example:gpt's and example:vit's models at toy size) ---------------------------------------


TINY_GPT = {"vocab": 64, "width": 16, "heads": 4, "blocks": 2, "seq": 8}


def tiny_gpt_workload():
    """:class:`~tunekit.examples.transformers.GPTModel` at toy size (4 sequences of 8 tokens
    per rank), trained as ``example:gpt`` is: AdamW, warm-up + cosine, clipping at 1.0."""
    from tunekit.examples.transformers import GPTModel, _adamw, _lm_loss, warmup_cosine
    from tunekit.workload import Workload

    vocab, seq = TINY_GPT["vocab"], TINY_GPT["seq"]

    def make_batch(n, gen):
        start = torch.randint(vocab, (n, 1), generator=gen)
        stride = torch.randint(1, 4, (n, 1), generator=gen)
        text = (start + stride * torch.arange(seq + 1)) % vocab
        return text[:, :-1], text[:, 1:]

    return Workload(
        name="tiny_gpt",
        model=lambda: GPTModel(**TINY_GPT),
        make_batch=make_batch,
        loss=_lm_loss,
        optimizer=_adamw,
        batch_size=4,
        lr=3e-3,
        scheduler=lambda opt: warmup_cosine(opt, warmup=2, total=10),
        clip_grad_norm=1.0,
    )


TINY_VIT = {"image": 8, "patch": 4, "width": 16, "heads": 2, "blocks": 2, "classes": 10}


def tiny_vit_workload():
    """:class:`~tunekit.examples.transformers.ViT` at toy size (4 images of 8x8 in 4x4
    patches per rank), AdamW, warm-up + cosine, clipping at 1.0."""
    from tunekit.examples.transformers import ViT, _adamw, warmup_cosine
    from tunekit.workload import Workload

    def make_batch(n, gen):
        x = torch.randn(n, 3, TINY_VIT["image"], TINY_VIT["image"], generator=gen)
        return x, torch.randint(TINY_VIT["classes"], (n,), generator=gen)

    return Workload(
        name="tiny_vit",
        model=lambda: ViT(**TINY_VIT),
        make_batch=make_batch,
        optimizer=_adamw,
        batch_size=4,
        lr=3e-3,
        scheduler=lambda opt: warmup_cosine(opt, warmup=2, total=10),
        clip_grad_norm=1.0,
    )
