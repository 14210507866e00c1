"""Workloads for the sharding tuner's tests and benchmark: a small GPT (the example's model
at a size that trains in well under a second per step on a CPU) whose activations, not its
parameters, fill most of a rank's memory, as in the jobs the tuner is for.

By name: ``tunekit.plugins.sharding.tests.workloads_sharding:gpt_ddp`` (replicated, no
checkpointing) and ``...:gpt_sharded`` (FSDP2, resharded after forward, every block
checkpointed: how a job is written when replication does not fit).
"""

from __future__ import annotations

import functools
import time

import torch

from tunekit.examples.transformers import GPTModel, _adamw, _lm_loss
from tunekit.workload import Workload

SMALL = {"vocab": 2048, "width": 128, "heads": 4, "blocks": 4, "seq": 64}
"""About 1 M parameters; at 16 sequences a rank, activations are most of the peak."""
TINY = {"vocab": 128, "width": 32, "heads": 2, "blocks": 2, "seq": 16}
"""For tests that only need a transformer to train (milliseconds a step)."""


def _batch(n: int, generator: torch.Generator, dims=SMALL):
    # The example's learnable language: each token the previous plus a stride, with noise.
    vocab, seq = dims["vocab"], dims["seq"]
    start = torch.randint(vocab, (n, 1), generator=generator)
    stride = torch.randint(1, 8, (n, 1), generator=generator)
    noise = (torch.rand(n, seq + 1, generator=generator) < 0.05).long()
    text = (start + stride * torch.arange(seq + 1) + noise) % vocab
    return text[:, :-1], text[:, 1:]


def _workload(name: str, batch_size: int = 16, dims=SMALL, dataset=None, **layout) -> Workload:
    return Workload(
        name=name,
        model=functools.partial(GPTModel, **dims),
        make_batch=None if dataset else functools.partial(_batch, dims=dims),
        dataset=dataset,
        loss=_lm_loss,
        optimizer=_adamw,
        batch_size=batch_size,
        lr=6e-4,
        lr_scaling="sqrt",
        clip_grad_norm=1.0,
        description=f"small GPT ({dims}), {batch_size} sequences per rank",
        **layout,
    )


def gpt_ddp() -> Workload:
    return _workload("gpt-small")


def gpt_sharded() -> Workload:
    return _workload(
        "gpt-small-sharded", sharding="fsdp", reshard_after_forward=True, checkpointing="full"
    )


def gpt_tiny() -> Workload:
    """A tiny GPT, four sequences a rank: for tests that only need the model to train."""
    return _workload("gpt-tiny", batch_size=4, dims=TINY)


class TinyText(torch.utils.data.Dataset):
    """``n`` sequences of :data:`TINY`'s language, each a pure function of its index: a step
    split into micro-batches trains on the samples the whole step would (generated batches
    are drawn anew at each size)."""

    def __init__(self, n: int = 256):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _batch(1, torch.Generator().manual_seed(i), dims=TINY)
        return x[0], y[0]


def gpt_tiny_dataset() -> Workload:
    """:func:`gpt_tiny` fed by a map-style dataset (:class:`TinyText`): for the contract's
    equivalence phase, where a split into micro-batches must see the whole step's samples."""
    return _workload("gpt-tiny-dataset", batch_size=4, dims=TINY, dataset=TinyText)


def gpt_float64() -> Workload:
    """The tiny GPT in float64: a live job relaunched from DDP to FSDP is compared with one
    that stays replicated, step by step, at float64 precision."""
    w = _workload("gpt-tiny-float64", batch_size=4, dims=TINY)
    build = w.model
    w.model = lambda: build().double()
    make = w.make_batch

    def make_batch(n, gen):
        # Each batch waits 50 ms for its data, the maths unchanged: the job's steps outlast
        # the test's apply (unpaced, a loaded machine once saw the job finish its 24 steps
        # before the apply sent at step 4 reached a step boundary).
        time.sleep(0.05)
        return make(n, gen)

    w.make_batch = make_batch
    return w
