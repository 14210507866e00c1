"""Session state: what a runtime hook may change and a reset must restore.

:func:`snapshot_session` and :func:`compare_states` picture and diff a
session (model, optimizer, data, hooks, torch flags); the private helpers
below them find changed parameter values and leftover threads and processes
for :mod:`tunekit.testing.conformance`.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch
from torch import nn

from tunekit.runtime.session import Session


def torch_flags() -> dict[str, Any]:
    """Process-wide torch settings a hook might flip (and must put back)."""
    b = torch.backends
    flags = {
        "cudnn.enabled": b.cudnn.enabled,
        "cudnn.benchmark": b.cudnn.benchmark,
        "cudnn.deterministic": b.cudnn.deterministic,
        "cudnn.allow_tf32": b.cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": b.cuda.matmul.allow_tf32,
        "cuda.matmul.allow_fp16_reduced_precision_reduction": b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "mkldnn.enabled": b.mkldnn.enabled,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "num_threads": torch.get_num_threads(),
        "grad_enabled": torch.is_grad_enabled(),
        "anomaly_detection": torch.is_anomaly_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
    }
    return flags


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _public_settings(obj: Any) -> dict[str, Any]:
    """An object's public attributes with plain values (a strategy's settings)."""
    return {k: v for k, v in sorted(vars(obj).items()) if not k.startswith("_") and _plain(v)}


def _qualname(obj: Any) -> str | None:
    if obj is None:
        return None
    target = getattr(obj, "__func__", obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(obj).__qualname__)}"


_MODULE_HOOKS = {
    "forward": "_forward_hooks",
    "forward_pre": "_forward_pre_hooks",
    "backward": "_backward_hooks",
    "backward_pre": "_backward_pre_hooks",
    "state_dict": "_state_dict_hooks",
    "load_state_dict_pre": "_load_state_dict_pre_hooks",
}


def _hook_counts(module: nn.Module) -> dict[str, int]:
    """Hooks registered on ``module``, by kind (kinds with none left out)."""
    counts = {kind: len(getattr(module, attr, None) or {}) for kind, attr in _MODULE_HOOKS.items()}
    return {kind: n for kind, n in counts.items() if n}


def _param_hook_counts(p: torch.Tensor) -> dict[str, int]:
    counts = {
        "grad": len(p._backward_hooks or {}),
        "post_accumulate_grad": len(getattr(p, "_post_accumulate_grad_hooks", None) or {}),
    }
    return {kind: n for kind, n in counts.items() if n}


@dataclass
class SessionState:
    """A comparable picture of a session's state.

    ``identity`` holds object ids (comparable within one session only);
    ``structure`` holds types, settings, shapes and hook counts (comparable
    across sessions).
    """

    identity: dict[str, Any]
    structure: dict[str, Any]


def snapshot_session(session: Session) -> SessionState:
    """What a runtime hook may change, in a form :func:`compare_states` can diff."""
    model, opt, data = session.model, session.optimizer, session.data
    params = list(model.named_parameters())
    mod = nn.modules.module
    structure: dict[str, Any] = {
        "model.modules": [(n, type(m).__qualname__) for n, m in model.named_modules()],
        "model.training": model.training,
        "model.forward overridden on": [
            n or "<root>" for n, m in model.named_modules() if "forward" in vars(m)
        ],
        "model.parameters": [
            (n, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad) for n, p in params
        ],
        "model.buffers": [
            (n, tuple(b.shape), str(b.dtype), str(b.device)) for n, b in model.named_buffers()
        ],
        "module hooks": {
            n or "<root>": c for n, m in model.named_modules() if (c := _hook_counts(m))
        },
        "parameter hooks": {n: c for n, p in params if (c := _param_hook_counts(p))},
        "global module hooks": {
            name: len(getattr(mod, name))
            for name in (
                "_global_forward_hooks",
                "_global_forward_pre_hooks",
                "_global_backward_hooks",
                "_global_backward_pre_hooks",
            )
            if hasattr(mod, name)
        },
        "optimizer.type": type(opt).__qualname__,
        **_learning_rates(session),
        "optimizer.group sizes": [len(g["params"]) for g in opt.param_groups],
        "optimizer hooks": (
            len(getattr(opt, "_optimizer_step_pre_hooks", {})),
            len(getattr(opt, "_optimizer_step_post_hooks", {})),
        ),
        "session.batch_size": session.batch_size,
        "session.dp_world_size": getattr(session, "dp_world_size", session.world_size),
        "session.lr": session.lr,
        "session.step_fn": _qualname(session.step_fn),
        "session.grad_sync": (
            type(session.grad_sync).__qualname__,
            _public_settings(session.grad_sync),
        ),
        "session.config": session.config.canonical(),
        "session.reset callbacks": len(getattr(session, "_reset_callbacks", ())),
        "data.type": type(data).__qualname__,
        "data.batch_size": data.batch_size,
        "data.options": asdict(data.options),
        "torch flags": torch_flags(),
    }
    identity = {
        "session.model": id(model),
        "model parameters": [id(p) for _, p in params],
        "session.optimizer": id(opt),
        "optimizer parameters": [id(p) for g in opt.param_groups for p in g["params"]],
        "session.data": id(data),
        "session.workload": id(session.workload),
    }
    return SessionState(identity, structure)


def _learning_rates(session: Session) -> dict[str, Any]:
    """The optimizer's rates in a form that a reset must restore at any step.

    Without a scheduler, the rate per group. With one, the rate moves every step
    (a warm-up, a decay): then each group's rate is given as a multiple of the rate
    the untuned job has at this point of its schedule (1.0 after a clean reset),
    beside the schedule's base rates.
    """
    opt, scheduler = session.optimizer, session.scheduler
    rates = [g["lr"] for g in opt.param_groups]
    if scheduler is None:
        return {"optimizer.lr per group": rates}
    untuned = _untuned_schedule(session, scheduler.last_epoch)
    out: dict[str, Any] = {"scheduler.base lr per group": list(scheduler.base_lrs)}
    if untuned is None:  # a schedule that cannot be replayed: its bases alone
        return out
    out["optimizer.lr per group, as a multiple of the untuned schedule's"] = [
        round(lr / want, 9) if want else lr for lr, want in zip(rates, untuned, strict=True)
    ]
    return out


def _untuned_schedule(session: Session, steps: int) -> list[float] | None:
    """The rate per group that the workload's schedule gives after ``steps`` scheduler steps
    from the workload's own rates: the schedule replayed on a stand-in optimizer."""
    factory = session.workload.scheduler
    assert factory is not None  # called for a session with a scheduler
    groups = [
        {"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in session._base_group_lrs
    ]
    try:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore")
            replay = factory(torch.optim.SGD(groups, lr=session.workload.lr))
            for _ in range(steps):
                replay.step()
        return [g["lr"] for g in replay.optimizer.param_groups]
    except Exception:  # a schedule built for its own optimizer type
        return None


def compare_states(
    expected: SessionState, actual: SessionState, *, identity: bool = True
) -> list[str]:
    """Lines naming each difference (empty when the states match)."""
    out = []
    for key, want in expected.structure.items():
        got = actual.structure.get(key)
        if got != want:
            out.append(_describe_difference(key, want, got))
    if identity:
        for key, want in expected.identity.items():
            if actual.identity.get(key) != want:
                out.append(f"{key} is a different object than before")
    return out


class _Absent:
    def __repr__(self) -> str:
        return "none"


_ABSENT = _Absent()


def _describe_difference(key: str, want: Any, got: Any) -> str:
    parts = _differences(want, got)
    if len(parts) == 1 and not isinstance(want, dict | tuple | list):
        text = f"{key} changed: {parts[0]}"
    else:
        text = f"{key} changed ({'; '.join(parts[:6])}{'; ...' if len(parts) > 6 else ''})"
    return text if len(text) < 400 else text[:397] + "..."


def _differences(want: Any, got: Any) -> list[str]:
    """``a -> b`` for each differing leaf: dict keys are named, equal-length sequences walked."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got), key=str):
            a, b = want.get(k, _ABSENT), got.get(k, _ABSENT)
            if a != b:
                inner = (
                    _differences(a, b)
                    if isinstance(a, dict) and isinstance(b, dict)
                    else [f"{a!r} -> {b!r}"]
                )
                out += [f"{k}: {d}" for d in inner]
        return out
    if isinstance(want, tuple | list) and isinstance(got, tuple | list) and len(want) == len(got):
        walked = [d for a, b in zip(want, got, strict=True) if a != b for d in _differences(a, b)]
        if walked and all(
            isinstance(a, dict | tuple | list) for a, b in zip(want, got, strict=True) if a != b
        ):
            return walked
    return [f"{want!r} -> {got!r}"]


def _param_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def _changed_params(before: Mapping[str, torch.Tensor], model: nn.Module) -> list[str]:
    now = dict(model.named_parameters())
    return [
        n for n, v in before.items() if n not in now or not torch.equal(v, now[n].detach().cpu())
    ]


SINGLETON_THREADS = ("tqdm_monitor",)
"""Process-wide helper threads libraries start once (not a per-trial leak)."""


def _python_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name not in SINGLETON_THREADS}


def _children() -> set[int]:
    """Live child processes, minus multiprocessing's own long-lived helpers; the processes
    tunekit forked from its warm server (:mod:`tunekit.trials.warm_start`) count as children,
    the server (one per process, for its life) does not."""
    out = set()
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(child.cmdline())
            if "tunekit.trials.warm_start" in cmd:
                out |= {c.pid for c in child.children() if c.status() != psutil.STATUS_ZOMBIE}
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "resource_tracker" in cmd or "semaphore_tracker" in cmd or "forkserver" in cmd:
            continue
        out.add(child.pid)
    return out


def _leftovers(
    threads: set[threading.Thread], children: set[int], grace_s: float = 5.0
) -> list[str]:
    """Threads and processes started since ``threads``/``children`` that outlive a reset."""
    deadline = time.monotonic() + grace_s
    while True:
        new_threads = [t for t in _python_threads() - threads if t.is_alive()]
        new_children = _children() - children
        if (not new_threads and not new_children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out = []
    if new_threads:
        out.append(
            f"left {len(new_threads)} thread(s) running: {', '.join(sorted(t.name for t in new_threads))}"
        )
    if new_children:
        out.append(
            f"left {len(new_children)} child process(es) running (pids {sorted(new_children)})"
        )
    return out
