"""Tuning configs: which tuners run, with which knob values.

A config maps tuner names to knob values. The empty config is the baseline:
the workload as its author wrote it, under plain DDP. A config is stored and
exchanged as JSON (never pickled)::

    {"tunekit_config": 1, "plugins": {"overlap_chunking": {"bucket_cap_mb": 8}}}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunekit.contract import Aspect
from tunekit.errors import ConfigError, shown

if TYPE_CHECKING:
    from tunekit.contract import Tuner
    from tunekit.layout import Layout

FORMAT_VERSION = 1

# Order in which tuners' runtime hooks run: a placement changes how the model
# executes, the batch follows, then the layout (which splits the batch's samples into
# micro-batches), the data; gradient synchronisation wraps last.
ASPECT_ORDER = [Aspect.PLACEMENT, Aspect.BATCH, Aspect.LAYOUT, Aspect.DATA, Aspect.GRAD_SYNC]


@dataclass(frozen=True)
class TuningConfig:
    plugins: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    # -- identity ------------------------------------------------------------------

    @property
    def is_baseline(self) -> bool:
        return not self.plugins

    def canonical(self) -> str:
        return json.dumps({k: dict(v) for k, v in self.plugins.items()}, sort_keys=True)

    @property
    def config_id(self) -> str:
        """Short stable id: equal configs have equal ids."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:10]

    def describe(self, defaults: Mapping[str, Mapping[str, Any]] | None = None) -> str:
        """``overlap_chunking(bucket_cap_mb=8)``; knobs at their defaults are left out."""
        if self.is_baseline:
            return "baseline"
        parts = []
        for name in sorted(self.plugins):
            base = (defaults or {}).get(name, {})
            knobs = ", ".join(
                f"{k}={v}"
                for k, v in sorted(self.plugins[name].items())
                if base.get(k, object()) != v
            )
            parts.append(f"{name}({knobs})")
        return " + ".join(parts)

    # -- (de)serialisation ---------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"tunekit_config": FORMAT_VERSION, "plugins": json.loads(self.canonical())}

    @classmethod
    def from_dict(cls, data: Any, where: str = "config") -> TuningConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        plugins = data.get("plugins", data if "tunekit_config" not in data else None)
        if not isinstance(plugins, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in plugins.items()
        ):
            raise ConfigError(f"{where}: 'plugins' must map tuner names to objects of knob values")
        return cls({k: dict(v) for k, v in plugins.items()})

    @classmethod
    def from_json(cls, text: str, where: str = "config") -> TuningConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc})") from None
        return cls.from_dict(data, where)

    @classmethod
    def load(cls, path: str | Path) -> TuningConfig:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        return cls.from_json(text, where=str(path))

    @classmethod
    def from_pairs(cls, pairs: list[str] | tuple[str, ...]) -> TuningConfig:
        """``["overlap_chunking.k=9", "overlap_chunking.mode=two_chunk"]`` -> a config.

        A value is read as JSON when it is JSON (``9``, ``true``, ``[1, 2]``,
        ``{"a": "n2"}``, ``"text"``), otherwise as the text it is (``two_chunk``).
        """
        plugins: dict[str, dict[str, Any]] = {}
        for pair in pairs:
            key, eq, text = pair.partition("=")
            plugin, dot, knob = key.strip().partition(".")
            if not eq or not dot or not plugin or not knob:
                raise ConfigError(
                    f"{shown(pair)} is not PLUGIN.knob=value (like overlap_chunking.mode=two_chunk)"
                )
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            plugins.setdefault(plugin, {})[knob.strip()] = value
        return cls(plugins)

    def to_pairs(self) -> list[str]:
        """The ``PLUGIN.knob=value`` form of :meth:`from_pairs`, values as compact JSON
        unless a plain word reads back the same."""
        out = []
        for name in sorted(self.plugins):
            for knob, value in sorted(self.plugins[name].items()):
                text = (
                    value
                    if isinstance(value, str) and _reads_back(value)
                    else json.dumps(value, separators=(",", ":"))
                )
                out.append(f"{name}.{knob}={text}")
        return out

    def merged(self, other: TuningConfig) -> TuningConfig:
        return TuningConfig({**self.plugins, **other.plugins})


def check_batch(config: TuningConfig, status: dict) -> None:
    """Refuse a per-rank ``batch_size`` knob outside a live run's batch range.

    ``status`` is the run's status; its ``batch`` names the workload's own batch
    and its ``batch_range``, the real limits (a tuner's knob declares only the
    widest). The CLI checks before sending, the job again before applying;
    0 and the workload's own batch are always allowed.
    """
    batch = status.get("batch") or {}
    for plugin, knobs in config.plugins.items():
        value = knobs.get("batch_size")
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value in (0, batch.get("workload"))
        ):
            continue
        low, high = batch.get("range") or (None, None)
        # A range is a (low, high) pair or None (the workload's batch_range), never half-set.
        if "range" in batch and (low is None or high is None or not low <= value <= high):
            allowed = (
                f"{low}–{high}, the workload's batch_range"
                if low is not None
                else "the workload sets no batch_range"
            )
            raise ConfigError(
                f"{plugin}.batch_size={shown(value)} is outside run {status.get('run_id', '?')}'s batch range "
                f"({allowed}; 0 keeps its own {batch.get('workload')})"
            )


def _reads_back(text: str) -> bool:
    """Whether ``text`` given bare reads back as the same string (not as JSON)."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return text != "" and text.strip() == text
    return False


def resolve(
    config: TuningConfig, tuners: Mapping[str, Tuner]
) -> list[tuple[Tuner, dict[str, Any]]]:
    """Check a config against installed tuners; return (tuner, full knobs) in apply order.

    Refuses unknown tuners, unknown knobs, values out of range, two tuners of
    one aspect, a tuner next to one whose aspect it excludes, and a gradient strategy
    next to a tuner whose layout shards the model (FSDP reduces its own gradients).
    """
    resolved: list[tuple[Tuner, dict[str, Any]]] = []
    by_aspect: dict[Aspect, str] = {}
    for name, knobs in config.plugins.items():
        tuner = tuners.get(name)
        if tuner is None:
            installed = ", ".join(sorted(tuners)) or "none"
            raise ConfigError(
                f"config names tuner {shown(name)}, which is not installed (installed: {installed})"
            )
        if tuner.aspect in by_aspect:
            raise ConfigError(
                f"config combines {by_aspect[tuner.aspect]!r} and {name!r}, which both control "
                f"{tuner.aspect.value}; keep one"
            )
        by_aspect[tuner.aspect] = name
        resolved.append((tuner, tuner.validate(knobs)))
    for tuner, _ in resolved:
        for aspect in tuner.excludes:
            if aspect in by_aspect:
                raise ConfigError(
                    f"{tuner.name!r} manages {aspect.value} itself; drop {by_aspect[aspect]!r}"
                )
    if Aspect.GRAD_SYNC in by_aspect:
        for tuner, knobs in resolved:
            if _asks(tuner, knobs).get("sharding") == "fsdp":
                raise ConfigError(
                    f"{tuner.name!r} shards the model with FSDP, which reduces its own "
                    f"gradients; drop {by_aspect[Aspect.GRAD_SYNC]!r}"
                )
    resolved.sort(key=lambda tk: ASPECT_ORDER.index(tk[0].aspect))
    return resolved


def config_layout(plan: list[tuple[Tuner, dict[str, Any]]], base: Layout) -> Layout:
    """The layout a resolved config runs: ``base`` (the workload's) with the changes each
    tuner's ``layout`` hook asks for, in apply order. Two tuners asking for different values
    of one field are refused in one line."""
    changes: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for tuner, knobs in plan:
        asked = _asks(tuner, knobs)
        for name, value in asked.items():
            if name in changes and changes[name] != value:
                raise ConfigError(
                    f"{owner[name]} and {tuner.name} ask for different {name} "
                    f"({changes[name]!r} and {value!r}); keep one"
                )
            changes[name], owner[name] = value, tuner.name
    try:
        return base.with_changes(changes)
    except ConfigError as exc:
        who = ", ".join(sorted(set(owner.values())))
        raise ConfigError(f"{who}: {exc}") from None


def _asks(tuner: Tuner, knobs: Mapping[str, Any]) -> dict[str, Any]:
    """The layout fields ``knobs`` ask for (the tuner's ``layout`` hook), failures in one line."""
    try:
        return dict(tuner.layout(knobs) or {})
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{tuner.name}: its layout hook failed: {type(exc).__name__}: {exc}"
        ) from exc
