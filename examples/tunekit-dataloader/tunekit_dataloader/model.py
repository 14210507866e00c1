"""The cost model: what DataLoader worker processes and pinned memory save.

Without workers the training process loads every batch itself, so a step is
``data + rest``. With ``w`` workers, ``w`` batches are prepared in parallel in
other processes while the step trains; the training process only receives
them. Three things bound the step then:

* the training itself: ``rest``;
* the workers' throughput: ``data / w`` (each worker makes one batch per ``data``);
* the cores: training keeps ``busy`` of the rank's ``cores`` cores busy for
  ``rest`` and the workers need ``data`` core-seconds per batch, so
  ``(busy * rest + data) / cores``. CPU ranks compute with all their cores
  (``busy = cores``), which leaves workers only the cores the main process idles
  while it loads a batch single-threaded; a GPU rank keeps about one core busy.

Predicted step = the largest bound + the cost of receiving a batch from a
worker (an estimate; the trials measure the truth). Pinned memory, on a GPU,
turns the staged pageable host-to-device copy into a direct one: it saves
about one copy of the batch at the host link's bandwidth.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tunekit.api import Observation, Session
from tunekit.errors import HardwareError

IPC_FIXED_S = 3e-4
"""Receiving one batch from a worker: queue, unpickling, rebuilding tensors (an estimate)."""
IPC_BYTES_PER_S = 5e9
"""... plus touching the batch's shared memory once (an estimate, about a memcpy)."""
DEFAULT_H2D = 12e9
"""Host-to-device bandwidth when the hardware model has none (PCIe 3 x16, pinned)."""


@dataclass
class LoaderFacts:
    """Where the observed step's time goes, and what the rank has to spare."""

    step_s: float
    """The untuned job's step time."""
    data_s: float
    """Of which the training process spends getting the batch."""
    source: str
    """Where ``data_s`` comes from: step breakdown, py-spy, or steps timed here."""
    cores: float
    """Host cores per rank."""
    busy: float
    """Cores a rank's training keeps busy outside data loading."""
    batch_bytes: int
    """Bytes of one rank's batch (what a worker sends and the device receives)."""
    device_type: str
    h2d_bytes_per_s: float
    flags: list[str]
    """py-spy's flags over the baseline (``data loading: 40% of stack samples``)."""

    @property
    def rest_s(self) -> float:
        return max(self.step_s - self.data_s, 0.0)

    @property
    def data_share(self) -> float:
        return self.data_s / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rest_s": self.rest_s, "data_share": self.data_share}


def ipc_s(batch_bytes: int) -> float:
    """Estimated time for the training process to receive one batch from a worker."""
    return IPC_FIXED_S + batch_bytes / IPC_BYTES_PER_S


def predicted_step_s(facts: LoaderFacts, num_workers: int, pin_memory: bool = False) -> float:
    """Predicted step time with ``num_workers`` loader processes per rank (0: the job as it is)."""
    step = facts.step_s
    if num_workers > 0:
        bounds = (
            facts.rest_s,
            facts.data_s / num_workers,
            (facts.busy * facts.rest_s + facts.data_s) / facts.cores,
        )
        step = max(bounds) + ipc_s(facts.batch_bytes)
    if pin_memory and facts.device_type == "cuda":
        # A pageable copy is staged through a pinned buffer: about one extra pass over the batch.
        step -= facts.batch_bytes / facts.h2d_bytes_per_s
    return step


# -- evidence ------------------------------------------------------------------------------


def loader_facts(obs: Observation) -> LoaderFacts:
    """The observed job's data time (breakdown, else py-spy, else steps timed here) and the rank's cores."""
    batch = obs.workload.example_batch(obs.workload.batch_size)
    batch_bytes = sum(t.numel() * t.element_size() for t in _tensors(batch))
    pyspy = (obs.telemetry or {}).get("pyspy") or {}
    flags = [f for f in pyspy.get("flags", []) if f.startswith("data loading")]
    summary = obs.breakdown.summary() if obs.breakdown is not None else {}
    step_s = obs.baseline.median_s if obs.baseline is not None else None
    if step_s is not None and "data" in summary.get("fractions", {}):
        # Profiled steps run slower than measured ones: take the data's share, not its seconds.
        data_s, source = summary["fractions"]["data"] * step_s, "step breakdown"
    elif step_s is not None and pyspy.get("categories"):
        data_s = pyspy["categories"].get("data_loading", 0.0) * step_s
        source = "py-spy stack samples"
    else:
        measured_step, data_s = time_steps(obs)
        source = "timed in this process"
        step_s = step_s if step_s is not None else measured_step
    cores = obs.hardware.host.cores / max(obs.nproc, 1)
    busy = max(1.0, float(int(cores))) if obs.device_type == "cpu" else 1.0
    return LoaderFacts(
        step_s=step_s,
        data_s=min(data_s, step_s),
        source=source,
        cores=max(cores, 1.0),
        busy=busy,
        batch_bytes=batch_bytes,
        device_type=obs.device_type,
        h2d_bytes_per_s=_h2d(obs),
        flags=flags,
    )


def time_steps(obs: Observation, steps: int = 3) -> tuple[float, float]:
    """Median step time and its data part over a few real steps on one rank here, without workers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, int(obs.hardware.host.cores // max(obs.nproc, 1))))
    session = Session(obs.workload)
    try:
        session.train_step()  # warm-up
        records = [session.train_step() for _ in range(steps)]
    finally:
        session.close()
        torch.set_num_threads(threads)
    return statistics.median(r.step_s for r in records), statistics.median(
        r.data_s for r in records
    )


def _h2d(obs: Observation) -> float:
    if obs.device_type != "cuda" or not obs.hardware.devices:
        return DEFAULT_H2D
    try:
        return obs.hardware.host_bandwidth(obs.hardware.devices[0].name)
    except HardwareError:
        return DEFAULT_H2D


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
