"""Workloads: what a user gives tunekit, and how a name becomes one.

A workload is named by a string so that every worker process can rebuild it
(nothing is pickled across processes):

* ``path/to/file.py:fn``  a function in a Python file,
* ``package.module:fn``   a function in an importable module,
* ``example:NAME``        one of tunekit's built-in examples.

The function takes no arguments and returns a :class:`Workload`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tunekit.errors import WorkloadError
from tunekit.layout import CheckpointPolicy, Layout, Sharding, layout_problem
from tunekit.workload_spec import EXAMPLE_PREFIX, _is_file, _split, resolve_spec  # noqa: F401 (re-exported)

LrScaling = Literal["linear", "sqrt", "none"]
Precision = Literal["fp32", "bf16", "fp16"]
Batch = tuple[Any, torch.Tensor]
SchedulerFactory = Callable[[torch.optim.Optimizer], "torch.optim.lr_scheduler.LRScheduler"]

DOC = "docs/workloads.md"
"""Where every field is described; workload errors point there."""


def _default_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@dataclass
class Workload:
    """A training job, described so that any process can rebuild it."""

    name: str
    """Short label used in reports and the study store."""
    model: Callable[[], nn.Module]
    """Builds a fresh model on the CPU; the runtime moves it to the device."""
    make_batch: Callable[[int, torch.Generator], Batch] | None = None
    """``(n, generator) -> (inputs, targets)``: a synthetic batch of ``n`` samples.
    Exactly one of ``make_batch`` and ``dataset`` is given."""
    dataset: Callable[[], torch.utils.data.Dataset] | None = None
    """Builds a map-style dataset whose items are ``(input, target)``."""
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy
    """``(model output, targets) -> scalar loss`` (a mean over the batch)."""
    optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer] = _default_optimizer
    """``(parameters, lr) -> optimizer``."""
    batch_size: int = 32
    """Samples per data-parallel rank and step (the DDP convention)."""
    lr: float = 0.01
    """Learning rate at ``batch_size``."""
    lr_scaling: LrScaling = "linear"
    """How the learning rate follows a batch change: linear, sqrt or none."""
    batch_range: tuple[int, int] | None = None
    """Per-rank batch sizes known to converge. ``None`` forbids batch changes."""
    seed: int = 0
    """Seeds model initialisation and the data order."""
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for plugins (e.g. ``{"family": "cnn"}``)."""
    precision: Precision = "fp32"
    """Mixed precision: forward and loss under ``torch.autocast`` in ``bf16`` or ``fp16``
    (``fp32``: off). Parameters, gradients and the optimizer stay in fp32."""
    grad_scaler: bool | None = None
    """fp16 only: scale the loss against gradient underflow (``torch.amp.GradScaler``;
    None: on for fp16). bf16 and fp32 need none."""
    accumulation: int = 1
    """Micro-batches per optimizer step: each rank runs ``accumulation`` forward and backward
    passes of ``batch_size`` samples, then one update. The global batch of a step is
    ``batch_size x accumulation x ranks``."""
    scheduler: SchedulerFactory | None = None
    """``optimizer -> LR scheduler``, stepped once per optimizer step; its state is
    checkpointed and carried through live applies and rollbacks."""
    clip_grad_norm: float | None = None
    """Clip the gradients to this global L2 norm before each update (None: no clipping)."""
    sharding: Sharding = "ddp"
    """``ddp``: every rank holds the whole model. ``fsdp``: parameters, gradients and
    optimizer state sharded over the ranks (FSDP2 ``fully_shard`` on each transformer block,
    or each top-level child of a model without blocks, then on the root)."""
    reshard_after_forward: bool = True
    """FSDP: free a block's gathered parameters after its forward (True, least memory) or keep
    them until its backward (False, one all-gather fewer per block)."""
    cpu_offload: bool = False
    """FSDP: keep parameter, gradient and optimizer-state shards in host memory."""
    checkpointing: CheckpointPolicy = "none"
    """Activation checkpointing of blocks: ``none``, ``full`` (recompute a block's forward in
    backward, keeping only its input) or ``selective`` (keep its matmul outputs, recompute the rest)."""
    checkpoint_every: int = 1
    """Checkpoint every k-th block (1: all of them)."""
    checkpoint_blocks: tuple[str, ...] | None = None
    """Blocks to checkpoint by name (``("blocks.0", "blocks.2")``) instead of every k-th."""

    def __post_init__(self) -> None:
        if (self.make_batch is None) == (self.dataset is None):
            raise self._error("make_batch/dataset", "give exactly one of make_batch and dataset")
        if (
            not isinstance(self.batch_size, int)
            or isinstance(self.batch_size, bool)
            or self.batch_size < 1
        ):
            raise self._error("batch_size", f"must be a positive int, not {self.batch_size!r}")
        if not isinstance(self.lr, int | float) or not (self.lr > 0 and math.isfinite(self.lr)):
            raise self._error("lr", f"must be a positive number, not {self.lr!r}")
        if self.lr_scaling not in ("linear", "sqrt", "none"):
            raise self._error(
                "lr_scaling", f"must be linear, sqrt or none, not {self.lr_scaling!r}"
            )
        if self.batch_range is not None:
            try:
                lo, hi = self.batch_range
            except (TypeError, ValueError):
                raise self._error(
                    "batch_range", f"must be (low, high), not {self.batch_range!r}"
                ) from None
            if not (1 <= lo <= self.batch_size <= hi):
                raise self._error(
                    "batch_range", f"{self.batch_range} must contain batch_size {self.batch_size}"
                )
        for name in ("model", "loss", "optimizer"):
            if not callable(getattr(self, name)):
                raise self._error(
                    name, f"must be callable, not {type(getattr(self, name)).__name__}"
                )
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise self._error("precision", f"must be fp32, bf16 or fp16, not {self.precision!r}")
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, bool):
            raise self._error(
                "grad_scaler", f"must be True, False or None, not {self.grad_scaler!r}"
            )
        if self.precision == "fp16" and self.grad_scaler is False:
            raise self._error(
                "grad_scaler",
                "fp16 needs a GradScaler against gradient underflow: "
                "leave grad_scaler on, or use precision='bf16'",
            )
        if self.grad_scaler and self.precision != "fp16":
            raise self._error(
                "grad_scaler", f"only fp16 scales the loss; precision is {self.precision}"
            )
        if (
            not isinstance(self.accumulation, int)
            or isinstance(self.accumulation, bool)
            or self.accumulation < 1
        ):
            raise self._error(
                "accumulation", f"must be an int of 1 or more, not {self.accumulation!r}"
            )
        if self.scheduler is not None and not callable(self.scheduler):
            raise self._error("scheduler", "must be a function optimizer -> LR scheduler")
        if self.clip_grad_norm is not None and (
            isinstance(self.clip_grad_norm, bool)
            or not isinstance(self.clip_grad_norm, int | float)
            or not (self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm))
        ):
            raise self._error(
                "clip_grad_norm", f"must be a positive number or None, not {self.clip_grad_norm!r}"
            )

        if isinstance(self.checkpoint_blocks, list):
            self.checkpoint_blocks = tuple(self.checkpoint_blocks)
        found = layout_problem(
            {
                "sharding": self.sharding,
                "reshard_after_forward": self.reshard_after_forward,
                "cpu_offload": self.cpu_offload,
                "checkpointing": self.checkpointing,
                "checkpoint_every": self.checkpoint_every,
                "checkpoint_blocks": self.checkpoint_blocks,
            }
        )
        if found:
            raise self._error(*found)
        if self.sharding == "fsdp" and self.precision == "fp16":
            raise self._error(
                "precision",
                "fp16 under sharding='fsdp' is not supported: each rank would check only its "
                "own gradient shards for overflow (use precision='bf16', which needs no loss scale)",
            )

    def _error(self, field_name: str, problem: str) -> WorkloadError:
        return WorkloadError(f"workload {self.name!r}: {field_name} {problem} (see {DOC})")

    @property
    def uses_scaler(self) -> bool:
        return self.precision == "fp16"

    def layout(self) -> Layout:
        """How the workload lays its model out: sharding and activation checkpointing."""
        return Layout(
            sharding=self.sharding,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            checkpointing=self.checkpointing,
            checkpoint_every=self.checkpoint_every,
            checkpoint_blocks=self.checkpoint_blocks,
        )

    def features(self) -> frozenset[str]:
        """The training features in use: ``amp``, ``grad_scaler``, ``accumulation``,
        ``scheduler``, ``clipping``, and the layout's ``sharded`` and ``checkpointed``
        (what a gradient strategy or a placement must honour)."""
        out = set()
        if self.precision != "fp32":
            out.add("amp")
        if self.uses_scaler:
            out.add("grad_scaler")
        if self.accumulation > 1:
            out.add("accumulation")
        if self.scheduler is not None:
            out.add("scheduler")
        if self.clip_grad_norm is not None:
            out.add("clipping")
        if self.sharding == "fsdp":
            out.add("sharded")
        if self.checkpointing != "none":
            out.add("checkpointed")
        return frozenset(out)

    def scaled_lr(self, batch_size: int) -> float:
        """The learning rate for per-rank ``batch_size`` under this workload's scaling rule."""
        return self.lr_for_ratio(batch_size / self.batch_size)

    def lr_for_ratio(self, ratio: float) -> float:
        """The learning rate when the global batch is ``ratio`` times the workload's own."""
        if self.lr_scaling == "linear":
            return self.lr * ratio
        if self.lr_scaling == "sqrt":
            return self.lr * math.sqrt(ratio)
        return self.lr

    def example_batch(self, n: int, seed: int = 0) -> Batch:
        """A batch of ``n`` samples, for tracing and profiling."""
        gen = torch.Generator().manual_seed(seed)
        if self.make_batch is not None:
            return self.make_batch(n, gen)
        assert self.dataset is not None  # __post_init__: exactly one of make_batch, dataset
        ds = self.dataset()
        idx = torch.randint(len(ds), (n,), generator=gen).tolist()
        return torch.utils.data.default_collate([ds[i] for i in idx])


def prepare_arguments(workload: Workload) -> dict[str, Any]:
    """What ``tunekit.prepare`` needs, besides the model, optimizer and loss, to train as
    ``workload`` trains: its per-rank batch, learning rate and scaling rule, and its training
    features; the scheduler by its factory's name (None without one); its layout's fields that
    are not plain DDP's (``layout``: FSDP, checkpointing). Plain JSON: a study keeps it, and
    ``best_config.md``'s snippet is written from it."""
    factory = workload.scheduler
    plain = Layout().to_dict()
    layout = {k: v for k, v in workload.layout().to_dict().items() if plain[k] != v}
    return {
        "batch_size": workload.batch_size,
        "lr": workload.lr,
        "lr_scaling": workload.lr_scaling,
        "precision": workload.precision,
        "accumulation": workload.accumulation,
        "clip_grad_norm": workload.clip_grad_norm,
        "scheduler": getattr(factory, "__name__", "scheduler") if factory is not None else None,
        "layout": layout,
    }


# -- loading ------------------------------------------------------------------------


def load_workload(spec: str) -> Workload:
    """Build the workload a name points at; raise :class:`WorkloadError` if it cannot."""
    spec = spec.strip()
    factory: Callable[..., Any] | None
    if spec.startswith(EXAMPLE_PREFIX):
        from tunekit.examples import example_factory

        factory = example_factory(spec[len(EXAMPLE_PREFIX) :])
        where = spec
    else:
        target, fn = _split(spec)
        module = _import_file(target) if _is_file(target) else _import_module(target)
        factory = getattr(module, fn, None)
        if factory is None or not callable(factory):
            names = sorted(n for n in vars(module) if not n.startswith("_"))
            shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
            raise WorkloadError(f"{target} has no function {fn!r} (it defines: {shown})")
        where = spec
    try:
        workload = factory()
    except WorkloadError:
        raise
    except Exception as exc:  # the user's code failed: report it in one line
        raise WorkloadError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"{where} returned {type(workload).__name__}, expected a tunekit.Workload (see {DOC})"
        )
    return workload


def _import_file(target: str):
    path = Path(target).expanduser()
    if not path.is_file():
        raise WorkloadError(f"workload file {target} not found")
    name = f"tunekit_workload_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # no loader for the suffix (e.g. not .py)
        raise WorkloadError(f"could not import {target}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import does: @dataclass and pickle look the module up.
    sys.modules[name] = module
    # Let the file import its neighbours, as `python file.py` would.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise WorkloadError(f"could not import {target}: {type(exc).__name__}: {exc}") from exc
    finally:
        # Our entry, wherever the file's own sys.path changes moved it (not index 0: that may
        # be an entry the file inserted for imports it makes later, inside model()).
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def _import_module(target: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and target.startswith(exc.name):
            raise WorkloadError(f"no module named {target!r}") from exc
        raise WorkloadError(f"could not import {target}: {exc}") from exc
    except Exception as exc:
        raise WorkloadError(f"could not import {target}: {type(exc).__name__}: {exc}") from exc
