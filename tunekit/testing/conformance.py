"""The tuner contract, checked phase by phase: declare, diagnose, plan, runtime.

:func:`check_conformance` runs every phase and raises :class:`ConformanceError`
naming every problem; :func:`check_declaration`, :func:`check_diagnose_and_plan`
and :func:`check_runtime` are the phases on their own.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import pickle
import re
import textwrap
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tunekit import API_VERSION
from tunekit.config import TuningConfig
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.failures import Failure
from tunekit.observe.observation import Observation
from tunekit.runtime.dist import single_rank_group
from tunekit.runtime.session import Session
from tunekit.testing.equivalence import (
    EQUIVALENCE_STEPS,
    EquivalenceCheck,
    equivalence_cases,
    equivalence_on_ranks,
)
from tunekit.testing.fixtures import tiny_workload
from tunekit.testing.ranks import run_ranks
from tunekit.testing.snapshots import (
    SessionState,
    _changed_params,
    _children,
    _leftovers,
    _param_values,
    _python_threads,
    compare_states,
    snapshot_session,
)
from tunekit.testing.synthetic import synthetic_observation
from tunekit.workload import Workload, load_workload


class ConformanceError(AssertionError):
    """A plugin does not honour the tuner contract; the message lists every problem."""


@dataclass
class ConformanceReport:
    """What :func:`check_conformance` saw, for further assertions in a plugin's own tests."""

    plugin: str
    diagnosis: Diagnosis | None = None
    candidates: list[Candidate] = field(default_factory=list)
    knob_sets: list[dict[str, Any]] = field(default_factory=list)
    """The validated knob values whose runtime hook was checked, in order."""
    losses: list[list[float]] = field(default_factory=list)
    """Per checked knob set, the losses of the steps trained under it."""
    search: SearchResult | None = None
    equivalence: list[EquivalenceCheck] = field(default_factory=list)
    """Each knob set trained in float64 against the untuned job, per rank count."""
    unchecked_knobs: list[str] = field(default_factory=list)
    """Knobs not marked ``changes_math`` that no checked knob set moved and the harness could
    not choose a value for (``int``, ``float``, ``str``): pass ``knob_sets`` to cover them."""
    problems: list[str] = field(default_factory=list)

    def fail_if_problems(self) -> None:
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            raise ConformanceError(f"plugin {self.plugin!r} breaks the tuner contract:\n{lines}")


def _raised(exc: BaseException, tuner: Tuner) -> str:
    """An exception from the plugin's code: its line, where in the plugin, and the traceback
    (indented under the problem's line)."""
    failure = Failure.of(exc, type(tuner))
    at = f" at {failure.where}" if failure.where else ""
    return f"{failure.line}{at}\n" + textwrap.indent(failure.traceback.rstrip(), "      ")


_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_HOOKS = ("knobs", "diagnose", "plan", "apply", "search", "snippet", "explain")


def check_declaration(tuner: Tuner) -> list[str]:
    """Phase 1: class attributes, hook signatures, knobs with types, ranges and valid defaults."""
    problems: list[str] = []
    cls = type(tuner)
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        problems.append(f"name {name!r} must be lower_case_with_underscores (it is a config key)")
    if not getattr(cls, "title", None):
        problems.append("declares no title")
    aspect = getattr(cls, "aspect", None)
    if not isinstance(aspect, Aspect):
        problems.append(f"aspect {aspect!r} is not a tunekit.contract.Aspect")
    excludes: Any = getattr(cls, "excludes", frozenset())
    if not all(isinstance(a, Aspect) for a in excludes):
        problems.append(f"excludes {excludes!r} must hold tunekit.contract.Aspect values")
    elif aspect in excludes:
        problems.append(f"excludes its own aspect {aspect}")
    if getattr(cls, "api_version", None) != API_VERSION[0]:
        problems.append(
            f"api_version {getattr(cls, 'api_version', None)!r}: this tunekit speaks {API_VERSION[0]}"
        )
    for hook in _HOOKS:
        want = list(inspect.signature(getattr(Tuner, hook)).parameters)
        got = list(inspect.signature(getattr(cls, hook)).parameters)
        if got != want:
            problems.append(f"{hook}{tuple(got)} does not match the contract's {hook}{tuple(want)}")
    try:
        knobs = list(tuner.knobs())
    except Exception as exc:
        return [*problems, f"knobs() raised {_raised(exc, tuner)}"]
    names: list[Any] = [getattr(k, "name", None) for k in knobs]
    if len(set(names)) != len(names):
        problems.append(
            f"declares a knob name twice: {sorted(n for n in names if names.count(n) > 1)}"
        )
    for k in knobs:
        if not isinstance(k, Knob):
            problems.append(f"knobs() returned {k!r}, not a tunekit.contract.Knob")
            continue
        where = f"knob {k.name!r}"
        if not k.name.isidentifier():
            problems.append(f"{where}: name must be an identifier")
        if not k.help.strip():
            problems.append(f"{where}: no help line (shown by `tunekit plugins --knobs`)")
        if k.type in ("int", "float"):
            if k.low is None or k.high is None:
                problems.append(f"{where}: {k.type} knobs must declare both low and high")
            elif k.low > k.high:
                problems.append(f"{where}: low {k.low} is above high {k.high}")
        if k.type == "choice" and len(set(k.choices)) != len(k.choices):
            problems.append(f"{where}: repeated choices {k.choices}")
        try:
            k.check(k.default)
        except Exception as exc:
            problems.append(f"{where}: default {k.default!r} is not valid: {exc}")
    if not problems:
        try:
            if tuner.validate({}) != tuner.defaults():
                problems.append("validate({}) does not give the defaults")
        except Exception as exc:
            problems.append(f"validate({{}}) raised {_raised(exc, tuner)}")
    return problems


def _json_problem(what: str, value: Any) -> list[str]:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        return [f"{what} is not JSON-able (the study store keeps it as JSON): {exc}"]
    return []


def check_diagnose_and_plan(
    tuner: Tuner,
    obs: Observation,
    limit: int = 4,
    expect_candidates: bool | None = None,
) -> tuple[list[str], Diagnosis | None, list[Candidate]]:
    """Phases 2 and 3: a Diagnosis, and candidates that validate and carry predictions.

    ``expect_candidates``: None (default) requires at least one candidate
    when the diagnosis applies; True always; False never.
    """
    problems: list[str] = []
    try:
        diag = tuner.diagnose(obs)
    except Exception as exc:
        return [f"diagnose raised {_raised(exc, tuner)}"], None, []
    if not isinstance(diag, Diagnosis):
        return (
            [f"diagnose returned {type(diag).__name__}, not a tunekit.contract.Diagnosis"],
            None,
            [],
        )
    if not isinstance(diag.applies, bool):
        problems.append(f"Diagnosis.applies is {diag.applies!r}, not a bool")
    if not isinstance(diag.summary, str) or not diag.summary.strip():
        problems.append("Diagnosis.summary is empty (people read it in the report)")
    gain = diag.expected_gain
    if gain is not None and not (
        isinstance(gain, int | float) and math.isfinite(gain) and 0 <= gain <= 1
    ):
        problems.append(
            f"Diagnosis.expected_gain {gain!r} is not a fraction of step time in [0, 1]"
        )
    problems += _json_problem("Diagnosis.details", diag.details)
    if not diag.applies and expect_candidates is not True:
        return problems, diag, []
    try:
        candidates = tuner.plan(obs, limit)
    except Exception as exc:
        return [*problems, f"plan raised {_raised(exc, tuner)}"], diag, []
    if not isinstance(candidates, list):
        return [*problems, f"plan returned {type(candidates).__name__}, not a list"], diag, []
    if len(candidates) > limit:
        problems.append(f"plan returned {len(candidates)} candidates for limit={limit}")
    if not candidates and expect_candidates is not False:
        problems.append("the diagnosis applies but plan returned no candidates")
    for i, c in enumerate(candidates):
        where = f"candidate {i}"
        if not isinstance(c, Candidate):
            problems.append(f"{where} is {type(c).__name__}, not a tunekit.contract.Candidate")
            continue
        try:
            tuner.validate(c.knobs)
        except Exception as exc:
            problems.append(f"{where} knobs {c.knobs!r} do not validate: {exc}")
        p = c.predicted_step_s
        if not (
            isinstance(p, int | float) and not isinstance(p, bool) and math.isfinite(p) and p > 0
        ):
            problems.append(
                f"{where} carries no prediction (predicted_step_s={p!r}); the cost model must price it"
            )
        problems += _json_problem(f"{where} details", c.details)
        for hook, arg in (("snippet", c.knobs), ("explain", c)):
            try:
                text = getattr(tuner, hook)(tuner.validate(c.knobs) if hook == "snippet" else arg)
            except Exception as exc:
                problems.append(f"{hook}({where}) raised {_raised(exc, tuner)}")
                continue
            if text is not None and not isinstance(text, str):
                problems.append(f"{hook}({where}) returned {type(text).__name__}, not str or None")
    return problems, diag, candidates


def _tuner_path(tuner: Tuner) -> str:
    cls = type(tuner)
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_tuner(path: str) -> Tuner:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj()


def _any_rank(flag: bool, world: int) -> bool:
    """Whether ``flag`` holds on any rank: ranks must take the same path through the checks."""
    if world <= 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _close(session: Session) -> list[str]:
    try:
        session.close()
    except Exception as exc:
        return [f"session.close() raised {type(exc).__name__}: {exc}"]
    return []


def _one_trial(
    session: Session,
    tuner: Tuner,
    knobs: Mapping[str, Any],
    steps: int,
    fresh: SessionState,
    threads: set[threading.Thread],
    children: set[int],
) -> tuple[list[str], SessionState | None, list[float]]:
    """Apply ``knobs``, train, reset; return the problems, the applied state and the losses."""
    label = f"knobs {dict(knobs)}"
    before = _param_values(session.model)
    try:
        session.apply_config(TuningConfig({tuner.name: dict(knobs)}), {tuner.name: tuner})
    except Exception as exc:
        return [f"apply with {label} raised {_raised(exc, tuner)}"], None, []
    problems = []
    applied = snapshot_session(session)
    changed = _changed_params(before, session.model)
    if changed:
        problems.append(
            f"apply with {label} changed parameter values ({', '.join(changed[:4])}); "
            "model state must carry over"
        )
    losses: list[float] = []
    try:
        for _ in range(steps):
            losses.append(session.train_step().loss)
    except Exception as exc:
        return (
            [*problems, f"training under {label} raised {_raised(exc, tuner)}"],
            applied,
            losses,
        )
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"training under {label} gave non-finite losses {losses}")
    session.flush()
    trained = _param_values(session.model)
    try:
        session.reset()
    except Exception as exc:
        return (
            [*problems, f"session.reset() after {label} raised {_raised(exc, tuner)}"],
            applied,
            losses,
        )
    diffs = compare_states(fresh, snapshot_session(session)) + _leftovers(threads, children)
    problems += [f"after {label} and session.reset(): {d}" for d in diffs]
    changed = _changed_params(trained, session.model)
    if changed:
        problems.append(
            f"session.reset() after {label} changed parameter values ({', '.join(changed[:4])})"
        )
    return problems, applied, losses


def _runtime_problems(
    tuner: Tuner,
    workload: Workload,
    knob_sets: Sequence[Mapping[str, Any]],
    steps: int,
    search_steps: int | None,
    rank: int,
    world: int,
    device: str = "cpu",
) -> tuple[list[str], list[list[float]], SearchResult | None]:
    """Apply, train, reset, in the sequence A, B, A (then B on a fresh session); diff every state."""
    problems: list[str] = []
    losses: list[list[float]] = []
    found = None
    session = Session(workload, rank=rank, world_size=world, device=torch.device(device))
    fresh = snapshot_session(session)
    threads, children = _python_threads(), _children()
    sequence = list(knob_sets) + ([knob_sets[0]] if len(knob_sets) > 1 else [])
    applied: list[SessionState | None] = []
    try:
        for i, knobs in enumerate(sequence):
            trial_problems, state, run = _one_trial(
                session, tuner, knobs, steps, fresh, threads, children
            )
            problems += trial_problems
            applied.append(state)
            if i < len(knob_sets):
                losses.append(run)
            if _any_rank(bool(problems), world):
                break  # later trials would only repeat what this one left behind
        if not _any_rank(bool(problems), world) and len(knob_sets) > 1:
            problems += _leak_problems(tuner, workload, knob_sets, applied, rank, world, device)
        if (
            not _any_rank(bool(problems), world)
            and search_steps is not None
            and (type(tuner).search is not Tuner.search)
        ):
            found, search_problems = _search_problems(tuner, session, knob_sets[0], search_steps)
            problems += search_problems
    finally:
        problems += _close(session)
    return problems, losses, found


def _leak_problems(
    tuner: Tuner,
    workload: Workload,
    knob_sets: Sequence[Mapping[str, Any]],
    applied: list[SessionState | None],
    rank: int,
    world: int,
    device: str,
) -> list[str]:
    """A applied twice gives one state; B after A gives the state B gives in a fresh trial."""
    a, b = dict(knob_sets[0]), dict(knob_sets[1])
    assert applied[0] is not None and applied[1] is not None and applied[-1] is not None
    problems = [
        f"applying {a} a second time differs from the first: {d}"
        for d in compare_states(applied[0], applied[-1], identity=False)
    ]
    # A fresh trial: a new session and, where it can be built without arguments, a new tuner.
    other = Session(workload, rank=rank, world_size=world, device=torch.device(device))
    try:
        other.apply_config(TuningConfig({tuner.name: b}), {tuner.name: _fresh(tuner)})
        problems += [
            f"{b} applied after {a} differs from it applied to a fresh session: {d}"
            for d in compare_states(snapshot_session(other), applied[1], identity=False)
        ]
    finally:
        problems += _close(other)
    return problems


def _fresh(tuner: Tuner) -> Tuner:
    try:
        return type(tuner)()
    except TypeError:
        return tuner


def _search_problems(
    tuner: Tuner,
    session: Session,
    knobs: Mapping[str, Any],
    max_steps: int,
) -> tuple[SearchResult | None, list[str]]:
    session.apply_config(TuningConfig({tuner.name: dict(knobs)}), {tuner.name: tuner})
    start = session.step
    try:
        found = tuner.search(session, knobs, max_steps)
    except Exception as exc:
        return None, [f"search raised {_raised(exc, tuner)}"]
    problems = []
    if session.step - start > max_steps:
        problems.append(
            f"search trained {session.step - start} steps, more than max_steps={max_steps}"
        )
    if found is None:
        return None, problems
    if not isinstance(found, SearchResult):
        return None, [
            *problems,
            f"search returned {type(found).__name__}, not a SearchResult or None",
        ]
    try:
        tuner.validate(found.knobs)
    except Exception as exc:
        problems.append(f"search settled on knobs that do not validate: {exc}")
    problems += _json_problem("SearchResult.trace", found.trace)
    problems += _json_problem("SearchResult.details", found.details)
    session.reset()
    return found, problems


def _runtime_rank(
    rank: int,
    world: int,
    tuner_path: str,
    workload: str | Workload,
    knob_sets: list[dict[str, Any]],
    steps: int,
    search_steps: int | None,
    device: str,
    equivalence: tuple[list[tuple[dict[str, Any], bool]], int] | None = None,
) -> tuple[list[str], list[EquivalenceCheck]]:
    """The runtime check on one spawned rank, then (when asked and it passed on every rank)
    the float64 equivalence cases in the same process group."""
    tuner = _load_tuner(tuner_path)
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    wl = workload if isinstance(workload, Workload) else load_workload(workload)
    problems, _, _ = _runtime_problems(
        tuner, wl, knob_sets, steps, search_steps, rank, world, device
    )
    checks: list[EquivalenceCheck] = []
    if equivalence is not None and not _any_rank(bool(problems), world):
        cases, eq_steps = equivalence
        checks = equivalence_on_ranks(tuner, wl, cases, eq_steps, rank, world, device)
    return problems, checks


def _equivalence_rank(
    rank: int,
    world: int,
    tuner_path: str,
    workload: str | Workload,
    cases: list[tuple[dict[str, Any], bool]],
    steps: int,
    device: str,
) -> list[EquivalenceCheck]:
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    wl = workload if isinstance(workload, Workload) else load_workload(workload)
    return equivalence_on_ranks(_load_tuner(tuner_path), wl, cases, steps, rank, world, device)


def _for_ranks(workload: Workload | str | None) -> str | Workload:
    """The workload as spawned ranks can rebuild it: by name, or the object itself when it
    pickles (built from module-level functions, as tunekit.testing's workloads are)."""
    if workload is None:
        return "tunekit.testing:tiny_workload"
    if isinstance(workload, str):
        return workload
    try:
        pickle.dumps(workload)
    except Exception as exc:
        raise ValueError(
            f"workload {workload.name!r} cannot be sent to spawned ranks ({type(exc).__name__}: "
            f"{exc}); give it by name ('module:function') instead"
        ) from None
    return workload


def _importable(tuner: Tuner) -> str:
    """Why spawned ranks could not build ``tuner`` by name (empty when they can)."""
    cls = type(tuner)
    if "<locals>" in cls.__qualname__:
        return f"{cls.__qualname__} is defined inside a function: define it at module level"
    try:
        found = _load_tuner(_tuner_path(tuner))
    except Exception as exc:
        return f"{_tuner_path(tuner)} cannot be imported and built without arguments ({exc})"
    return "" if type(found) is cls else f"{_tuner_path(tuner)} names another class"


def _merged(per_rank: Sequence[Sequence[EquivalenceCheck]]) -> list[EquivalenceCheck]:
    """One check per case: the first rank's that did not pass, else rank 0's."""
    out = []
    for checks in zip(*per_rank, strict=True):
        failing = [c for c in checks if c.outcome in ("differs", "failed")]
        out.append(failing[0] if failing else checks[0])
    return out


def check_runtime(
    tuner: Tuner,
    knob_sets: Sequence[Mapping[str, Any]],
    workload: Workload | str | None = None,
    *,
    nproc: int = 1,
    steps: int = 2,
    search_steps: int | None = None,
    device: str = "cpu",
) -> tuple[list[str], list[list[float]], SearchResult | None]:
    """Phase 4: the runtime hook on a real Session, undone by reset, leaking nothing.

    With the knob sets A, B (validated here), on one session: apply A, train
    ``steps`` steps, reset; apply B, train, reset; apply A again, reset. After
    every reset the session must equal a fresh one (the same model,
    parameters, optimizer and data objects; no hooks, threads or processes
    left; grad sync, batch size, learning rate — on the workload's schedule,
    if it has one — step function, loader options and torch flags back to the
    defaults); applying must not change parameter values, nor resetting. A
    applied twice must give the same state, and B applied after A the state B
    gives on a fresh session. Then, if the tuner has a ``search`` and
    ``search_steps`` is given, the search runs for at most that many steps and
    must settle on knobs that validate.

    ``nproc=1`` runs in this process inside a one-rank gloo group (so DDP and
    collectives work); ``nproc>1`` runs on real gloo ranks via
    :func:`run_ranks`, which needs the tuner class importable by name and
    ``workload`` given by name or built from module-level functions (so that it
    pickles). ``device="cuda"`` trains on the GPU (each rank on GPU ``rank % count``).
    """
    problems, losses, found, _ = _check_runtime(
        tuner, knob_sets, workload, nproc, steps, search_steps, device, None
    )
    return problems, losses, found


def _check_runtime(
    tuner: Tuner,
    knob_sets: Sequence[Mapping[str, Any]],
    workload: Workload | str | None,
    nproc: int,
    steps: int,
    search_steps: int | None,
    device: str,
    equivalence: tuple[list[tuple[dict[str, Any], bool]], int] | None,
) -> tuple[list[str], list[list[float]], SearchResult | None, list[EquivalenceCheck]]:
    """:func:`check_runtime`; with ``equivalence`` (cases, steps) and ``nproc > 1``, the
    equivalence cases run after it in the same rank group."""
    knob_sets = [tuner.validate(k) for k in knob_sets]
    if not knob_sets:
        raise ValueError("check_runtime needs at least one knob set")
    if nproc > 1:
        results = run_ranks(
            _runtime_rank,
            nproc,
            (
                _tuner_path(tuner),
                _for_ranks(workload),
                knob_sets,
                steps,
                search_steps,
                device,
                equivalence,
            ),
            timeout_s=300,
        )
        problems = []
        for rank, (rank_problems, _) in enumerate(results):
            problems += [f"rank {rank}: {p}" for p in rank_problems]
        checks = _merged([c for _, c in results]) if equivalence is not None else []
        return problems, [], None, checks
    wl = load_workload(workload) if isinstance(workload, str) else (workload or tiny_workload())
    with single_rank_group():
        problems, losses, found = _runtime_problems(
            tuner, wl, knob_sets, steps, search_steps, dist.get_rank(), 1, device
        )
    return problems, losses, found, []


def check_equivalence(
    tuner: Tuner,
    knob_sets: Sequence[Mapping[str, Any]],
    workload: Workload | str | None = None,
    *,
    ranks: Sequence[int] = (1, 2),
    steps: int = EQUIVALENCE_STEPS,
    device: str = "cpu",
) -> tuple[list[str], list[EquivalenceCheck], list[str]]:
    """Phase 5: every knob not marked ``changes_math`` trains what the untuned job trains.

    The knob sets of :func:`~tunekit.testing.equivalence.equivalence_cases` (each of
    ``knob_sets`` with its ``changes_math`` knobs at their defaults; each other value of a
    ``bool`` or ``choice`` knob no set moved) are each trained for ``steps`` steps in
    float64, on one rank in this process and on ``n`` spawned gloo ranks for each other
    ``n`` in ``ranks``, and compared with the untuned job trained the same way: every loss
    and, at the end, every parameter within :data:`~tunekit.testing.EQUIVALENCE_RTOL`. A
    set that differs is retried knob by knob to name the knob that changes the training;
    the message names it and the first parameter (in the model's order) that differs.
    Larger rank counts run only when the smaller ones passed.

    Returns the problems, the checks made and the knobs left unchecked (``int``,
    ``float`` and ``str`` knobs no set moved). Spawned ranks need the tuner class
    importable by name and the workload by name or picklable, as :func:`check_runtime`.
    """
    cases, unchecked = equivalence_cases(tuner, knob_sets)
    problems, checks = _run_equivalence(tuner, workload, cases, ranks, steps, device, set())
    return problems, checks, unchecked


def _run_equivalence(
    tuner: Tuner,
    workload: Workload | str | None,
    cases: list[tuple[dict[str, Any], bool]],
    ranks: Sequence[int],
    steps: int,
    device: str,
    done: set[int],
    checks: list[EquivalenceCheck] | None = None,
) -> tuple[list[str], list[EquivalenceCheck]]:
    """The cases at each rank count in ``ranks`` not in ``done``, smallest first, stopping at
    the first count with a problem; ``checks`` are those already made (at ``done``)."""
    checks = list(checks or [])
    problems = _problems_of(checks, steps)
    if not cases:
        return problems, checks
    for world in sorted(set(ranks) - done):
        if problems:
            break
        if world == 1:
            wl = (
                load_workload(workload)
                if isinstance(workload, str)
                else (workload or tiny_workload())
            )
            with single_rank_group():
                found = equivalence_on_ranks(tuner, wl, cases, steps, dist.get_rank(), 1, device)
        else:
            why = _importable(tuner)
            try:
                spec = _for_ranks(workload)
            except ValueError as exc:
                why = why or str(exc)
            if why:
                problems.append(
                    f"cannot check equivalence on {world} ranks: {why} "
                    "(or pass equivalence_ranks=(1,) to check on one rank only)"
                )
                break
            found = _merged(
                run_ranks(
                    _equivalence_rank,
                    world,
                    (_tuner_path(tuner), spec, cases, steps, device),
                    timeout_s=300,
                )
            )
        checks += found
        problems += _problems_of(found, steps)
    return problems, sorted(checks, key=lambda c: c.ranks)


def _problems_of(checks: Sequence[EquivalenceCheck], steps: int) -> list[str]:
    return [line for c in checks if (line := c.problem(steps))]


def check_conformance(
    tuner: Tuner,
    obs: Observation | None = None,
    *,
    workload: Workload | str | None = None,
    knob_sets: Sequence[Mapping[str, Any]] | None = None,
    nproc: int = 1,
    limit: int = 4,
    steps: int = 2,
    expect_candidates: bool | None = None,
    search_steps: int | None = 6,
    device: str = "cpu",
    equivalence_ranks: Sequence[int] = (1, 2),
    equivalence_steps: int = EQUIVALENCE_STEPS,
) -> ConformanceReport:
    """Check ``tuner`` against the contract, phase by phase; raise :class:`ConformanceError` on any problem.

    * declare — name, title, aspect, api_version, hook signatures; every knob
      typed, int and float knobs with both bounds, defaults valid;
    * diagnose — returns a Diagnosis with a summary, a gain in [0, 1] or
      None, JSON-able details (a diagnose that raises is reported with its
      traceback);
    * plan — at most ``limit`` Candidates (at least one when the diagnosis
      applies, unless ``expect_candidates=False``), each with knobs that
      validate and a predicted step time; ``snippet`` and ``explain`` return
      text or None;
    * runtime — see :func:`check_runtime`, with ``knob_sets`` (default: the
      first two candidates, or the defaults and the first candidate, or the
      defaults alone);
    * equivalence — see :func:`check_equivalence`: every knob not marked
      ``changes_math`` trains, in float64, what the untuned job trains, on
      each rank count of ``equivalence_ranks`` (``()`` skips it).

    ``obs`` defaults to :func:`synthetic_observation` of ``workload`` at
    ``nproc`` ranks; ``workload`` defaults to the observation's (else
    :func:`tiny_workload`); ``device="cuda"`` runs the runtime checks on the
    GPU. With ``nproc > 1`` or a rank count above 1 in ``equivalence_ranks``,
    ranks are spawned: from a script, call it under ``if __name__ ==
    "__main__":`` (each spawned rank imports the script again). Returns a
    :class:`ConformanceReport` for further assertions.
    """
    report = ConformanceReport(getattr(type(tuner), "name", type(tuner).__name__))
    report.problems += check_declaration(tuner)
    if report.problems:
        report.fail_if_problems()
    if obs is None:
        obs = synthetic_observation(workload, nproc=nproc)
    problems, report.diagnosis, report.candidates = check_diagnose_and_plan(
        tuner, obs, limit, expect_candidates
    )
    report.problems += problems
    if report.problems:
        report.fail_if_problems()
    if knob_sets is None:
        proposed = [c.knobs for c in report.candidates[:2]]
        knob_sets = proposed if len(proposed) == 2 else [tuner.validate({}), *proposed]
    report.knob_sets = [tuner.validate(k) for k in knob_sets]
    runtime_workload = workload if workload is not None else _observed_workload(obs)
    cases, report.unchecked_knobs = equivalence_cases(tuner, report.knob_sets)
    shared = nproc > 1 and nproc in equivalence_ranks and bool(cases)
    problems, report.losses, report.search, shared_checks = _check_runtime(
        tuner,
        report.knob_sets,
        runtime_workload,
        nproc,
        steps,
        search_steps,
        device,
        (cases, equivalence_steps) if shared else None,
    )
    report.problems += problems
    if not report.problems:
        problems, report.equivalence = _run_equivalence(
            tuner,
            runtime_workload,
            cases,
            equivalence_ranks,
            equivalence_steps,
            device,
            {nproc} if shared else set(),
            shared_checks,
        )
        report.problems += problems
    report.fail_if_problems()
    return report


def _observed_workload(obs: Observation) -> Workload | str:
    """The observation's workload: by name where it has one (ranks load it themselves)."""
    spec = obs.workload_spec
    return obs.workload if spec.startswith("<") else spec
