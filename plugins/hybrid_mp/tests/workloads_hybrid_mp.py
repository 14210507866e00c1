"""A small Inception-like workload with parallel branches, for model parallelism on a CPU.

``tunekit.plugins.hybrid_mp.tests.workloads_hybrid_mp:branchy`` is a workload name every
process can rebuild. Its blocks have four towers of different cost (1x1;
1x1 -> 3x3; 1x1 -> 3x3 -> 3x3; pool -> 1x1) joined by a concatenation, so
DLPlacer has real choices to make and a placement has values to send both
ways. ``branchy_plain`` drops batch norm, whose per-replica statistics make
data parallelism differ from one big batch, for exact equivalence tests.
``googlenet_small`` and ``inception_v3_small`` are torchvision's Inception models
at a batch a 2-core CPU trains in seconds per step (prediction checks).

``crossing``: a workload whose transfers arrive out of the order they are consumed (for the runtime tests).

Device 0 computes ``a``, device 1 ``z``, device 0 ``b``: device 0 sends ``a``
before ``b``, but device 1 reads ``b`` first, so a receiver that matched sends
in arrival order would take ``a`` for ``b`` (NCCL has no tags; the runtime
never uses them).
``plain_gpt``: the toy GPT without schedule and clipping.
"""

from __future__ import annotations

import torch
from torch import nn

from tunekit.examples.cnn import teacher_labels
from tunekit.workload import Workload

IMAGE = (3, 32, 32)


def _conv(cin: int, cout: int, k: int, norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, padding=k // 2, bias=not norm)]
    if norm:
        layers.append(nn.BatchNorm2d(cout))
    layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Tower(nn.Module):
    """Inception block: four towers of different depth, concatenated."""

    def __init__(self, width: int, norm: bool):
        super().__init__()
        q = width // 4
        self.b1 = _conv(width, q, 1, norm)
        self.b2 = nn.Sequential(_conv(width, q, 1, norm), _conv(q, q, 3, norm))
        self.b3 = nn.Sequential(
            _conv(width, q, 1, norm), _conv(q, q, 3, norm), _conv(q, q, 3, norm)
        )
        self.b4 = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), _conv(width, q, 1, norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)


class Branchy(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 2, num_classes: int = 10, norm: bool = True):
        super().__init__()
        self.stem = _conv(3, width, 3, norm)
        self.blocks = nn.Sequential(*(Tower(width, norm) for _ in range(blocks)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_batch(n: int, generator: torch.Generator):
    images = torch.randn(n, *IMAGE, generator=generator)
    return images, teacher_labels(images)


def _workload(name: str, norm: bool, width: int) -> Workload:
    return Workload(
        name=name,
        model=lambda: Branchy(width=width, norm=norm),
        make_batch=make_batch,
        batch_size=16,
        lr=0.05,
        lr_scaling="linear",
        batch_range=(4, 256),
        description=f"Inception-like CNN with 4-tower blocks, width {width}, on 3x32x32 images",
        extra={"family": "cnn", "input_shape": IMAGE},
    )


def branchy() -> Workload:
    return _workload("branchy", norm=True, width=64)


def branchy_plain() -> Workload:
    return _workload("branchy_plain", norm=False, width=64)


def branchy_wide() -> Workload:
    """Wider towers: more work per branch, for measuring model-parallel speed-up on a CPU."""
    return _workload("branchy_wide", norm=False, width=256)


def googlenet_small() -> Workload:
    """torchvision GoogLeNet at 4 images per rank: Inception blocks in seconds per step on a CPU."""
    from tunekit.examples.vision import googlenet

    return _smaller(googlenet(), "googlenet_small", 4)


def inception_v3_small() -> Workload:
    """torchvision Inception-v3 (DLPlacer's own model) at 2 images per rank, for a CPU."""
    from tunekit.examples.vision import inception_v3

    return _smaller(inception_v3(), "inception_v3_small", 2)


def _smaller(workload: Workload, name: str, batch: int) -> Workload:
    workload.name = name
    workload.batch_size = batch
    workload.description += f", {batch} per rank"
    return workload


# -- transfers out of order (runtime tests) --------------------------------------------

# fx node -> model-parallel device, and planned start times that put l1 before l2
PLACEMENT = {"l1": 0, "l0": 1, "l2": 0, "l3": 1, "add": 1, "add_1": 1, "l4": 1, "relu": 1}
ORDER = {
    "l1": 0.0,
    "l0": 1.0,
    "l2": 2.0,
    "l3": 3.0,
    "add": 4.0,
    "add_1": 4.0,
    "l4": 5.0,
    "relu": 5.0,
}


class Crossing(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 6)
        self.l3, self.l4 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        a = self.l1(x)
        z = self.l0(x)
        b = self.l2(x)
        return torch.relu(self.l4(self.l3(b) + a + z))


def _batch(n: int, gen: torch.Generator):
    x = torch.randn(n, 8, generator=gen)
    return x, torch.randint(4, (n,), generator=gen)


def crossing() -> Workload:
    return Workload(name="crossing", model=Crossing, make_batch=_batch, batch_size=8, lr=0.1)


def plain_gpt() -> Workload:
    """The toy GPT without its schedule and clipping (the reference run steps neither;
    the training features are checked against the session in the features tests)."""
    import dataclasses

    from tunekit.testing import tiny_gpt_workload

    return dataclasses.replace(tiny_gpt_workload(), scheduler=None, clip_grad_norm=None)
