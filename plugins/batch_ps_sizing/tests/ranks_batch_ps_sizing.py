"""Rank functions for this plugin's multi-process tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from tunekit.plugins.batch_ps_sizing.plugin import BatchPsSizing
from tunekit.plugins.batch_ps_sizing.runtime import probe_batch
from tunekit.plugins.batch_ps_sizing.search import SweepSettings, coordinated_sweep
from tunekit.runtime.session import Session
from tunekit.workload import load_workload


class InjectedOOM:
    """A forward pre-hook that fails like the CUDA allocator does, above a batch, on chosen ranks.

    This fakes only the device boundary: CPU ranks never run out of device
    memory, so the allocator's exception is raised where a real one would be.
    """

    def __init__(self, rank: int, failing_ranks: tuple[int, ...], from_batch: int):
        self.active = rank in failing_ranks
        self.from_batch = from_batch
        self.raised = 0

    def __call__(self, _module, inputs):
        if self.active and inputs[0].shape[0] >= self.from_batch:
            self.raised += 1
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"
            )


def sweep_on_ranks(
    rank: int,
    world: int,
    failing_ranks: tuple[int, ...],
    from_batch: int,
    max_steps: int,
    recheck_margin: float = 0.0,
):
    torch.manual_seed(0)
    workload = load_workload("example:cnn")
    session = Session(workload, rank=rank, world_size=world, group=torch.distributed.group.WORLD)
    injected = InjectedOOM(rank, failing_ranks, from_batch)
    session.model.register_forward_pre_hook(injected)
    # recheck_margin 0 (the default here) measures nothing twice: step counts stay exact.
    settings = SweepSettings(
        warmup_steps=1,
        measure_steps=2,
        patience=3,
        noise_scale_batches=0,
        recheck_margin=recheck_margin,
    )
    outcome = coordinated_sweep(session, [8, 16, 32, 64, 128], settings, max_steps, probe_batch)
    session.train_step()  # the job goes on, at the chosen batch, on every rank
    checksum = float(sum(p.detach().double().sum() for p in session.model.parameters()))
    session.close()
    return {
        "batch": outcome.batch,
        "session_batch": session.batch_size,
        "lr": session.lr,
        "points": [(p.batch, p.status, p.oom_ranks) for p in outcome.points],
        "rechecks": [p.recheck for p in outcome.points],
        "throughputs": [p.samples_per_s for p in outcome.points],
        "steps_used": outcome.steps_used,
        "step": session.step,
        "raised": injected.raised,
        "checksum": checksum,
        "reason": outcome.reason,
    }


def search_hook_on_ranks(rank: int, world: int):
    workload = load_workload("example:cnn")
    session = Session(workload, rank=rank, world_size=world, group=torch.distributed.group.WORLD)
    session.model.register_forward_pre_hook(InjectedOOM(rank, (0,), 128))
    # Patience past the ladder's length: the climb must end at the injected OOM, not
    # wherever two busy CPU cores happen to make throughput look flat.
    # A recheck margin of 0.99 measures the two best again whatever they measured.
    settings = SweepSettings(
        warmup_steps=1,
        measure_steps=2,
        patience=10,
        noise_scale_batches=2,
        recheck_margin=0.99,
    )
    tuner = BatchPsSizing(settings)
    knobs = tuner.validate({"knee_tolerance": 0.1})
    tuner.apply(session, knobs)
    result = tuner.search(session, knobs, max_steps=40)
    session.close()
    return {"knobs": result.knobs, "summary": result.summary, "trace": result.trace}
