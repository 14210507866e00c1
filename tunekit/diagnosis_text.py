"""A diagnosis read at a glance (its headline) and in full (its body, as short points).

A tuner may supply ``Diagnosis.headline``; a third-party tuner that does not still gets
one, derived here from its verdict, gain and summary, so the CLI, the report and the TUI
print one line per tuner whatever the plugin wrote. :func:`compose_headline` writes one the
way every built-in tuner does (``tunekit.api`` gives it to plugins). After the trials,
:func:`outcomes` sets each verdict beside what its trials measured, with a note wherever
the two differ, so that a report or a screen never shows a verdict its table contradicts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

HEADLINE_MAX = 100
"""Characters a headline may take (a terminal line beside the tuner's name)."""


class Diagnosable(Protocol):
    """What a headline is made from: a :class:`~tunekit.contract.Diagnosis` or its event."""

    applies: bool
    summary: str
    expected_gain: float | None
    headline: str


def verdict_word(applies: bool) -> str:
    """``applies`` or ``does not apply``: how every headline starts unless a tuner words it."""
    return "applies" if applies else "does not apply"


def signed_pct(x: float) -> str:
    """``+3%``, ``−12%`` (a true minus sign), ``0%``."""
    text = f"{x:+.0%}"
    return "0%" if text in ("+0%", "-0%") else text.replace("-", "−")


def gain_text(gain: float, gain_range: tuple[float, float] | None = None) -> str:
    """An expected gain with its range: ``+3% (−1…+6%)``."""
    text = signed_pct(gain)
    if gain_range is not None:
        low, high = sorted(gain_range)
        text += f" ({signed_pct(low).rstrip('%')}…{signed_pct(high)})"
    return text


def compose_headline(
    verdict: bool | str,
    gain: float | None = None,
    gain_range: tuple[float, float] | None = None,
    figure: str = "",
    limit: int = HEADLINE_MAX,
) -> str:
    """A tuner's headline in the form every tuner shares: verdict · gain (range) · figure.

    ``verdict``: whether it applies, or a phrase of its own ("too close to call");
    ``gain``: the expected fraction of step time saved per sample (negative: lost), with
    its ``gain_range`` where the model gives one; ``figure``: the one measured figure the
    verdict rests on (``obs.truth.phrase("comm_exposed", short=True)``). Never longer than
    ``limit``: the figure is cut first.
    """
    head = [verdict_word(verdict) if isinstance(verdict, bool) else verdict]
    if gain is not None:
        head.append(gain_text(gain, gain_range))
    text = " · ".join(head)
    if figure:
        room = limit - len(text) - len(" · ")
        text += " · " + clip(" ".join(figure.split()), max(room, 12))
    return clip(text, limit)


def headline_of(diagnosis: Diagnosable, limit: int = HEADLINE_MAX) -> str:
    """The tuner's own headline, or one derived from its verdict, gain and summary's
    first point; never longer than ``limit`` characters."""
    own = " ".join((getattr(diagnosis, "headline", "") or "").split())
    if own:
        return clip(own, limit)
    gain = diagnosis.expected_gain if diagnosis.applies else None
    points = body_points(diagnosis.summary)
    figure = points[0] if points else ""
    text = compose_headline(diagnosis.applies, gain, figure=figure, limit=10 * limit)
    if len(text) > limit:  # a long first point reads better without its parentheses than cut
        text = compose_headline(diagnosis.applies, gain, figure=_without_asides(figure))
    return clip(text, limit)


def _without_asides(text: str) -> str:
    """``text`` less its parenthesised asides (outermost pairs), spaces tidied."""
    out, depth = [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return re.sub(r"\s+([,;:.])", r"\1", " ".join("".join(out).split()))


_SPLIT = re.compile(r";\s+|(?<=[.!?])\s+(?=[A-Z(])")


def body_points(summary: str) -> list[str]:
    """A summary as short points: its clauses split at semicolons and sentence ends
    (parentheses kept whole)."""
    text = " ".join((summary or "").split())
    if not text:
        return []
    points: list[str] = []
    depth = 0
    start = 0
    for m in _SPLIT.finditer(text):
        depth = text.count("(", 0, m.start()) - text.count(")", 0, m.start())
        if depth > 0:
            continue
        points.append(text[start : m.start()].rstrip(" ;"))
        start = m.end()
    points.append(text[start:].rstrip(" ;"))
    return [p for p in points if p]


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters at a word boundary, with an ellipsis."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;·") + "…"


# -- after the trials: what each tuner's verdict came to ----------------------------------------


@dataclass
class TunerOutcome:
    """One tuner's diagnosis beside what its trials measured: what a report's or a screen's
    row of that tuner shows, so that its verdict and the table never contradict each other."""

    plugin: str
    headline: str
    applies: bool
    expected_gain: float | None
    runs: int = 0
    """Measured runs of its best config (a candidate or its in-job search, confirmations)."""
    configs: int = 0
    """Its own configs measured (combinations with other tuners' not counted)."""
    best: str = ""
    """Its best measured config: ``overlap_chunking(k=7, mode=two_chunk)``."""
    speedup: float | None = None
    """That config's measured samples/s over the baseline's."""
    significant: bool = False
    """That speed-up is beyond noise and ``--min-effect``."""
    won: bool = False
    """Part of the winning config."""
    note: str = ""
    """Why the measurement and the verdict differ ("" where they agree)."""

    def measured(self) -> str:
        """``1.25x (2 runs)``, ``1.25x (1 run; 3 configs tried)``, or ``not tried``."""
        if self.speedup is None:
            return "not tried"
        runs = f"{self.runs} run{'s' if self.runs != 1 else ''}"
        tried = f"; {self.configs} configs tried" if self.configs > 1 else ""
        return f"{self.speedup:.2f}x ({runs}{tried})"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "measured": self.measured()}


def outcomes(
    diagnoses: Mapping[str, Mapping[str, Any]], decision: Mapping[str, Any]
) -> list[TunerOutcome]:
    """Every diagnosed tuner's verdict beside its trials and the decision (``decide``'s dict),
    with a note wherever the two tell different stories: a tuner whose model expected nothing
    (or said it does not apply) yet measured a gain or won, saying what found it (its trial,
    its in-job search, a combination); a tuner that expected a gain its trials did not show."""
    rows = decision.get("candidates") or []
    winner_plugins = set((decision.get("winner_config") or {}).get("plugins") or {})
    if decision.get("winner", "baseline") == "baseline":
        winner_plugins = set()
    winner_row = next((r for r in rows if r.get("trial_id") == decision.get("winner_trial")), None)
    out = []
    for name, d in diagnoses.items():
        o = TunerOutcome(
            name,
            headline_of(_Stored(d)),
            bool(d.get("applies")),
            d.get("expected_gain"),
            won=name in winner_plugins,
        )
        own = [r for r in rows if r.get("plugin") == name and r.get("comparison")]
        if own:
            top = max(own, key=lambda r: r["comparison"]["speedup"])
            o.runs, o.configs = int(top.get("runs") or 0), len(own)
            o.best, o.speedup = top.get("description", ""), top["comparison"]["speedup"]
            o.significant = bool(top["comparison"].get("significant"))
        o.note = _note(o, winner_row, float(decision.get("min_effect") or 0.01))
        out.append(o)
    return out


def _note(o: TunerOutcome, winner_row: Mapping[str, Any] | None, min_effect: float) -> str:
    expected_nothing = not o.applies or o.expected_gain is None or o.expected_gain <= min_effect
    said = (
        "its model said it does not apply"
        if not o.applies
        else "its model expected no gain to speak of"
        if expected_nothing
        else f"its model expected {signed_pct(o.expected_gain or 0.0)}"
    )
    if o.won and winner_row is not None:
        how = _how_found(o.plugin, winner_row)
        if expected_nothing:
            return f"won: {said}, but {how} measured {winner_row['comparison']['speedup']:.2f}x"
        return ""
    if o.significant and expected_nothing:
        return f"{said}, but its trial measured {o.speedup:.2f}x ({o.best}); another config won"
    if o.applies and not expected_nothing and o.speedup is not None and not o.significant:
        return f"{said}; its trials measured {o.speedup:.2f}x, no gain beyond noise"
    return ""


def _how_found(plugin: str, row: Mapping[str, Any]) -> str:
    """How the winning config came about, for a note: its in-job search, a combination, a trial."""
    role = row.get("role")
    others = sorted(set((row.get("config") or {}).get("plugins") or {}) - {plugin})
    if role == "search" and row.get("plugin") == plugin:
        return f"its in-job search found {row.get('description', '')}, which"
    if others:
        return f"combined with {', '.join(others)} ({row.get('description', '')}), it"
    return f"its trial of {row.get('description', '')}"


class _Stored:
    """A stored diagnosis (a dict) as :func:`headline_of` reads one."""

    def __init__(self, d: Mapping[str, Any]):
        self.applies = bool(d.get("applies"))
        self.summary = d.get("summary") or ""
        self.expected_gain = d.get("expected_gain")
        self.headline = d.get("headline") or ""
