"""Phase 5 of the contract: a knob not marked ``changes_math`` keeps the job's mathematics.

For each knob set to check, a short training in float64 under the tuner's
hook is compared with the untuned job's, step for step (losses) and at the end
(every parameter), within :data:`~tunekit.testing.ranks.EQUIVALENCE_RTOL`: in
float64 two runs of the same mathematics differ by summation order only
(~1e-15), so anything beyond the tolerance is a hook that changed what the
model computes (an input detached, a gradient dropped, a learning rate moved).

:func:`equivalence_cases` picks the knob sets; :func:`equivalence_on_ranks`
runs them on the ranks of a process group (one rank in this process, or each
spawned rank), so the caller decides how many processes a check costs.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from tunekit.config import TuningConfig
from tunekit.contract import Tuner
from tunekit.errors import TunekitError
from tunekit.failures import Failure
from tunekit.runtime.session import Session
from tunekit.testing.ranks import EQUIVALENCE_RTOL, default_dtype
from tunekit.workload import Workload

EQUIVALENCE_STEPS = 3
"""Steps each float64 run trains: the first loss shows a changed forward, the later ones a
changed gradient or update."""

Outcome = Literal["same", "differs", "refused", "failed"]


@dataclass
class EquivalenceCheck:
    """One knob set trained in float64 against the untuned job, on ``ranks`` ranks."""

    knobs: dict[str, Any]
    """The knob set (validated, defaults filled)."""
    varied: list[str]
    """Its knobs off their defaults (none marked ``changes_math``)."""
    ranks: int
    outcome: Outcome
    """``same``: within the tolerance; ``differs``: beyond it; ``refused``: the hook declined
    these knobs on this job in one line (a value the harness chose itself); ``failed``: it
    raised."""
    detail: str = ""
    """What differed (the first parameter, the first loss) or what was raised."""
    blamed: list[str] = field(default_factory=list)
    """For ``differs``: the knobs that change the training on their own (all of ``varied``
    when only their combination does)."""
    generated: bool = False
    """The harness chose this knob set (a bool or choice knob no checked set moved)."""

    def problem(self, steps: int) -> str | None:
        """The line a plugin author reads, for a check that did not pass."""
        ranks = f"{self.ranks} rank{'s' if self.ranks > 1 else ''}"
        moved = {k: self.knobs[k] for k in self.varied}
        if self.outcome == "differs":
            names = ", ".join(repr(k) for k in self.blamed)
            which = "knob" if len(self.blamed) == 1 else "knobs"
            return (
                f"{which} {names} (not marked changes_math) change{'s' if len(self.blamed) == 1 else ''} "
                f"the training: {moved} trained {steps} steps on {ranks} in float64, against the "
                f"untuned job: {self.detail} (tolerance {EQUIVALENCE_RTOL:g}); mark the knob "
                "changes_math=True if it changes the arithmetic on purpose"
            )
        if self.outcome == "failed":
            if not moved:
                return f"float64 equivalence check on {ranks}: {self.detail}"
            return f"float64 equivalence run with {moved} on {ranks}: {self.detail}"
        return None


def equivalence_cases(
    tuner: Tuner, knob_sets: Sequence[Mapping[str, Any]]
) -> tuple[list[tuple[dict[str, Any], bool]], list[str]]:
    """The knob sets to train against the untuned job, and the knobs left unchecked.

    Each checked knob set with its ``changes_math`` knobs put back to their defaults
    (a set that then equals the defaults is skipped); then, for every ``bool`` and
    ``choice`` knob not marked ``changes_math`` that no set moved, the defaults with that
    knob at each other value (``generated``). ``int``, ``float`` and ``str`` knobs no set
    moved are returned as unchecked: the harness cannot choose a meaningful value for them.
    """
    declared = tuner.knob_map()
    defaults = tuner.defaults()
    cases: list[tuple[dict[str, Any], bool]] = []
    for knobs in knob_sets:
        full = tuner.validate(knobs)
        neutral = {n: defaults[n] if declared[n].changes_math else v for n, v in full.items()}
        if neutral != defaults and all(neutral != c for c, _ in cases):
            cases.append((neutral, False))
    moved = {n for c, _ in cases for n, v in c.items() if v != defaults[n]}
    unchecked = []
    for knob in declared.values():
        if knob.changes_math or knob.name in moved:
            continue
        if knob.type == "bool":
            others: Sequence[Any] = [not knob.default]
        elif knob.type == "choice":
            others = [c for c in knob.choices if c != knob.default]
        else:
            unchecked.append(knob.name)
            continue
        cases += [({**defaults, knob.name: value}, True) for value in others]
    return cases, unchecked


@dataclass
class _Trained:
    losses: list[float]
    params: dict[str, torch.Tensor]


def _train(
    tuner: Tuner,
    workload: Workload,
    knobs: Mapping[str, Any] | None,
    steps: int,
    rank: int,
    world: int,
    device: str,
) -> _Trained:
    """``steps`` steps of a fresh session (the same initial parameters every time), under
    ``knobs`` (None: the untuned job); parameters read after the session is reset."""
    session = Session(workload, rank=rank, world_size=world, device=torch.device(device))
    try:
        if knobs is not None:
            session.apply_config(TuningConfig({tuner.name: dict(knobs)}), {tuner.name: tuner})
        losses = _mean_over_ranks([session.train_step().loss for _ in range(steps)], world)
        session.flush()
        session.reset()  # a hook that renamed or wrapped modules puts them back
        params = {n: p.detach().to("cpu", copy=True) for n, p in session.model.named_parameters()}
    finally:
        session.close()
    return _Trained(losses, params)


def _mean_over_ranks(losses: list[float], world: int) -> list[float]:
    """Each step's loss averaged over the ranks: the job's loss whatever share of the batch
    each rank reports it on (its own samples under data parallelism, all of them under a
    placement)."""
    if world <= 1:
        return losses
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / world).tolist()


def _first_difference(want: _Trained, got: _Trained, rtol: float = EQUIVALENCE_RTOL) -> str:
    """The first parameter (in the model's order) and the first loss beyond the tolerance,
    in words; empty when the runs agree."""
    parts = []
    for name, ref in want.params.items():
        mine = got.params.get(name)
        if mine is None or mine.shape != ref.shape:
            parts.append(f"parameter {name!r} is missing or reshaped")
            break
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        gap = (mine - ref).abs()
        if bool((gap > rtol * ref.abs() + rtol * scale).any()):
            parts.append(
                f"parameter {name!r} differs by {float(gap.max()):.3g} "
                f"({float(gap.max()) / (scale or 1.0):.2%} of its largest value)"
            )
            break
    for step, (a, b) in enumerate(zip(want.losses, got.losses, strict=True)):
        if abs(a - b) > rtol * max(abs(a), 1e-12):
            parts.append(f"the loss differs from step {step} on ({b:.6g} against {a:.6g})")
            break
    return " and ".join(parts)


def _float64_problem(run: _Trained) -> str:
    wrong = [n for n, p in run.params.items() if p.is_floating_point() and p.dtype != torch.float64]
    if wrong:
        return (
            f"the workload does not train in float64 (parameter {wrong[0]!r} is "
            f"{run.params[wrong[0]].dtype}): build the model and batches in the default dtype"
        )
    return ""


def _agree(flag: bool, world: int) -> bool:
    """Whether ``flag`` holds on any rank: every rank then takes the same path."""
    if world <= 1 or not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _attempt(
    tuner: Tuner,
    workload: Workload,
    knobs: Mapping[str, Any],
    steps: int,
    rank: int,
    world: int,
    device: str,
) -> tuple[_Trained | None, Outcome | None, str]:
    try:
        return _train(tuner, workload, knobs, steps, rank, world, device), None, ""
    except TunekitError as exc:  # the hook declined these knobs on this job, in one line
        return None, "refused", str(exc)
    except Exception as exc:
        failure = Failure.of(exc, type(tuner))
        at = f" at {failure.where}" if failure.where else ""
        return (
            None,
            "failed",
            f"{failure.line}{at}\n" + textwrap.indent(failure.traceback.rstrip(), "      "),
        )


def equivalence_on_ranks(
    tuner: Tuner,
    workload: Workload,
    cases: Sequence[tuple[dict[str, Any], bool]],
    steps: int,
    rank: int,
    world: int,
    device: str = "cpu",
) -> list[EquivalenceCheck]:
    """Each case trained in float64 against the untuned job, on this rank of a ``world``-rank
    group (every rank calls it with the same arguments). A case that differs and moved
    several knobs is retried knob by knob, to name the one that changes the training."""
    defaults = tuner.defaults()
    out: list[EquivalenceCheck] = []
    with default_dtype(torch.float64):
        try:
            untuned = _train(tuner, workload, None, steps, rank, world, device)
        except Exception as exc:
            why = f"the untuned job does not train in float64 ({type(exc).__name__}: {exc})"
            return [EquivalenceCheck(defaults, [], world, "failed", why)]
        if wrong := _float64_problem(untuned):
            return [EquivalenceCheck(defaults, [], world, "failed", wrong)]
        for knobs, generated in cases:
            varied = [n for n, v in knobs.items() if v != defaults[n]]
            run, outcome, detail = _attempt(tuner, workload, knobs, steps, rank, world, device)
            if run is None:
                assert outcome is not None
                out.append(EquivalenceCheck(knobs, varied, world, outcome, detail, [], generated))
                continue
            detail = _first_difference(untuned, run)
            if not _agree(bool(detail), world):
                out.append(EquivalenceCheck(knobs, varied, world, "same", "", [], generated))
                continue
            blamed = varied
            if len(varied) > 1:
                alone = []
                for name in varied:
                    solo, _, _ = _attempt(
                        tuner, workload, {**defaults, name: knobs[name]}, steps, rank, world, device
                    )
                    if _agree(solo is not None and bool(_first_difference(untuned, solo)), world):
                        alone.append(name)
                blamed = alone or varied
            detail = detail or "another rank's parameters"
            out.append(EquivalenceCheck(knobs, varied, world, "differs", detail, blamed, generated))
    return out
