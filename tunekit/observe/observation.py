"""What tuners read: one observed job on one machine.

The orchestrator fills an :class:`Observation` (model summary, baseline
measurement, hardware; the graph, layer profile, step breakdown and telemetry
where the observation layer measured them) and hands it to every tuner's
``diagnose`` and ``plan``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tunekit.observe.truth import StepTruth

if TYPE_CHECKING:
    from tunekit.hardware import Hardware
    from tunekit.workload import Workload


@dataclass
class LayerInfo:
    """A leaf module as the papers count layers: conv, linear, pool, norm, activation ..."""

    name: str
    """Module path in the model (``features.3``)."""
    type: str
    """Class name (``Conv2d``)."""
    param_numel: int
    param_names: list[str]
    """Full names of the parameters this layer owns."""
    output_shape: list[int] | None = None
    """Output shape for the summary's example batch (first output if several)."""


@dataclass
class ModelSummary:
    num_params: int
    param_bytes: int
    layers: list[LayerInfo]
    """Leaf modules in forward execution order (first call), output end last."""
    example_batch: int
    """Batch size the output shapes were recorded at."""

    def layers_with_params(self) -> list[LayerInfo]:
        return [layer for layer in self.layers if layer.param_numel]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_model(model: nn.Module, example_inputs: Any) -> ModelSummary:
    """Parameters and leaf layers in the order the forward pass runs them."""
    order: list[LayerInfo] = []
    seen: set[str] = set()
    handles = []

    def hook_for(name: str, module: nn.Module):
        def hook(_mod, _inp, out):
            if name in seen:
                return
            seen.add(name)
            first = out[0] if isinstance(out, tuple | list) else out
            shape = list(first.shape) if isinstance(first, torch.Tensor) else None
            params = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
            order.append(
                LayerInfo(
                    name=name,
                    type=type(module).__name__,
                    param_numel=sum(p.numel() for p in module.parameters(recurse=False)),
                    param_names=params,
                    output_shape=shape,
                )
            )

        return hook

    for name, module in model.named_modules():
        is_leaf = not any(True for _ in module.children())
        if is_leaf or any(True for _ in module.parameters(recurse=False)):
            handles.append(module.register_forward_hook(hook_for(name, module)))
    try:
        with torch.no_grad():
            model(example_inputs)
    finally:
        for h in handles:
            h.remove()
    params = list(model.parameters())
    batch = example_inputs.shape[0] if isinstance(example_inputs, torch.Tensor) else 0
    return ModelSummary(
        num_params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        layers=order,
        example_batch=batch,
    )


@dataclass
class Measurement:
    """Step times of one trial: per measured step, the slowest rank's time."""

    step_s: list[float]
    """Per measured step, max over ranks, in seconds."""
    median_s: float
    spread_s: float
    """Interquartile range of ``step_s``."""
    samples_per_s: float
    """Global samples per second at the median step time."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Observation:
    """Everything tuners know about the job when they diagnose and plan."""

    workload_spec: str
    workload: Workload
    nproc: int
    """Ranks the trials run with (data-parallel world size)."""
    backend: str
    """``gloo`` or ``nccl``."""
    device_type: str
    """``cpu`` or ``cuda``."""
    hardware: Hardware
    model: ModelSummary
    baseline: Measurement | None = None
    """The untuned job's measured step times, when a baseline trial ran."""
    graph: Any = None
    """:class:`tunekit.observe.graph.ModelGraph` when the model was traced."""
    layer_profile: Any = None
    """Measured per-layer forward/backward times, when profiled."""
    breakdown: Any = None
    """Step breakdown (compute, exposed communication, ...) from a profiled run."""
    telemetry: Any = None
    """Telemetry summary (NVML, host, py-spy) over the observed run."""
    cache: Any = None
    """Key-value cache in the study store for expensive plugin measurements
    (``cache.get(key)`` / ``cache.put(key, json_value)``); None outside a study."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks (micro-batches included), as a Session counts."""
        return self.workload.batch_size * getattr(self.workload, "accumulation", 1) * self.nproc

    @property
    def truth(self) -> StepTruth | None:
        """The baseline's measured step and where it goes: what every diagnosis starts from.

        None when no baseline was measured (``tunekit plan`` without a study)."""
        return StepTruth.of(self.baseline, self.breakdown)
