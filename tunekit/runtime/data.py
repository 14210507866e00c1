"""Batches as a pure function of (seed, step, rank).

Every rank draws its own shard of a step's global batch, and the shard
depends only on the seed, the step and the rank. So a run resumed at step k,
a run whose config changed at step k, and an uninterrupted run all see the
same data; and a single process can rebuild the global batch of a
multi-rank run (``global_batch``) to check equivalence.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from tunekit.workload import Batch, Workload

_MASK = (1 << 63) - 1


def batch_seed(seed: int, step: int, rank: int) -> int:
    return ((seed * 1_000_003 + step) * 65_537 + rank) & _MASK


@dataclass
class LoaderOptions:
    """Input-pipeline settings (used when the workload has a dataset)."""

    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None


class _StepSampler(Sampler[list[int]]):
    """Index lists of one rank's shard, step after step, from ``start_step``.

    The data order is one permutation per epoch, seeded by (seed, epoch); step s
    takes positions [s*G, (s+1)*G) of the concatenated epochs, rank r the
    slice [r*B, (r+1)*B) of that.
    """

    def __init__(self, n: int, batch: int, rank: int, world: int, seed: int, start_step: int):
        self.n, self.batch, self.rank, self.world = n, batch, rank, world
        self.seed, self.start_step = seed, start_step

    def _perm(self, epoch: int) -> torch.Tensor:
        return torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch)
        )

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        perms: dict[int, torch.Tensor] = {}
        glob = self.batch * self.world
        while True:
            start = step * glob + self.rank * self.batch
            idx = []
            for pos in range(start, start + self.batch):
                epoch, i = divmod(pos, self.n)
                if epoch not in perms:
                    perms.clear()
                    perms[epoch] = self._perm(epoch)
                idx.append(int(perms[epoch][i]))
            yield idx
            step += 1


class BatchSource:
    """This rank's batches, moved to the training device."""

    def __init__(
        self,
        workload: Workload,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        batch_size: int,
        seed: int | None = None,
    ):
        self.workload = workload
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.batch_size = batch_size
        self.seed = workload.seed if seed is None else seed
        self.options = LoaderOptions()
        self._dataset = workload.dataset() if workload.dataset is not None else None
        self._iter: Iterator | None = None
        self._next_step: int | None = None

    # -- settings ------------------------------------------------------------------

    def set_batch_size(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self._iter = None

    def set_options(self, options: LoaderOptions) -> None:
        self.options = options
        self._iter = None

    # -- batches -------------------------------------------------------------------

    def batch(self, step: int) -> Batch:
        """This rank's shard of step ``step``'s global batch, on the device."""
        if self._dataset is None:
            inputs, targets = self._shard(step, self.rank)
        else:
            inputs, targets = self._from_loader(step)
        return to_device(inputs, self.device), to_device(targets, self.device)

    def global_batch(self, step: int) -> Batch:
        """The whole step's batch (every rank's shard, in rank order), on the device."""
        parts = [self._shard(step, r) for r in range(self.world_size)]
        inputs, targets = _cat([p[0] for p in parts]), _cat([p[1] for p in parts])
        return to_device(inputs, self.device), to_device(targets, self.device)

    def _shard(self, step: int, rank: int) -> Batch:
        """Rank ``rank``'s shard of step ``step``, on the CPU, without touching the loader."""
        if self._dataset is None:
            assert self.workload.make_batch is not None  # a workload has one or the other
            gen = torch.Generator().manual_seed(batch_seed(self.seed, step, rank))
            return self.workload.make_batch(self.batch_size, gen)
        sampler = _StepSampler(
            len(self._dataset), self.batch_size, rank, self.world_size, self.seed, step
        )
        idx = next(iter(sampler))
        return torch.utils.data.default_collate([self._dataset[i] for i in idx])

    def _from_loader(self, step: int) -> Batch:
        assert self._dataset is not None  # batch() reads the loader only for a dataset
        if self._iter is None or self._next_step != step:
            sampler = _StepSampler(
                len(self._dataset), self.batch_size, self.rank, self.world_size, self.seed, step
            )
            opts = self.options
            kwargs: dict[str, Any] = {}
            if opts.num_workers > 0:
                # A worker builds what this process would, however it was started (a spawned
                # or forkserver worker starts from float32, not this process's default dtype).
                kwargs["worker_init_fn"] = partial(_as_parent, torch.get_default_dtype())
                if opts.prefetch_factor is not None:
                    kwargs["prefetch_factor"] = opts.prefetch_factor
            loader = DataLoader(
                self._dataset,
                batch_sampler=sampler,
                num_workers=opts.num_workers,
                pin_memory=opts.pin_memory and self.device.type == "cuda",
                persistent_workers=False,
                **kwargs,
            )
            self._iter = iter(loader)
        self._next_step = step + 1
        return next(self._iter)

    def close(self) -> None:
        self._iter = None


def _as_parent(dtype: torch.dtype, worker_id: int) -> None:
    """A loader worker's start: the training process's default dtype."""
    torch.set_default_dtype(dtype)


def to_device(x, device: torch.device):
    """A batch part (a tensor, or tuples, lists and dicts of them) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=x.is_pinned())
    if isinstance(x, tuple | list):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def _cat(parts: list):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, tuple | list):
        return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _cat([p[k] for p in parts]) for k in first}
    raise TypeError(f"cannot concatenate batches of {type(first).__name__}")
