"""E_N and SE_N: how many epochs a global batch of N × B needs, and how well N-way DP scales.

Pal et al. measure E_N by training to a target loss with global batches too
big for their machine, emulated by gradient accumulation ("delayed gradient
update"): :func:`measure_epochs` does that in one process. Beyond the paper,
:func:`estimate_noise_scale` measures the gradient noise scale B_noise
(McCandlish et al., "An Empirical Model of Large-Batch Training", 2018) from
gradients at two batch sizes, and :func:`noise_scale_epochs` turns it into
E_N ∝ 1 + N·B / B_noise, their model of how data efficiency falls with the
batch. SE_N defaults to 1 (the paper's assumption); :func:`allreduce_model`
extrapolates a hardware profile's all-reduce for modelled SE_N.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tunekit.api import BatchSource, Hardware, Workload
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.model import EpochTable

__all__ = [
    "measure_epochs",
    "EpochRun",
    "NoiseScale",
    "estimate_noise_scale",
    "noise_scale_epochs",
    "allreduce_model",
]


@dataclass
class EpochRun:
    """One emulated data-parallel width trained to the target."""

    width: int
    steps: int
    samples: int
    reached: bool
    final_loss: float


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def measure_epochs(
    workload: Workload,
    widths: Sequence[int],
    target_loss: float,
    *,
    max_samples: int = 200_000,
    smoothing: float = 0.9,
    epoch_samples: int | None = None,
    seed: int | None = None,
) -> tuple[EpochTable, list[EpochRun]]:
    """Train to ``target_loss`` at each global batch ``N × B`` by gradient accumulation.

    B is a replica's samples per optimizer step: the workload's batch times its
    ``accumulation``. Each width starts from the same initial parameters; a step
    accumulates the N shards (of ``accumulation`` micro-batches each) an N-rank job would see (:class:`~tunekit.runtime.data.BatchSource`
    with world N) and the learning rate follows the workload's rule for the
    N-fold batch, as the paper scaled it. The loss is smoothed by an
    exponential moving average before it is compared with the target. E_N =
    samples / ``epoch_samples`` (the dataset's length by default; for synthetic
    data, 1000 × B, so only ratios mean anything). A width that does not reach
    the target within ``max_samples`` is reported but left out of the table.
    """
    if not widths:
        raise ConfigError("measure_epochs: give at least one width")
    micro, acc = workload.batch_size, workload.accumulation
    b = micro * acc
    if epoch_samples is None:
        epoch_samples = len(workload.dataset()) if workload.dataset is not None else 1000 * b
    runs: list[EpochRun] = []
    for n in sorted(set(int(w) for w in widths)):
        torch.manual_seed(workload.seed if seed is None else seed)
        model = workload.model()
        model.train()
        opt = workload.optimizer(model.parameters(), workload.lr_for_ratio(n))
        sources = [
            BatchSource(
                workload,
                rank=r,
                world_size=n,
                device=torch.device("cpu"),
                batch_size=micro,
                seed=seed,
            )
            for r in range(n)
        ]
        ema, steps, reached = None, 0, False
        while steps * n * b < max_samples:
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for src in sources:
                for k in range(acc):
                    x, y = src.batch(steps * acc + k)
                    loss = workload.loss(model(x), y) / (n * acc)
                    loss.backward()
                    total += float(loss.detach())
            opt.step()
            steps += 1
            ema = total if ema is None else smoothing * ema + (1 - smoothing) * total
            if ema <= target_loss:
                reached = True
                break
        runs.append(EpochRun(n, steps, steps * n * b, reached, float(ema)))
    table = {r.width: r.samples / epoch_samples for r in runs if r.reached}
    if not table:
        raise ConfigError(
            f"measure_epochs: no width reached loss {target_loss} within {max_samples} samples"
        )
    return EpochTable(table, source="measured"), runs


@dataclass
class NoiseScale:
    """The simple gradient noise scale B_simple = tr(Σ) / |G|²."""

    b_noise: float
    grad_sq: float
    """|G|², the squared norm of the true gradient (estimated)."""
    trace_sigma: float
    """tr(Σ), the per-sample gradient variance (estimated)."""
    small: int
    big: int
    draws: int


def estimate_noise_scale(
    workload: Workload,
    *,
    micro_batches: int = 8,
    draws: int = 4,
    warmup_steps: int = 0,
    seed: int | None = None,
) -> NoiseScale:
    """B_noise from gradients of batches B and K·B (McCandlish et al., Appendix A.1).

    With |G_B|² the squared norm of a batch-B gradient,
    E|G_B|² = |G|² + tr(Σ)/B, so two batch sizes give both unknowns:
    |G|² = (K·B |G_KB|² − B |G_B|²)/(K·B − B) and
    tr(Σ) = (|G_B|² − |G_KB|²)/(1/B − 1/(K·B)). Each draw takes K micro-batches
    of B: their mean gradient is the big batch, their mean squared norm the
    small one. Numerator and denominator are averaged over draws before
    dividing (the ratio of noisy estimates is biased). ``warmup_steps`` SGD
    steps first move off the initial point, where the noise scale is atypical.
    """
    if micro_batches < 2:
        raise ConfigError("estimate_noise_scale: needs at least 2 micro-batches per draw")
    torch.manual_seed(workload.seed if seed is None else seed)
    model = workload.model()
    model.train()
    b = workload.batch_size
    src = BatchSource(
        workload, rank=0, world_size=1, device=torch.device("cpu"), batch_size=b, seed=seed
    )
    opt = workload.optimizer(model.parameters(), workload.lr)
    for s in range(warmup_steps):
        opt.zero_grad(set_to_none=True)
        x, y = src.batch(s)
        workload.loss(model(x), y).backward()
        opt.step()
    small_sq, big_sq = [], []
    step = warmup_steps
    for _ in range(draws):
        grads = []
        for _ in range(micro_batches):
            model.zero_grad(set_to_none=True)
            x, y = src.batch(step)
            step += 1
            workload.loss(model(x), y).backward()
            grads.append(_flat_grad(model).detach().clone())
        g = torch.stack(grads)
        small_sq.append(float((g * g).sum(dim=1).mean()))
        big_sq.append(float(g.mean(dim=0).pow(2).sum()))
    bs, bb = b, micro_batches * b
    gs, gb = sum(small_sq) / draws, sum(big_sq) / draws
    grad_sq = (bb * gb - bs * gs) / (bb - bs)
    trace = (gs - gb) / (1 / bs - 1 / bb)
    if grad_sq <= 0:
        # the true gradient is buried in noise at this point: B_noise beyond what was measured
        return NoiseScale(math.inf, grad_sq, trace, bs, bb, draws)
    return NoiseScale(max(trace, 0.0) / grad_sq, grad_sq, trace, bs, bb, draws)


def noise_scale_epochs(b_noise: float, batch: int, widths: Sequence[int]) -> EpochTable:
    """E_N ∝ 1 + N·B / B_noise (McCandlish et al., Eq. 2.11, with a tuned learning rate)."""
    if not b_noise > 0:
        raise ConfigError(f"noise scale must be positive, not {b_noise}")
    if math.isinf(b_noise):
        return EpochTable({int(n): 1.0 for n in widths}, source="noise-scale")
    return EpochTable({int(n): 1.0 + n * batch / b_noise for n in widths}, source="noise-scale")


def allreduce_model(hw: Hardware) -> Callable[[float, int], float]:
    """All-reduce time of ``bytes`` over ``n`` devices, past the profile's own device count.

    Within the profile: :meth:`Hardware.allreduce_time`. Beyond it, a ring at
    the profile's bottleneck bandwidth and latency (the optimistic case of a
    network as fast as the machine's slowest inter-device path).
    """
    devices = len(hw.devices)

    def time_of(nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        if n <= devices:
            return hw.allreduce_time(nbytes, n)
        ring = list(zip(hw.device_names, hw.device_names[1:] + hw.device_names[:1], strict=True))
        bw = min(hw.path_bandwidth(a, b) for a, b in ring) if devices > 1 else math.inf
        lat = max(sum(lk.latency for lk in hw.route(a, b)) for a, b in ring) if devices > 1 else 0.0
        if math.isinf(bw):
            raise ConfigError(
                f"hardware {hw.name!r} has one device: no link to model an all-reduce"
            )
        return 2 * (n - 1) * lat + 2 * (n - 1) / n * nbytes / bw

    return time_of
