"""Runtime hooks: what the knobs do inside each worker, and the measurements the sweep takes there."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tunekit.api import Session, is_out_of_memory, release_memory
from tunekit.plugins.batch_ps_sizing.measure import PeakMeter
from tunekit.plugins.batch_ps_sizing.model import NoiseScale, noise_scale_from_norms


def apply_batch_knobs(session: Session, knobs: Mapping[str, Any]) -> None:
    """Set the micro-batches per step and the per-rank batch (0 keeps the workload's) and
    cuDNN benchmarking.

    ``Session.set_batch_size`` refuses a batch outside the workload's
    ``batch_range``, rebuilds the data source and rescales the learning rate
    by the workload's rule; the session's reset restores both. A batch and an
    accumulation whose product is the job's keep the samples of every step.
    """
    acc = int(knobs.get("accumulation", 0))
    if acc and acc != session.accumulation:
        session.set_accumulation(acc)
    batch = int(knobs.get("batch_size", 0))
    if batch and batch != session.batch_size:
        session.set_batch_size(batch)
    benchmark = bool(knobs.get("cudnn_benchmark", False))
    if torch.backends.cudnn.benchmark != benchmark:
        previous = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = benchmark
        session.on_reset(lambda: setattr(torch.backends.cudnn, "benchmark", previous))


def device_memory_bytes(session: Session) -> float | None:
    """What a rank may hold: a GPU's total memory, or the session's memory cap
    (``--memory-cap``) when it is smaller or on the CPU; None on an uncapped CPU, where the
    sweep relies on real allocation failures."""
    device, cap = session.device, session.memory.cap_bytes
    total = (
        float(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cuda"
        else None
    )
    if cap is not None:
        return float(cap) if total is None else min(total, float(cap))
    return total


@dataclass
class ProbeResult:
    ok: bool
    oom: bool = False
    peak_bytes: float | None = None
    error: str = ""


def probe_batch(session: Session, limit_bytes: float = float("inf")) -> ProbeResult:
    """Forward and backward of this rank's next batch on the bare model; never raises.

    Runs no collective (the bare module, not its DDP wrapper) and updates
    nothing: gradients are dropped and buffers (batch-norm statistics) restored.
    A peak (with what was allocated before) above ``limit_bytes`` counts as out of memory.
    """
    model = session.model
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    result: ProbeResult
    try:
        meter = PeakMeter(session.device)
        with meter:
            inputs, targets = session.data.batch(session.step)
            loss = session.workload.loss(model(inputs), targets)
            loss.backward()
            del loss, inputs, targets
        peak = meter.peak_bytes
        if peak is not None and meter.start_bytes + peak > limit_bytes:
            result = ProbeResult(
                False, oom=True, peak_bytes=peak, error=f"peak {peak:.0f} B over the limit"
            )
        else:
            result = ProbeResult(True, peak_bytes=peak)
    except Exception as exc:  # reported to every rank, never left to strand them
        first_line = (str(exc).splitlines() or [""])[0][:300]
        result = ProbeResult(
            False, oom=is_out_of_memory(exc), error=f"{type(exc).__name__}: {first_line}"
        )
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
    if not result.ok:
        release_memory(session.device)
    return result


# -- gradient noise scale ------------------------------------------------------------


@dataclass
class NoiseSums:
    """Running sums for the two-batch estimator; add them across ranks, then :meth:`estimate`."""

    b_small: float
    b_big: float
    sq_small: float = 0.0
    sq_big: float = 0.0
    count: int = 0

    def estimate(self) -> NoiseScale | None:
        if self.count == 0:
            return None
        return noise_scale_from_norms(
            self.b_small,
            self.sq_small / self.count,
            self.b_big,
            self.sq_big / self.count,
            self.count,
        )


def gradient_noise_sums(
    model: nn.Module, loss_fn, batches: Iterable[tuple[Any, torch.Tensor]], parts: int = 2
) -> NoiseSums | None:
    """Split each batch into ``parts`` equal micro-batches and sum |g_small|^2 and |g_big|^2.

    g_small is one micro-batch's mean-loss gradient (batch n/parts), g_big
    their mean (batch n). Nothing is updated; gradients are dropped and
    buffers restored afterwards. None when a batch is too small to split.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    sums: NoiseSums | None = None
    try:
        for inputs, targets in batches:
            n = targets.shape[0] // parts
            if n < 1:
                return None
            if sums is None:
                sums = NoiseSums(b_small=n, b_big=n * parts)
            total = None
            sq_small = 0.0
            for i in range(parts):
                sl = slice(i * n, (i + 1) * n)
                model.zero_grad(set_to_none=True)
                loss_fn(model(_take(inputs, sl)), targets[sl]).backward()
                g = torch.cat(
                    [
                        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                        for p in params
                    ]
                )
                sq_small += float(g.double().square().sum())
                total = g.double() if total is None else total + g.double()
            sums.sq_small += sq_small / parts
            sums.sq_big += float((total / parts).square().sum())
            sums.count += 1
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
    return sums


def session_noise_sums(session: Session, batches: int) -> NoiseSums | None:
    """Noise-scale sums over this rank's next ``batches`` batches (the data the job will train on)."""
    data = (session.data.batch(session.step + i) for i in range(batches))
    return gradient_noise_sums(session.model, session.workload.loss, data)


def _take(x, sl: slice):
    if isinstance(x, torch.Tensor):
        return x[sl]
    if isinstance(x, tuple | list):
        return type(x)(_take(v, sl) for v in x)
    if isinstance(x, dict):
        return {k: _take(v, sl) for k, v in x.items()}
    return x
