"""Short human renderings of the numbers the screens show."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tunekit.config import TuningConfig

DASH = "—"


def ms(seconds: float | None, digits: int = 1) -> str:
    """0.2318 -> '231.8 ms'."""
    return DASH if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def pct(fraction: float | None) -> str:
    """0.31 -> '31%'."""
    return DASH if fraction is None else f"{fraction * 100:.0f}%"


def size(nbytes: float | None) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    if nbytes is None:
        return DASH
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop returns first


def rate(nbytes_per_s: float | None) -> str:
    return DASH if nbytes_per_s is None else f"{size(nbytes_per_s)}/s"


def number(x: float | None, digits: int = 1) -> str:
    return DASH if x is None else f"{x:,.{digits}f}"


def compact(x: float) -> str:
    """A scale's number in at most ~5 characters: 0.0231, 2.28, 232, 1234, 12.3k, 4.1M."""
    a = abs(x)
    if a >= 1e6:
        return f"{x / 1e6:.3g}M"
    if a >= 1e4:
        return f"{x / 1e3:.3g}k"
    if a >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def scale_numbers(lo: float, hi: float) -> tuple[str, str]:
    """A scale's two ends, with as many decimals as tell them apart (2.28 and 2.30, not 2.3
    twice; 210 and 250, not 210.0)."""
    top = max(abs(lo), abs(hi))
    if top >= 1e4:
        return compact(lo), compact(hi)
    span = hi - lo
    if span > 0:
        decimals = 1 - math.floor(math.log10(span))
    else:
        decimals = 2 - math.floor(math.log10(top)) if top else 0
    decimals = min(max(decimals, 0), 4)
    return f"{lo:.{decimals}f}", f"{hi:.{decimals}f}"


def duration(seconds: float | None) -> str:
    """A time left in words: '40 s', '3 min', '1 h 20 min'."""
    if seconds is None:
        return DASH
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"


def speedup(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f}x"


def describe_config(config: Mapping[str, Any] | None) -> str:
    """A config dict as one line (``overlap_chunking(bucket_cap_mb=8)``, or ``baseline``)."""
    if not config:
        return "baseline"
    return TuningConfig.from_dict(dict(config)).describe()


def knob_lines(config: Mapping[str, Any] | None) -> list[tuple[str, str, Any]]:
    """``(plugin, knob, value)`` for every knob of a config dict, sorted."""
    if not config:
        return []
    plugins = TuningConfig.from_dict(dict(config)).plugins
    return [
        (name, knob, value)
        for name in sorted(plugins)
        for knob, value in sorted(plugins[name].items())
    ]


def per_sample_rate(seconds_per_sample: float | None) -> str:
    """Seconds per sample shown as throughput ("1,234 samples/s")."""
    return "—" if not seconds_per_sample else f"{1 / seconds_per_sample:,.0f} samples/s"
