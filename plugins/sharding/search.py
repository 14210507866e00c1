"""The search: the space of layouts and micro-batch splits, predicted and bounded; and the
in-job search over what switches at a step boundary.

**Planning.** Every setting of the space (:func:`space`: DDP or FSDP with and without
resharding after forward, CPU offload on an accelerator; no, full or selective
checkpointing, of every block or every other; 1, 2, 4 or 8 micro-batches at the same
samples per step) is predicted — step time and peak memory per rank. A setting whose
predicted peak leaves less than its margin of the bound free (:func:`margin`) is never
proposed. The
rest are ranked by predicted step; the plan proposes, in order, the fastest setting as an
in-job search over its build layout's fastest step-level variants (checkpointing and
micro-batches switch at a step boundary, so one trial measures several; a search of that
setting alone when no other variant fits), then the fastest
setting of each other build layout (a relaunch trial each), then the rest.

**In the job** (:func:`search_in_job`, on every rank): each variant is switched in at a
step boundary, warmed up for a step and timed for a few; the slowest rank's median counts.
A variant whose step still goes over the memory cap (the model was wrong) is recorded and
dropped on every rank alike. Rank 0 picks the fastest and broadcasts it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tunekit.api import Layout, broadcast_object, is_out_of_memory, release_memory
from tunekit.errors import ConfigError
from tunekit.plugins.sharding.model import Setting

if TYPE_CHECKING:
    from tunekit.api import Session
    from tunekit.plugins.sharding.calibrated import Prediction

MARGIN = 0.08
"""A setting is proposed only when its predicted peak leaves this fraction of the bound free
(the memory model's error, and what it does not see)..."""
SPLIT_MARGIN = 0.08
"""...and this much more when it splits the step into other micro-batches than the measured
baseline: the model extrapolates accumulation from one process (measured on 2 gloo ranks it
under-predicted such settings by up to 14%)."""
MIN_GAIN = 0.02
"""A setting is worth a trial when predicted faster than the baseline by this fraction."""
SEARCH_VARIANTS = 4
"""Step-level variants an in-job search tries at most."""
SEARCH_WITHIN = 0.25
"""...each predicted within this fraction of the fastest."""
CHECKPOINT_CHOICES = (("none", 1), ("full", 1), ("full", 2), ("selective", 1))
"""Checkpointing policies and strides the plan considers (on a model with blocks)."""
MOST_MICRO_BATCHES = 8


# -- the space ------------------------------------------------------------------------------


def space(
    base: Setting, world_size: int, device_type: str, has_blocks: bool, samples: int | None = None
) -> list[Setting]:
    """Every setting the plan predicts, the baseline's own included; with ``samples``, the
    same layouts and splits at that many samples per rank and step (a larger batch)."""
    samples = samples or base.samples
    from tunekit.plugins.sharding.measure import split_counts

    builds: list[dict[str, Any]] = [{"sharding": "ddp", "cpu_offload": False}]
    if world_size > 1:
        offloads = (False, True) if device_type == "cuda" else (False,)
        builds += [
            {"sharding": "fsdp", "reshard_after_forward": r, "cpu_offload": o}
            for r in (True, False)
            for o in offloads
        ]
    checkpoints = [{"checkpointing": "none", "checkpoint_blocks": None}]
    if has_blocks:
        checkpoints += [
            {"checkpointing": p, "checkpoint_every": k, "checkpoint_blocks": None}
            for p, k in CHECKPOINT_CHOICES
            if p != "none"
        ]
    out: list[Setting] = []
    for build in builds:
        for ckpt in checkpoints:
            layout = base.layout.with_changes({**build, **ckpt})
            for m in split_counts(samples, MOST_MICRO_BATCHES):
                out.append(Setting(layout, m, samples))
    if samples == base.samples and base not in out:
        out.append(base)
    return out


def larger_batches(batch: int, batch_range: tuple[int, int] | None) -> list[int]:
    """Per-rank batches the batch tuner could take that memory freed here might let fit:
    twice and four times the job's, inside its ``batch_range``."""
    if batch_range is None:
        return []
    return [b for b in (2 * batch, 4 * batch) if batch_range[0] <= b <= batch_range[1]]


def margin(s: Setting, base: Setting) -> float:
    """The share of the bound a setting's predicted peak must leave free: more where the
    model extrapolates (other micro-batches than the measured baseline's)."""
    same = (s.micro_batches, s.micro_batch) == (base.micro_batches, base.micro_batch)
    return MARGIN + (0.0 if same else SPLIT_MARGIN)


def fits(p: Prediction, bound: float, base: Setting) -> bool:
    return p.peak_bytes is not None and p.peak_bytes <= bound * (1 - margin(p.setting, base))


def build_key(layout: Layout) -> tuple[Any, ...]:
    return tuple(layout.build_part().values())


@dataclass(frozen=True)
class Proposal:
    """A setting to try, with the step-level variants an in-job search tries from it."""

    prediction: Prediction
    variants: tuple[Prediction, ...] = ()
    batch: int | None = None
    """A larger per-rank batch this layout lets fit (planned with the batch tuner's knob)."""

    @property
    def per_sample_s(self) -> float:
        return self.prediction.step_s / self.prediction.setting.samples


def propose(
    predictions: Sequence[Prediction], base: Prediction, bound: float, limit: int
) -> list[Proposal]:
    """What the plan proposes, in order (module docstring): only settings predicted to fit
    and to beat the baseline by :data:`MIN_GAIN`."""
    worth = sorted(
        (
            p
            for p in predictions
            if p.setting != base.setting
            and fits(p, bound, base.setting)
            and p.step_s < base.step_s * (1 - MIN_GAIN)
        ),
        key=lambda p: p.step_s,
    )
    if not worth or limit < 1:
        return []
    best = worth[0]
    variants = tuple(
        p
        for p in worth
        if build_key(p.setting.layout) == build_key(best.setting.layout)
        and p.step_s <= best.step_s * (1 + SEARCH_WITHIN)
    )[:SEARCH_VARIANTS]
    # The first is always a search (of one variant, when its build layout has no other
    # that fits): the orchestrator would otherwise search from the defaults, the job as it is.
    out = [Proposal(best, variants)]
    seen = {build_key(best.setting.layout)}
    for p in worth[1:]:  # the fastest of every other build layout
        if build_key(p.setting.layout) not in seen:
            seen.add(build_key(p.setting.layout))
            out.append(Proposal(p))
    taken = {id(x.prediction) for x in out} | {id(v) for v in variants}
    out += [Proposal(p) for p in worth if id(p) not in taken]
    return out[:limit]


def combined(
    larger: dict[int, Sequence[Prediction]],
    against: Proposal | None,
    base: Prediction,
    bound: float,
) -> list[Proposal]:
    """For each larger batch (per-rank batch -> its settings, predicted), the setting that
    fits and takes the least time per sample, when it beats ``against`` (the plan's best at
    the job's batch, else the baseline) per sample by :data:`MIN_GAIN`."""
    bar = against.per_sample_s if against is not None else base.step_s / base.setting.samples
    out = []
    for batch, predictions in sorted(larger.items()):
        # The job's own layout and passes at a larger batch are the batch tuner's candidate
        # alone: this tuner proposes a batch only with a change of its own that it needs, to
        # fit or to gain (selective checkpointing at no cost beside a batch that fits anyway
        # is no candidate of its own).
        own = (base.setting.layout, base.setting.micro_batches)
        fitting = [p for p in predictions if fits(p, bound, base.setting)]
        as_is = [p for p in fitting if (p.setting.layout, p.setting.micro_batches) == own]
        fitting = [p for p in fitting if (p.setting.layout, p.setting.micro_batches) != own]
        if not fitting:
            continue
        best = min(fitting, key=lambda p: p.step_s / p.setting.samples)
        if as_is and best.step_s > as_is[0].step_s * (1 - MIN_GAIN):
            continue
        proposal = Proposal(best, batch=batch)
        if proposal.per_sample_s < bar * (1 - MIN_GAIN):
            out.append(proposal)
    return sorted(out, key=lambda p: p.per_sample_s)


# -- the variants an in-job search tries ----------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """What switches at a step boundary: checkpointing (policy, stride) and micro-batches."""

    checkpointing: str
    every: int
    micro_batches: int

    def text(self) -> str:
        stride = f"/{self.every}" if self.every != 1 and self.checkpointing != "none" else ""
        return f"{self.checkpointing}{stride}:{self.micro_batches}"

    @classmethod
    def of(cls, s: Setting) -> Variant:
        layout = s.layout
        return cls(layout.checkpointing, layout.checkpoint_every, s.micro_batches)

    def knobs(self) -> dict[str, Any]:
        return {
            "checkpointing": self.checkpointing,
            "checkpoint_every": self.every,
            "checkpoint_blocks": "",
            "micro_batches": self.micro_batches,
        }


def format_variants(variants: Sequence[Variant]) -> str:
    return ",".join(v.text() for v in variants)


def parse_variants(text: str) -> list[Variant]:
    """``full:1,full/2:2,selective:1,none:4`` -> variants; ConfigError with one line."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        head, colon, micro = item.partition(":")
        policy, slash, every = head.partition("/")
        if not colon or policy not in ("none", "full", "selective"):
            raise ConfigError(
                f"search variant {item!r} is not POLICY[/EVERY]:MICRO_BATCHES "
                "(like full/2:4; POLICY none, full or selective)"
            )
        try:
            k, m = int(every) if slash else 1, int(micro)
        except ValueError:
            raise ConfigError(
                f"search variant {item!r}: stride and micro-batches are integers"
            ) from None
        if k < 1 or m < 1:
            raise ConfigError(f"search variant {item!r}: stride and micro-batches must be >= 1")
        out.append(Variant(policy, k, m))
    return out


# -- the search in the job ------------------------------------------------------------------

WARMUP_STEPS = 1
MEASURE_STEPS = 3


@dataclass
class Tried:
    variant: Variant
    status: str
    """``ok``, ``over cap`` (a step went over the memory cap: dropped) or ``budget``."""
    step_s: float | None = None
    peak_bytes: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "knobs": self.variant.knobs(),
            "variant": self.variant.text(),
            "status": self.status,
            "step_s": self.step_s,
            "peak_bytes": self.peak_bytes,
            "steps": WARMUP_STEPS + MEASURE_STEPS if self.status != "budget" else 0,
        }


def search_in_job(
    session: Session, variants: Sequence[Variant], max_steps: int
) -> tuple[Variant | None, list[Tried], str]:
    """Try ``variants`` in order on every rank; (the fastest, what was tried, why it stopped)."""
    tried: list[Tried] = []
    used, reason = 0, "every variant measured"
    per_try = WARMUP_STEPS + MEASURE_STEPS
    for v in variants:
        if used + per_try > max_steps:
            tried.append(Tried(v, "budget"))
            reason = f"step budget of {max_steps} spent"
            continue
        switch_to(session, v)
        used += per_try
        times: list[float] = []
        peaks: list[float] = []
        over = False
        for i in range(per_try):
            rec = step_or_out_of_memory(session)
            failed = 1.0 if rec is None else 0.0
            if _agreed_max(session, [failed])[0] > 0:  # every rank drops the variant together
                over = True
                break
            assert rec is not None
            if i >= WARMUP_STEPS:
                times.append(rec.step_s)
            if rec.metrics.get("peak_bytes") is not None:
                peaks.append(float(rec.metrics["peak_bytes"]))
        if over:
            tried.append(Tried(v, "over cap"))
            continue
        slowest = _agreed_max(session, [*times, max(peaks, default=-1.0)])
        peak = slowest.pop()
        tried.append(Tried(v, "ok", statistics.median(slowest), peak if peak >= 0 else None))
    measured = [t for t in tried if t.status == "ok" and t.step_s is not None]
    best = min(measured, key=lambda t: t.step_s or 0.0).variant if measured else None
    if best is None:
        reason += "; nothing could be measured"
    chosen = _decide(session, best)
    return chosen, tried, reason


def step_or_out_of_memory(session: Session) -> Any:
    """One training step (its record); None where it ran out of memory (over the device's
    memory or the cap), its gradients dropped and the cached memory given back."""
    try:
        return session.train_step()
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        # The step finished on every rank before its peak was checked.
        session.optimizer.zero_grad(set_to_none=True)
        release_memory(session.device)
        return None


def switch_to(session: Session, v: Variant) -> None:
    """Checkpointing and micro-batches as ``v`` says, at this step boundary."""
    session.set_checkpointing(v.checkpointing, v.every)
    session.set_micro_batches(v.micro_batches)


def _agreed_max(session: Session, values: list[float]) -> list[float]:
    if session.world_size <= 1 or not dist.is_initialized():
        return list(values)
    device = session.device if dist.get_backend(session.group) == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=session.group)
    return [float(x) for x in t.cpu()]


def _decide(session: Session, chosen: Variant | None) -> Variant | None:
    """Rank 0's choice on every rank (as plain text: ranks exchange JSON only)."""
    text = chosen.text() if chosen is not None else ""
    if session.world_size > 1 and dist.is_initialized():
        text = broadcast_object(text, src=0, group=session.group)
    return parse_variants(text)[0] if text else None
