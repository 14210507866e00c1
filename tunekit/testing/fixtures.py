"""Real pieces to test with: tiny workloads, deterministic hardware, an observation cache.

The workloads train in milliseconds and load by name as well
(``tunekit.testing:tiny_workload``, ``tunekit.testing:tiny_gpt_workload``, ...).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import torch
from torch import nn

from tunekit.hardware import GB, CollectiveFit, Device, Hardware, Host, Link
from tunekit.workload import Workload

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


# == toy transformers (example:gpt's and example:vit's models at toy size) ================


TINY_GPT = {"vocab": 64, "width": 16, "heads": 4, "blocks": 2, "seq": 8}


def _tiny_gpt_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences of tokens: the next token is learnable."""
    vocab, seq = TINY_GPT["vocab"], TINY_GPT["seq"]
    start = torch.randint(vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    text = (start + stride * torch.arange(seq + 1)) % vocab
    return text[:, :-1], text[:, 1:]


def tiny_gpt_workload() -> Workload:
    """:class:`~tunekit.examples.transformers.GPTModel` at toy size (4 sequences of 8 tokens
    per rank), trained as ``example:gpt`` is: AdamW, a warm-up + cosine schedule that moves
    the learning rate every step, clipping at 1.0. By name ``tunekit.testing:tiny_gpt_workload``.

    Built from module-level functions, so the object itself can be sent to spawned ranks."""
    from tunekit.examples.transformers import GPTModel, _adamw, _lm_loss, warmup_cosine

    return Workload(
        name="tiny_gpt",
        model=partial(GPTModel, **TINY_GPT),
        make_batch=_tiny_gpt_batch,
        loss=_lm_loss,
        optimizer=_adamw,
        batch_size=4,
        lr=3e-3,
        scheduler=partial(warmup_cosine, warmup=2, total=10),
        clip_grad_norm=1.0,
    )


TINY_VIT = {"image": 8, "patch": 4, "width": 16, "heads": 2, "blocks": 2, "classes": 10}


def _tiny_vit_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 3, TINY_VIT["image"], TINY_VIT["image"], generator=gen)
    return x, torch.randint(TINY_VIT["classes"], (n,), generator=gen)


def tiny_vit_workload() -> Workload:
    """:class:`~tunekit.examples.transformers.ViT` at toy size (4 images of 8x8 in 4x4
    patches per rank), AdamW, warm-up + cosine, clipping at 1.0. By name
    ``tunekit.testing:tiny_vit_workload``."""
    from tunekit.examples.transformers import ViT, _adamw, warmup_cosine

    return Workload(
        name="tiny_vit",
        model=partial(ViT, **TINY_VIT),
        make_batch=_tiny_vit_batch,
        optimizer=_adamw,
        batch_size=4,
        lr=3e-3,
        scheduler=partial(warmup_cosine, warmup=2, total=10),
        clip_grad_norm=1.0,
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


# == an observation's cache ===============================================================


class MemoryCache:
    """``obs.cache`` without a study store; values go through JSON, as the store's do."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def get(self, key: str) -> Any:
        text = self.data.get(key)
        return None if text is None else json.loads(text)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = json.dumps(value)

    def items(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.data.items()}
