"""A diagnosis read at a glance (its headline) and in full (its body, as short points).

A tuner may supply ``Diagnosis.headline``; a third-party tuner that does not still gets
one, derived here from its verdict, gain and summary, so the CLI, the report and the TUI
print one line per tuner whatever the plugin wrote.
"""

from __future__ import annotations

import re
from typing import Protocol

HEADLINE_MAX = 100
"""Characters a headline may take (a terminal line beside the tuner's name)."""


class Diagnosable(Protocol):
    """What a headline is made from: a :class:`~tunekit.contract.Diagnosis` or its event."""

    applies: bool
    summary: str
    expected_gain: float | None
    headline: str


def verdict_word(applies: bool) -> str:
    return "applies" if applies else "does not apply"


def headline_of(diagnosis: Diagnosable, limit: int = HEADLINE_MAX) -> str:
    """The tuner's own headline, or one derived from its verdict, gain and summary's
    first point; never longer than ``limit`` characters."""
    own = " ".join((getattr(diagnosis, "headline", "") or "").split())
    if own:
        return clip(own, limit)
    parts = [verdict_word(diagnosis.applies)]
    if diagnosis.applies and diagnosis.expected_gain is not None:
        parts.append(f"+{diagnosis.expected_gain:.0%}")
    points = body_points(diagnosis.summary)
    if points:
        parts.append(points[0])
    return clip(" · ".join(parts), limit)


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
