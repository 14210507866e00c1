"""A dataset workload whose input pipeline does real CPU work, as image pipelines do.

Each sample is stored compressed (zlib, like an image file on disk); ``__getitem__``
decodes it and augments it with NumPy — random crop, flip, brightness and
contrast jitter, a blur, normalisation — the kind of per-sample work a
torchvision transform pipeline does on the host. Done in the training
process, it holds the step up; DataLoader worker processes can do it in
parallel with training. Tune it with::

    tunekit auto examples/workloads/slow_loader.py:workload --plugins dataloader

The model is tunekit's small demo CNN (32x32 inputs); labels come from a fixed
"teacher" on the stored image, so the task is learnable and the loss falls.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from tunekit.examples.cnn import NUM_CLASSES, build_model
from tunekit.workload import Workload

STORED = 40
"""Stored images are 3 x STORED x STORED; training crops 32 x 32 from them."""
CROP = 32
BLUR_PASSES = 8
"""3x3 box-blur passes per sample: sets how much CPU a sample costs."""
MEAN, STD = 0.5, 0.25


def _synthetic_images(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` smooth random images (sums of oriented waves plus noise), uint8 n x 3 x S x S."""
    y, x = np.mgrid[0:STORED, 0:STORED] / STORED
    fx, fy = rng.uniform(0.5, 4.0, (2, n, 3, 3, 1, 1))
    phase = rng.uniform(0, 2 * np.pi, (n, 3, 3, 1, 1))
    img = np.sin(2 * np.pi * (fx * x + fy * y) + phase).sum(axis=2)  # three waves per channel
    img += rng.normal(0, 0.3, img.shape)
    lo = img.min(axis=(1, 2, 3), keepdims=True)
    hi = img.max(axis=(1, 2, 3), keepdims=True)
    return ((img - lo) / (hi - lo + 1e-9) * 255).astype(np.uint8)


def _teacher(img: np.ndarray) -> int:
    """A fixed projection of each channel's mean over four quadrants, to one of NUM_CLASSES."""
    h = STORED // 2
    pooled = np.array(
        [img[c, i : i + h, j : j + h].mean() for c in range(3) for i in (0, h) for j in (0, h)]
    )
    weights = np.random.default_rng(7).normal(size=(pooled.size, NUM_CLASSES))
    return int(np.argmax((pooled / 255 - 0.5) @ weights))


class SlowImageDataset(torch.utils.data.Dataset):
    """``n`` compressed images; loading one decodes and augments it (deterministic per index)."""

    def __init__(self, n: int = 512, seed: int = 0):
        images = _synthetic_images(n, np.random.default_rng(seed))
        self.blobs = [zlib.compress(img.tobytes(), 6) for img in images]
        self.labels = [_teacher(img) for img in images]
        self.seed = seed

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        img = np.frombuffer(zlib.decompress(self.blobs[i]), dtype=np.uint8).reshape(
            3, STORED, STORED
        )
        rng = np.random.default_rng((self.seed, i))  # the same augmentation in any process
        top, left = rng.integers(0, STORED - CROP + 1, size=2)
        x = img[:, top : top + CROP, left : left + CROP].astype(np.float32) / 255
        if rng.random() < 0.5:
            x = x[:, :, ::-1]
        x = x * rng.uniform(0.8, 1.2) + rng.uniform(-0.1, 0.1)  # contrast, brightness
        for _ in range(BLUR_PASSES):
            padded = np.pad(x, ((0, 0), (1, 1), (1, 1)), mode="edge")
            x = (
                sum(padded[:, dy : dy + CROP, dx : dx + CROP] for dy in range(3) for dx in range(3))
                / 9
            )
        x = (np.clip(x, 0, 1) - MEAN) / STD
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), self.labels[i]


def workload() -> Workload:
    return Workload(
        name="slow_loader",
        model=build_model,
        dataset=SlowImageDataset,
        batch_size=32,
        lr=0.02,
        batch_range=(8, 128),
        description="demo CNN on 512 compressed 40x40 images, decoded and augmented per sample",
        extra={"family": "cnn", "input_shape": (3, CROP, CROP)},
    )
