"""The papers' image models from torchvision, on synthetic ImageNet-shaped data.

Weights are initialised randomly (nothing is downloaded). Auxiliary heads are
off so that every model returns plain logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tunekit.errors import WorkloadError
from tunekit.workload import Workload

NUM_CLASSES = 1000


def _torchvision_models():
    try:
        import torchvision.models as models
    except Exception as exc:  # missing, or built for another torch
        raise WorkloadError(
            "this example needs torchvision: pip install 'tunekit[models]' "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return models


def _image_batch(size: int) -> Callable:
    def make_batch(n: int, generator: torch.Generator):
        images = torch.randn(n, 3, size, size, generator=generator)
        labels = torch.randint(NUM_CLASSES, (n,), generator=generator)
        return images, labels

    return make_batch


def _vision(name: str, build: Callable[[], nn.Module], size: int, batch: int) -> Workload:
    _torchvision_models()  # fail early, in the caller's process, with one clear line
    return Workload(
        name=name,
        model=build,
        make_batch=_image_batch(size),
        batch_size=batch,
        lr=0.01,
        lr_scaling="linear",
        batch_range=(1, 512),
        description=f"torchvision {name} on synthetic {size}x{size} images",
        extra={"family": "cnn", "input_shape": (3, size, size)},
    )


def alexnet() -> Workload:
    return _vision(
        "alexnet", lambda: _torchvision_models().alexnet(num_classes=NUM_CLASSES), 224, 16
    )


def vgg16() -> Workload:
    return _vision("vgg16", lambda: _torchvision_models().vgg16(num_classes=NUM_CLASSES), 224, 4)


def inception_v3() -> Workload:
    def build():
        return _torchvision_models().inception_v3(
            num_classes=NUM_CLASSES, aux_logits=False, init_weights=False
        )

    return _vision("inception_v3", build, 299, 4)


def googlenet() -> Workload:
    def build():
        return _torchvision_models().googlenet(
            num_classes=NUM_CLASSES, aux_logits=False, init_weights=False
        )

    return _vision("googlenet", build, 224, 8)


def resnet152() -> Workload:
    return _vision(
        "resnet152", lambda: _torchvision_models().resnet152(num_classes=NUM_CLASSES), 224, 2
    )
