"""Hugging Face ``transformers`` models as tunekit workloads (``pip install 'tunekit[hf]'``).

:func:`hf_workload` builds a :class:`~tunekit.Workload` from a ``transformers``
config and, optionally, the model class to build from it (by default the
``AutoModel`` class of the task). Nothing is downloaded: the model is built
from the config with random weights, and the data is either a tokenizer-free
synthetic batch (token ids and labels of ``seq_len`` tokens) or the user's own
map-style dataset of tokenized items.

The model runs as ``model(**inputs)`` with the labels among the inputs, and
the loss is the model's own ``outputs.loss`` (Hugging Face computes it,
shifted for causal LMs), so tunekit trains exactly what ``Trainer`` would.

Importing this module without ``transformers`` raises :class:`MissingExtra`,
one line naming the extra; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tunekit.errors import WorkloadError
from tunekit.workload import Workload

INSTALL = "pip install 'tunekit[hf]'"


class MissingExtra(WorkloadError, ImportError):
    """An optional extra is not installed (a WorkloadError for the CLI, an ImportError
    for ``try: import ...`` in user code)."""


try:
    import transformers
except ImportError as exc:  # missing, or broken against this torch
    raise MissingExtra(
        f"Hugging Face models need the transformers library: {INSTALL} ({type(exc).__name__}: {exc})"
    ) from None

__all__ = ["HFModel", "MissingExtra", "hf_workload", "task_of"]

# The label each task trains on: what `labels` means for the model's own loss.
_TASKS = {
    "ForCausalLM": "causal_lm",
    "LMHeadModel": "causal_lm",
    "ForMaskedLM": "masked_lm",
    "ForSequenceClassification": "classification",
}
_AUTO = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "classification": "AutoModelForSequenceClassification",
}


class HFModel(nn.Module):
    """A ``transformers`` model called the way tunekit calls models: with one argument, the
    batch's inputs (a dict: ``input_ids``, ``labels``, optionally ``attention_mask``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]):
        return self.model(**inputs)


def task_of(model_class: type) -> str:
    """``causal_lm``, ``masked_lm`` or ``classification`` from the class name."""
    for suffix, task in _TASKS.items():
        if model_class.__name__.endswith(suffix):
            return task
    raise WorkloadError(
        f"{model_class.__name__}: tunekit knows the labels of causal LMs (…ForCausalLM, "
        "…LMHeadModel), masked LMs (…ForMaskedLM) and …ForSequenceClassification models; "
        "for another head give a dataset whose items carry the model's own labels"
    )


def _output_loss(outputs: Any, _targets: torch.Tensor) -> torch.Tensor:
    """The model's own loss: Hugging Face computes it from the labels in the inputs."""
    loss = getattr(outputs, "loss", None)
    if loss is None:
        raise WorkloadError("the model returned no loss: its inputs need `labels`")
    return loss


def _adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def _synthetic(config, task: str, seq_len: int) -> Callable:
    """Token batches a model can learn (each token the previous plus a per-sequence stride,
    with 5% noise); classification labels are the stride's parity class."""
    vocab = int(config.vocab_size)
    classes = int(getattr(config, "num_labels", 2))

    def make_batch(n: int, generator: torch.Generator):
        start = torch.randint(vocab, (n, 1), generator=generator)
        stride = torch.randint(1, 8, (n, 1), generator=generator)
        noise = (torch.rand(n, seq_len, generator=generator) < 0.05).long()
        ids = (start + stride * torch.arange(seq_len) + noise) % vocab
        # the model shifts causal-LM labels itself; masked LMs predict every token here
        labels = stride.squeeze(1) % classes if task == "classification" else ids.clone()
        return {"input_ids": ids, "labels": labels}, labels

    return make_batch


class _Tokenized(torch.utils.data.Dataset):
    """The user's tokenized items (dicts with ``input_ids`` and, unless a causal/masked LM
    reads its labels from the ids, ``labels``) as tunekit's ``(inputs, target)`` pairs."""

    def __init__(self, items, task: str):
        self.items, self.task = items, task

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        item = dict(self.items[i])
        if "input_ids" not in item:
            raise WorkloadError(f"dataset item {i} has no input_ids (keys: {sorted(item)})")
        if "labels" not in item:
            if self.task == "classification":
                raise WorkloadError(f"dataset item {i} has no labels for sequence classification")
            item["labels"] = item["input_ids"]
        inputs = {k: torch.as_tensor(v) for k, v in item.items()}
        return inputs, inputs["labels"]


def hf_workload(
    config: transformers.PretrainedConfig,
    model_class: type | None = None,
    *,
    task: str | None = None,
    seq_len: int = 128,
    dataset: Callable[[], Any] | None = None,
    name: str | None = None,
    batch_size: int = 8,
    lr: float = 5e-5,
    batch_range: tuple[int, int] | None = None,
    **workload_fields: Any,
) -> Workload:
    """A :class:`~tunekit.Workload` training ``model_class(config)`` from scratch.

    ``model_class`` defaults to the ``AutoModelFor…`` class of ``task``
    (``causal_lm``, the default, ``masked_lm`` or ``classification``); given, it
    decides the task. Data: synthetic token batches of ``seq_len`` tokens, or
    ``dataset``, a function returning a map-style dataset of tokenized dicts.
    Other :class:`~tunekit.Workload` fields (``precision``, ``scheduler``,
    ``clip_grad_norm``, ``optimizer`` ...) pass through; the optimizer defaults
    to AdamW and the learning rate scales with the square root of the batch.
    """
    if not isinstance(config, transformers.PretrainedConfig):
        raise WorkloadError(
            f"hf_workload needs a transformers config (e.g. GPT2Config(...)), not {type(config).__name__}"
        )
    if model_class is None:
        task = task or "causal_lm"
        if task not in _AUTO:
            raise WorkloadError(f"task must be one of {', '.join(_AUTO)}, not {task!r}")
        model_class = getattr(transformers, _AUTO[task])
    else:
        task = task_of(model_class)
    if getattr(config, "use_cache", None):
        config.use_cache = False  # training: no key/value cache in the outputs
    max_len = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if dataset is None and max_len is not None and seq_len > max_len:
        raise WorkloadError(f"seq_len {seq_len} exceeds the config's {max_len} positions")

    def build() -> nn.Module:
        # Any: AutoModelFor... classes build with from_config, which a plain type lacks.
        cls: Any = model_class
        if cls.__name__.startswith("AutoModel"):
            return HFModel(cls.from_config(config))
        return HFModel(cls(config))

    data: dict[str, Any]
    if dataset is None:
        data = {"make_batch": _synthetic(config, task, seq_len)}
    else:
        data = {"dataset": lambda: _Tokenized(dataset(), task)}
    fields = {"optimizer": _adamw, "lr_scaling": "sqrt", "extra": {}, **workload_fields}
    fields["extra"] = {"family": "transformer", "hf_task": task, **fields["extra"]}
    return Workload(
        name=name or f"hf-{config.model_type}",
        model=build,
        loss=_output_loss,
        batch_size=batch_size,
        lr=lr,
        batch_range=batch_range,
        description=(
            f"transformers {getattr(model_class, '__name__', model_class)} from a "
            f"{type(config).__name__}, {task}"
            + (f", sequence {seq_len}" if dataset is None else ", user dataset")
        ),
        **data,
        **fields,
    )
