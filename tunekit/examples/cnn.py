"""The embedded demo: a small CNN on a learnable synthetic task.

Labels come from a fixed random "teacher" applied to the images, so the loss
really falls while training, which live-apply tests rely on to check that a
loss curve continues.
"""

from __future__ import annotations

import torch
from torch import nn

from tunekit.workload import Workload

NUM_CLASSES = 10
IMAGE = (3, 32, 32)


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.ReLU(),
        nn.Linear(256, NUM_CLASSES),
    )


def teacher_labels(images: torch.Tensor) -> torch.Tensor:
    """Classes from a fixed projection of each image's pooled colours and layout."""
    pooled = nn.functional.adaptive_avg_pool2d(images, 2).flatten(1)  # n x 12
    weights = torch.randn(pooled.shape[1], NUM_CLASSES, generator=torch.Generator().manual_seed(7))
    return (pooled @ weights).argmax(dim=1)


def make_batch(n: int, generator: torch.Generator):
    images = torch.randn(n, *IMAGE, generator=generator)
    return images, teacher_labels(images)


def workload() -> Workload:
    return Workload(
        name="cnn",
        model=build_model,
        make_batch=make_batch,
        batch_size=32,
        lr=0.02,
        lr_scaling="linear",
        batch_range=(8, 256),
        description="small CNN on 3x32x32 synthetic images (10 learnable classes)",
        extra={"family": "cnn", "input_shape": IMAGE},
    )
