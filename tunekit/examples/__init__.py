"""Built-in example workloads, named ``example:NAME``, all on synthetic data.

``cnn`` is the embedded default: a small CNN that trains in seconds on a CPU.
The others are the papers' own models (torchvision's, and a BigLSTM-shaped
language model) for planning and for runs on real accelerators.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tunekit.errors import WorkloadError

DEFAULT_EXAMPLE = "cnn"

# name -> (module, function, one-line description)
EXAMPLES: dict[str, tuple[str, str, str]] = {
    "cnn": ("tunekit.examples.cnn", "workload", "small CNN, 32x32 images (the default)"),
    "alexnet": ("tunekit.examples.vision", "alexnet", "torchvision AlexNet, 224x224"),
    "vgg16": ("tunekit.examples.vision", "vgg16", "torchvision VGG-16, 224x224"),
    "inception_v3": (
        "tunekit.examples.vision",
        "inception_v3",
        "torchvision Inception-v3, 299x299",
    ),
    "googlenet": ("tunekit.examples.vision", "googlenet", "torchvision GoogLeNet, 224x224"),
    "resnet152": ("tunekit.examples.vision", "resnet152", "torchvision ResNet-152, 224x224"),
    "lstm": ("tunekit.examples.lstm", "workload", "BigLSTM-shaped language model, small"),
    "gpt": ("tunekit.examples.transformers", "gpt", "decoder-only transformer LM, ~14M parameters"),
    "gpt-sharded": (
        "tunekit.examples.transformers",
        "gpt_sharded",
        "GPT with FSDP2 sharding and full activation checkpointing, ~7M parameters",
    ),
    "vit": ("tunekit.examples.transformers", "vit", "vision transformer encoder, 32x32 images"),
    "hf-gpt2": (
        "tunekit.examples.hf",
        "gpt2",
        "Hugging Face GPT-2 from a small config (tunekit[hf])",
    ),
}


def examples_help() -> str:
    """The examples as a paragraph of a command's ``--help`` (kept as written: ``\\b``)."""
    width = max(map(len, EXAMPLES)) + len("example:")
    rows = [f"  {'example:' + name:<{width}}  {desc}" for name, (_, _, desc) in EXAMPLES.items()]
    return "\b\nBuilt-in example workloads (synthetic data):\n" + "\n".join(rows)


def check_example(name: str) -> None:
    """One line (WorkloadError) unless ``name`` is a built-in example."""
    if name not in EXAMPLES:
        raise WorkloadError(f"unknown example {name!r}; choose one of: {', '.join(EXAMPLES)}")


def example_factory(name: str) -> Callable:
    """The function that builds example ``name``."""
    check_example(name)
    module, fn, _ = EXAMPLES[name]
    return getattr(importlib.import_module(module), fn)
