"""Chunk layouts and the in-job chunk-size searches (pure: no torch).

Le et al. group consecutive layers into chunks whose gradients go to the
host together (Sec. 4.1), and search the chunk size while the job trains
(Algorithm 1, Sec. 4.2). Both are kept free of torch so that the paper's
traces can be checked exactly; the live loop that feeds them measured times
is :func:`tunekit.plugins.cgdp.runtime.search_in_job`.

Layers are numbered as in the paper: ``l`` is the last layer of the forward
pass (its gradient is ready first in backward), ``1`` the first.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


def chunk_layout(num_layers: int, k: int) -> list[list[int]]:
    """Chunks in backward order, each a list of paper layer numbers (``l`` first).

    Uniform chunks of ``k`` from the output end, the last layers of backward
    as singletons (Sec. 4.2): if ``l mod k = 0`` there are ``l/k - 1`` chunks
    of ``k`` (layers ``l .. k+1``) and ``k`` singletons; otherwise
    ``floor(l/k)`` chunks of ``k`` and ``l mod k`` singletons. ``k >= l``
    gives ``l`` singletons, the same layout as ``k = 1``.
    """
    if num_layers < 1:
        raise ValueError(f"a model needs at least one layer, not {num_layers}")
    if k < 1:
        raise ValueError(f"chunk size must be at least 1, not {k}")
    full = num_layers // k - 1 if num_layers % k == 0 else num_layers // k
    chunks = [list(range(num_layers - i * k, num_layers - (i + 1) * k, -1)) for i in range(full)]
    chunks += [[layer] for layer in range(num_layers - full * k, 0, -1)]
    return chunks


Layout = list[list[int]]
"""Chunks in backward order, each a list of paper layer numbers (see :func:`chunk_layout`)."""


def unit_layout(units: Sequence[str], k: int) -> Layout:
    """:func:`chunk_layout` over units instead of layers: ``units`` names each layer's unit
    (its transformer block, or the layer itself; forward order, as
    :func:`tunekit.observe.blocks.block_units` gives them) and a chunk holds ``k`` whole
    units, so that no chunk ends inside a block."""
    groups: list[list[int]] = []  # paper layer numbers of each unit, forward order
    for layer, unit in enumerate(units, start=1):
        if groups and units[layer - 2] == unit:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return [
        [layer for g in chunk for layer in reversed(groups[g - 1])]
        for chunk in chunk_layout(len(groups), k)
    ]


def as_layout(num_layers: int, k: int | Layout) -> Layout:
    """``k`` layers per chunk as a layout; a layout as it is (checked: every layer once)."""
    if isinstance(k, int):
        return chunk_layout(num_layers, k)
    if sorted(layer for chunk in k for layer in chunk) != list(range(1, num_layers + 1)):
        raise ValueError(f"a chunk layout must hold each of the {num_layers} layers once")
    return k


def chunk_sizes(num_layers: int, k: int) -> tuple[int, ...]:
    """Sizes of :func:`chunk_layout`'s chunks: equal tuples mean equal layouts."""
    return tuple(len(c) for c in chunk_layout(num_layers, k))


def next_candidate(chunk: int, step: int) -> int:
    """Algorithm 1's expansion rule (lines 18-22): +1 while below ``step``, then +``step``."""
    return chunk + 1 if chunk < step else chunk + step


def _check(step: int, range_: int, interval: int) -> None:
    if step < 1:
        raise ValueError(f"search step must be at least 1, not {step}")
    if range_ < 1:
        raise ValueError(f"search range must be at least 1, not {range_}")
    if interval < 1:
        raise ValueError(f"search interval must be at least 1 iteration, not {interval}")


@dataclass
class IntervalRecord:
    """One interval of an in-job search, as its state machine saw it."""

    interval: int
    """1-based index of the interval."""
    iteration: int
    """Training iteration at which the interval ended (``interval * length``)."""
    chunk: int
    """Chunk size the interval trained with."""
    time_s: float | None
    """Measured time of the interval (None when it was not used)."""
    best_chunk: int
    """Best chunk size after this interval."""
    action: str
    """``"new best"``, ``"slower"``, ``"stop"`` (Algorithm 1); the noise-aware
    search adds ``"incumbent"``, ``"undecided"``, ``"rejected"``, ``"accepted"``."""


class Algorithm1:
    """Le et al.'s Algorithm 1 as a state machine, one call per interval.

    ``step`` and ``range_`` are the paper's two parameters; ``interval`` is the
    number of iterations timed per candidate (10 in the paper). Drive it with
    :meth:`next_chunk` (the chunk to train the next interval with, ``None``
    once done) and :meth:`record` (that interval's time). It follows the
    printed algorithm exactly, including its last interval: when the stop
    rule fires at an interval's end, that interval's time is not used.
    """

    name = "algorithm1"

    def __init__(self, step: int = 10, range_: int = 5, interval: int = 10):
        _check(step, range_, interval)
        self.step, self.range_, self.interval = step, range_, interval
        self.chunk = 1
        self.best_chunk = 1
        self.lapse_min = math.inf
        self.done = False
        self.history: list[IntervalRecord] = []

    @property
    def intervals(self) -> int:
        """Intervals run so far."""
        return len(self.history)

    @property
    def iterations(self) -> int:
        return self.intervals * self.interval

    def next_chunk(self) -> int | None:
        """The chunk size for the next interval, or ``None`` when the search is over."""
        return None if self.done else self.chunk

    def record(self, step_times: Sequence[float] = (), lapse: float | None = None) -> None:
        """The interval just trained with :meth:`next_chunk` took ``lapse`` seconds.

        Without ``lapse`` the sum of ``step_times`` is used.
        """
        if self.done:
            raise RuntimeError("Algorithm 1 already stopped")
        if lapse is None:
            lapse = float(sum(step_times))
        self.end_interval(lapse)

    def end_interval(self, lapse: float) -> int:
        """Lines 7-25 at an interval's end; return the chunk for the next interval."""
        ran = self.chunk
        index = self.intervals + 1
        if self.chunk >= self.best_chunk + self.step * self.range_:  # lines 8-10
            self.chunk = self.best_chunk
            self.done = True
            self.history.append(
                IntervalRecord(index, index * self.interval, ran, None, self.best_chunk, "stop")
            )
            return self.chunk
        action = "slower"
        if lapse < self.lapse_min:  # lines 14-16
            self.lapse_min = lapse
            self.best_chunk = self.chunk
            action = "new best"
        self.chunk = next_candidate(self.chunk, self.step)  # lines 18-22
        self.history.append(
            IntervalRecord(index, index * self.interval, ran, lapse, self.best_chunk, action)
        )
        return self.chunk

    def found_at(self) -> int | None:
        """Iteration at whose end the final best chunk was measured."""
        hits = [
            r.iteration
            for r in self.history
            if r.action == "new best" and r.chunk == self.best_chunk
        ]
        return hits[-1] if hits else None


@dataclass
class _Comparison:
    chunk: int
    verdicts: list[str | None] = field(default_factory=list)
    """One per round: the candidate's interval against the incumbent's just before it."""
    incumbent: list[float] = field(default_factory=list)
    """The incumbent interval the next round pairs with."""
    pooled: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    """Every round's candidate and incumbent samples, for the last-round decision."""

    @property
    def rounds(self) -> int:
        return len(self.verdicts)


class NoiseAwareChunkSearch:
    """Algorithm 1's candidates and stop rule, with decisions that survive noise.

    Differences from the paper's algorithm, each for a measured reason:

    * a candidate is compared with the incumbent best on per-iteration times,
      interleaved (candidate interval, incumbent interval, ...) so that drift
      hits both; the first ``warmup`` iterations after each switch are dropped;
    * each round compares the candidate's interval with the incumbent interval
      just before it by a Mann-Whitney U test (``p < alpha``); a round that
      finds the candidate slower rejects it, but acceptance needs
      ``accept_rounds`` rounds in a row that find it faster: a burst of load
      then spoils one round, not the decision (a wrong acceptance is what the
      search would end with);
    * after ``max_rounds`` rounds without a decision, all rounds' samples are
      pooled for one last test; if that cannot tell either, the candidate does
      not replace the incumbent (ties go to the incumbent);
    * candidates whose layout equals one already measured are skipped (with
      ``num_layers`` known, every ``k >= l`` is the layout of ``k = 1``);
    * the stop rule is checked before a candidate runs, so no interval is
      spent on a candidate that will be ignored.

    Same driving interface as :class:`Algorithm1`: :meth:`next_chunk` then
    :meth:`record` with the interval's per-iteration times.
    """

    name = "noise_aware"

    def __init__(
        self,
        step: int = 10,
        range_: int = 5,
        interval: int = 10,
        *,
        num_layers: int | None = None,
        warmup: int = 1,
        max_rounds: int = 3,
        accept_rounds: int = 2,
        alpha: float = 0.05,
        min_effect: float = 0.0,
    ):
        _check(step, range_, interval)
        if not 0 <= warmup < interval:
            raise ValueError(f"warmup ({warmup}) must be below the interval ({interval})")
        if not 1 <= accept_rounds <= max_rounds:
            raise ValueError(
                f"accept_rounds ({accept_rounds}) must be between 1 and max_rounds ({max_rounds})"
            )
        self.accept_rounds = accept_rounds
        self.step, self.range_, self.interval = step, range_, interval
        self.num_layers = num_layers
        self.warmup, self.max_rounds, self.alpha, self.min_effect = (
            warmup,
            max_rounds,
            alpha,
            min_effect,
        )
        self.best_chunk = 1
        self.done = False
        self.history: list[IntervalRecord] = []
        self._last_incumbent: list[float] = []
        self._candidate: int | None = None  # the next candidate to try
        self._cmp: _Comparison | None = None
        self._running: tuple[int, str] = (1, "incumbent")
        self._seen: set[tuple[int, ...]] = {self._key(1)}

    @property
    def intervals(self) -> int:
        return len(self.history)

    @property
    def iterations(self) -> int:
        return self.intervals * self.interval

    def _key(self, k: int) -> tuple[int, ...]:
        return chunk_sizes(self.num_layers, k) if self.num_layers else (k,)

    def _advance(self, after: int) -> None:
        """Pick the next candidate after ``after``, skipping measured layouts; stop per the range rule."""
        k = after
        while True:
            k = next_candidate(k, self.step)
            if k >= self.best_chunk + self.step * self.range_:
                self.done = True
                self._candidate = None
                return
            if self._key(k) not in self._seen:
                self._candidate = k
                return

    def next_chunk(self) -> int | None:
        if self.done:
            return None
        if not self.history:
            self._running = (1, "incumbent")
        elif self._cmp is None:
            self._cmp = _Comparison(self._candidate)
            self._seen.add(self._key(self._candidate))
            self._running = (self._candidate, "candidate")
        else:  # the comparison needs a fresh incumbent interval, then its candidate
            role = "incumbent" if self._running[1] == "candidate" else "candidate"
            self._running = (self.best_chunk if role == "incumbent" else self._cmp.chunk, role)
        return self._running[0]

    def record(self, step_times: Sequence[float], lapse: float | None = None) -> None:
        if self.done:
            raise RuntimeError("the search already stopped")
        samples = [float(t) for t in step_times[self.warmup :]]
        if not samples:
            raise ValueError("an interval needs at least one iteration after warm-up")
        chunk, role = self._running
        index = self.intervals + 1
        total = float(sum(step_times)) if lapse is None else lapse
        if not self.history:  # the first interval measures chunk 1, the first incumbent
            self._last_incumbent = samples
            self.history.append(
                IntervalRecord(index, index * self.interval, chunk, total, 1, "incumbent")
            )
            self._advance(1)
            return
        cmp = self._cmp
        if role == "incumbent":
            cmp.incumbent = samples
            self._last_incumbent = samples
            self.history.append(
                IntervalRecord(
                    index, index * self.interval, chunk, total, self.best_chunk, "incumbent"
                )
            )
            return
        # Each round compares the candidate's interval with the incumbent interval just
        # before it (the first round: the incumbent's latest), so a burst of load that
        # covers one interval spoils one round only.
        paired = cmp.incumbent or self._last_incumbent
        cmp.verdicts.append(self._decide(samples, paired))
        cmp.pooled[0].extend(samples)
        cmp.pooled[1].extend(paired)
        streak = 0
        for v in reversed(cmp.verdicts):
            if v != "better":
                break
            streak += 1
        if cmp.verdicts[-1] == "worse":
            verdict = "worse"
        elif streak >= self.accept_rounds:
            verdict = "better"
        elif cmp.rounds >= self.max_rounds:
            # Rounds alone could not tell: decide on all of them pooled; a tie keeps the incumbent.
            verdict = "better" if self._decide(*cmp.pooled) == "better" else "worse"
        else:
            verdict = None
        action = {"better": "accepted", "worse": "rejected", None: "undecided"}[verdict]
        if verdict == "better":
            self.best_chunk = cmp.chunk
            self._last_incumbent = samples
        self.history.append(
            IntervalRecord(index, index * self.interval, chunk, total, self.best_chunk, action)
        )
        if verdict is not None:
            self._cmp = None
            self._advance(cmp.chunk)

    def _decide(self, candidate: list[float], incumbent: list[float]) -> str | None:
        """ "better", "worse", or None while the two intervals cannot be told apart."""
        if len(candidate) < 2 or len(incumbent) < 2:
            return None
        from scipy.stats import mannwhitneyu  # SciPy costs 0.4 s to import: only when deciding

        p = mannwhitneyu(candidate, incumbent, alternative="two-sided").pvalue
        if p >= self.alpha:
            return None
        cand, inc = statistics.median(candidate), statistics.median(incumbent)
        return "better" if cand < inc * (1.0 - self.min_effect) else "worse"

    def found_at(self) -> int | None:
        hits = [
            r.iteration
            for r in self.history
            if r.action == "accepted" and r.chunk == self.best_chunk
        ]
        return (
            hits[-1]
            if hits
            else (self.history[0].iteration if self.best_chunk == 1 and self.history else None)
        )
