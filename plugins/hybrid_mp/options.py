"""The workload's settings for hybrid_mp: ``Workload.extra["hybrid_mp"]``, checked.

``epochs``             ``{N: E_N}`` epochs to converge at global batch N × B (Figure 4)
``epochs_from``        ``"table"`` (default: ``epochs``), ``"noise_scale"`` (estimate
                       B_noise from gradients, E_N ∝ 1 + N·B/B_noise) or ``"measure"``
                       (short runs to ``target_loss``, gradient accumulation)
``target_loss``        the loss ``"measure"`` trains to
``scaling_efficiency`` ``"paper"`` (SE_N = 1, the default), ``"model"`` (all-reduce
                       of the gradients fully exposed) or ``{N: SE_N}`` measured
``compute_efficiency`` fraction of peak FLOP/s the analytic Δ(k) assumes (1.0, as the paper)
``time_limit_s``       DLPlacer's time limit per M (60)
``gap``                DLPlacer's target optimality gap (0.01)
``max_mp``             largest M to consider (8)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.model import EpochTable

OPTIONS_KEY = "hybrid_mp"


@dataclass
class HybridOptions:
    """The workload's settings for this tuner (``Workload.extra["hybrid_mp"]``)."""

    epochs: dict[int, float] | None = None
    """E_N by data-parallel width N (global batch N × B)."""
    epochs_from: str = "table"
    """``table``, ``noise_scale`` or ``measure``."""
    target_loss: float | None = None
    """The loss ``epochs_from="measure"`` trains to."""
    scaling_efficiency: Any = "paper"
    """``paper`` (SE_N = 1), ``model``, or ``{N: SE_N}``."""
    compute_efficiency: float = 1.0
    """Fraction of peak FLOP/s the analytic Δ(k) assumes."""
    time_limit_s: float = 60.0
    gap: float = 0.01
    max_mp: int = 8
    extra_widths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        where = f'workload extra["{OPTIONS_KEY}"]'
        if self.epochs_from not in ("table", "noise_scale", "measure"):
            raise ConfigError(f"{where}: epochs_from must be table, noise_scale or measure")
        if self.epochs_from == "measure" and self.target_loss is None:
            raise ConfigError(f'{where}: epochs_from="measure" needs target_loss')
        if not (
            self.scaling_efficiency in ("paper", "model")
            or isinstance(self.scaling_efficiency, Mapping)
        ):
            raise ConfigError(f"{where}: scaling_efficiency must be paper, model or {{N: SE_N}}")
        if self.epochs is not None:
            EpochTable(self.epochs)  # validates
        if not 0 < self.compute_efficiency <= 1:
            raise ConfigError(f"{where}: compute_efficiency must be in (0, 1]")
        if self.max_mp < 2:
            raise ConfigError(f"{where}: max_mp must be at least 2")

    @classmethod
    def of(cls, obs_or_workload) -> HybridOptions:
        workload = getattr(obs_or_workload, "workload", obs_or_workload)
        raw = dict((workload.extra or {}).get(OPTIONS_KEY, {}))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f'workload extra["{OPTIONS_KEY}"]: unknown setting {unknown[0]!r}; known: {", ".join(sorted(known))}'
            )
        return cls(**raw)
