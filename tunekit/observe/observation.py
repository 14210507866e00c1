"""What tuners read: one observed job on one machine.

The orchestrator fills an :class:`Observation` (model summary, baseline
measurement, hardware; the graph, layer profile, step breakdown and telemetry
where the observation layer measured them) and hands it to every tuner's
``diagnose`` and ``plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, TypeVar

import torch
from torch import nn

from tunekit.observe.truth import StepTruth

if TYPE_CHECKING:
    from tunekit.hardware import Hardware
    from tunekit.layout import Layout
    from tunekit.memory import MemoryFacts, MemoryPrediction
    from tunekit.observe.breakdown import Breakdown
    from tunekit.observe.graph import ModelGraph
    from tunekit.observe.layer_profile import LayerProfile
    from tunekit.workload import Workload

T = TypeVar("T")


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSummary:
        return cls(
            num_params=d["num_params"],
            param_bytes=d["param_bytes"],
            layers=[LayerInfo(**layer) for layer in d["layers"]],
            example_batch=d["example_batch"],
        )


def summarize_model(model: nn.Module, example_inputs: Any) -> ModelSummary:
    """Parameters and leaf layers in the order the forward pass runs them.
    ``example_inputs``: the batch's inputs, passed to the model as one argument."""
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
            params = [
                f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)
            ]
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
    from tunekit.observe.graph import _tensors

    first = next(iter(_tensors(example_inputs)), None)  # a tuple or dict of inputs too
    batch = int(first.shape[0]) if first is not None and first.dim() else 0
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


class StudyCache(Protocol):
    """``Observation.cache``: a key-value store of JSON values that outlives the process
    (the study store's cache, under a prefix of the model's graph and the hardware)."""

    def get(self, key: str) -> Any: ...

    def put(self, key: str, value: Any) -> None: ...

    def items(self) -> dict[str, Any]:
        """Every entry (what a tuner in the workload's process starts with)."""
        ...


class TelemetrySummary(TypedDict, total=False):
    """``Observation.telemetry``: the sampler's summary over the observed baseline run
    (:meth:`tunekit.observe.telemetry.TelemetrySampler.summary`)."""

    interval_s: float
    duration_s: float
    notices: list[str]
    errors: dict[str, int]
    samples: dict[str, int]
    """Samples taken per source."""
    host: dict[str, Any]
    """CPU, memory and process figures (``summarize_host``)."""
    nvml: dict[str, Any]
    """Per GPU utilisation, memory, power, clocks, throttling (``summarize_nvml``)."""
    pyspy: dict[str, Any]
    """Where the Python threads spent their time (``summarize_pyspy``)."""


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
    graph: ModelGraph | None = None
    """The model's torch.fx graph by layer, when the model could be traced."""
    layer_profile: LayerProfile | None = None
    """Measured per-layer forward/backward times, when profiled."""
    breakdown: Breakdown | None = None
    """Step breakdown (compute, exposed communication, ...) from a profiled run."""
    telemetry: TelemetrySummary | None = None
    """Telemetry summary (NVML, host, py-spy) over the observed run."""
    cache: StudyCache | None = None
    """Expensive plugin measurements kept in the study store; None outside a study.
    Prefer :meth:`cached`, which also falls back to memory when there is no store."""
    memory: MemoryFacts | None = None
    """What the memory model needs, measured on one process of the workload
    (:mod:`tunekit.observe.memory_facts`); None when it could not be measured."""
    memory_cap_bytes: int | None = None
    """``--memory-cap``: the most a rank may hold (also each device's ``memory_bytes`` in
    ``hardware``); None without a cap."""
    baseline_peak_bytes: float | None = None
    """The baseline trial's measured peak per rank (the largest over ranks), in bytes."""
    blocks: list[str] = field(default_factory=list)
    """Module paths of the model's blocks: its transformer blocks, else each top-level child
    with parameters (what FSDP shards and checkpointing recomputes; ``Layout.checkpoint_blocks``
    names these)."""
    extra: dict[str, Any] = field(default_factory=dict)
    _memo: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks (micro-batches included), as a Session counts."""
        return self.workload.batch_size * self.workload.accumulation * self.nproc

    @property
    def truth(self) -> StepTruth | None:
        """The baseline's measured step and where it goes: what every diagnosis starts from.

        None when no baseline was measured (``tunekit plan`` without a study)."""
        return StepTruth.of(self.baseline, self.breakdown)

    def predict_memory(
        self,
        layout: Layout | None = None,
        *,
        batch: int | None = None,
        accumulation: int | None = None,
    ) -> MemoryPrediction | None:
        """A rank's predicted peak memory, with its parts, under ``layout`` (default: the
        workload's), per-rank micro-batch ``batch`` and ``accumulation`` (default: the
        workload's), calibrated on the baseline's measured peak when there is one. None when
        the memory facts could not be measured. See :mod:`tunekit.memory`."""
        from tunekit.memory import calibrate, predict

        facts, measured = self.memory, self.baseline_peak_bytes
        if facts is None:
            return None
        base_layout = self.workload.layout()
        calibration = None
        if measured:
            calibration = self.memo(
                "tunekit:memory_calibration",
                lambda: calibrate(
                    facts,
                    base_layout,
                    measured,
                    batch=self.workload.batch_size,
                    accumulation=self.workload.accumulation,
                    world_size=self.nproc,
                    device_type=self.device_type,
                ),
            )
        return predict(
            facts,
            layout or base_layout,
            batch=batch or self.workload.batch_size,
            accumulation=accumulation or self.workload.accumulation,
            world_size=self.nproc,
            device_type=self.device_type,
            calibration=calibration,
        )

    def memo(self, key: str, fn: Callable[[], T]) -> T:
        """``fn()``, computed once for this observation: what ``diagnose`` works out,
        ``plan`` reuses. Keys are the tuner's own (prefix them with its name)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def cached(
        self,
        key: str,
        fn: Callable[[], T],
        *,
        encode: Callable[[T], Any] = lambda v: v,
        decode: Callable[[Any], T] = lambda v: v,
    ) -> T:
        """``fn()``, measured once per study: read from the study store's cache when an
        earlier process measured it (``decode``), else measured and stored (``encode``
        to JSON). Memoised for this observation either way; without a store, memory only."""

        def load() -> T:
            hit = self.cache.get(key) if self.cache is not None else None
            if hit is not None:
                return decode(hit)
            value = fn()
            if self.cache is not None:
                self.cache.put(key, encode(value))
            return value

        return self.memo(f"cached:{key}", load)
