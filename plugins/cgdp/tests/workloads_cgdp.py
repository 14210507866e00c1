"""Two workloads at the ends of CGDP's range, for tests and benchmarks.

* ``deep_narrow`` — many small layers of about equal size, the "flat" shape
  of ResNet-152 in the paper, where one host synchronisation per layer costs
  more than it hides and chunks pay off.
* ``wide`` — a few small convolutions and large fully connected layers, the
  shape of AlexNet and VGG-16, where the big gradients come first in backward
  and their host reduction hides behind the rest of it.

Load them by name in any process: ``tunekit.plugins.cgdp.tests.workloads_cgdp:deep_narrow``.
"""

from __future__ import annotations

import torch
from torch import nn

from tunekit.workload import Workload

DEEP_NARROW_LAYERS = 24
DEEP_NARROW_WIDTH = 128
CLASSES = 10


def _deep_narrow_model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(DEEP_NARROW_LAYERS - 1):
        layers += [nn.Linear(DEEP_NARROW_WIDTH, DEEP_NARROW_WIDTH), nn.Tanh()]
    layers.append(nn.Linear(DEEP_NARROW_WIDTH, CLASSES))
    return nn.Sequential(*layers)


def _vector_batch(n: int, generator: torch.Generator):
    x = torch.randn(n, DEEP_NARROW_WIDTH, generator=generator)
    return x, torch.randint(CLASSES, (n,), generator=generator)


def deep_narrow() -> Workload:
    return Workload(
        name="cgdp-deep-narrow",
        model=_deep_narrow_model,
        make_batch=_vector_batch,
        batch_size=64,
        lr=0.01,
        description=f"{DEEP_NARROW_LAYERS} linear layers of {DEEP_NARROW_WIDTH} (many small gradients)",
        extra={"family": "mlp"},
    )


def _wide_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )


def _image_batch(n: int, generator: torch.Generator):
    x = torch.randn(n, 3, 32, 32, generator=generator)
    return x, torch.randint(CLASSES, (n,), generator=generator)


def wide() -> Workload:
    return Workload(
        name="cgdp-wide",
        model=_wide_model,
        make_batch=_image_batch,
        batch_size=32,
        lr=0.01,
        description="2 small convolutions, 3 large linear layers (AlexNet-like gradient profile)",
        extra={"family": "cnn"},
    )


def _bn_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 16),
        nn.Linear(16, CLASSES),
    )


def _small_image_batch(n: int, generator: torch.Generator):
    x = torch.randn(n, 3, 8, 8, generator=generator)
    return x, torch.randint(CLASSES, (n,), generator=generator)


def tiny_bn() -> Workload:
    """A tiny CNN with batch norm (buffers) and momentum SGD: fast equivalence checks."""
    return Workload(
        name="cgdp-tiny-bn",
        model=_bn_model,
        make_batch=_small_image_batch,
        batch_size=8,
        lr=0.05,
        description="tiny CNN with batch norm",
    )
