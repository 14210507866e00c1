"""How much measuring tunekit does before its trials: ``$TUNEKIT_MEASURE_EFFORT``.

Before any trial runs, tunekit and its tuners time things on this machine:
the collectives (the probe), every layer, a tuner's own figures (cgdp's
backward passes and host copies, layer_split's split layers, batch_ps_sizing's
larger batches, hybrid_mp's executor overheads, overlap_chunking's update
step). ``TUNEKIT_MEASURE_EFFORT`` scales all of it: a fraction in (0, 1],
1 by default. At 0.25 each measurement times a quarter of its usual repeats
(never fewer than the least it needs) and a time budget is a quarter as long:
a quicker look at a large model, whose ranges come out wider. The test suite
runs at 0.1 (the root ``conftest.py``): its checks are about what the figures
say and how they are used, not how tight they are.

No torch here: the CLI reads it before any command imports torch.
"""

from __future__ import annotations

import math
import os

from tunekit.errors import ConfigError

EFFORT_ENV = "TUNEKIT_MEASURE_EFFORT"


def measure_effort() -> float:
    """The share of their usual measuring that measurements do (``$TUNEKIT_MEASURE_EFFORT``)."""
    text = os.environ.get(EFFORT_ENV, "").strip()
    if not text:
        return 1.0
    try:
        effort = float(text)
    except ValueError:
        effort = math.nan
    if not 0.0 < effort <= 1.0:  # NaN fails too
        raise ConfigError(
            f"{EFFORT_ENV}={text!r}: give a fraction of the usual measuring above 0 and at "
            "most 1, like 0.25"
        )
    return effort


def effort_repeats(repeats: int, least: int = 2) -> int:
    """``repeats`` scaled by :func:`measure_effort`: at least ``least``, at most ``repeats``."""
    return min(repeats, max(least, math.ceil(repeats * measure_effort())))


def effort_seconds(seconds: float) -> float:
    """A time budget for measuring, scaled by :func:`measure_effort`."""
    return seconds * measure_effort()
