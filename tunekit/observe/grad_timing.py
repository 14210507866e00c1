"""When does a training step reach each group of layers: forward start, and backprop passing it.

One timing for every tuner that needs to know when gradients become ready
(overlap_chunking's chunks, cgdp's host reduction): a group is a list of
module paths (a "layer" in a paper's sense, or one parameterised module).

* forward: a group's time runs from its first module's start to the next
  group's start (so activations that follow it are its own; time before the
  first group is the first group's);
* backward: the moment backprop has passed a group is the latest of its
  parameters' gradients being accumulated (post-accumulate-grad hooks) and
  its input's gradient being computed (a hook on the input), so branches are
  handled; those moments are made monotone from the output end and
  differenced, so cumulative sums give when each chunk of groups is ready;
* the optimizer step after backward.

Timestamps are host clocks on the CPU and CUDA events on a GPU (its work is
asynchronous). The step runs ``warmup`` times untimed, then ``repeats`` times;
medians are reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class GroupTiming:
    name: str
    forward_s: float
    backward_s: float
    """Time backprop spends between passing the group after this one and passing this one."""


@dataclass
class StepTiming:
    groups: list[GroupTiming]
    """In forward order (output end last)."""
    update_s: float
    """The optimizer step."""
    param_bytes: int
    """Bytes of the parameters the optimizer updates."""

    @property
    def forward_s(self) -> float:
        return sum(g.forward_s for g in self.groups)

    @property
    def backward_s(self) -> float:
        return sum(g.backward_s for g in self.groups)


class Clock:
    """Timestamps on the host (CPU) or as CUDA events (GPU work is asynchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[tuple, Any]] = []

    def mark(self, key: tuple) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((key, event))
        else:
            self.marks.append((key, time.perf_counter()))

    def times(self) -> dict[tuple, float]:
        """Seconds since the first mark; repeated keys keep their latest time."""
        base = self.marks[0][1]
        if self.cuda:
            torch.cuda.synchronize()
            return {k: base.elapsed_time(e) / 1e3 for k, e in self.marks}
        return {k: t - base for k, t in self.marks}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def time_groups(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    inputs: Any,
    targets: torch.Tensor,
    groups: Sequence[tuple[str, Sequence[str]]],
    *,
    device: torch.device,
    warmup: int = 2,
    repeats: int = 5,
) -> StepTiming:
    """Time ``groups`` (``(name, module paths)``, in forward order) over training steps.

    The model trains for real (its parameters change); pass a copy if that matters.
    """
    modules = dict(model.named_modules())
    holder: dict[str, Any] = {}
    handles = []

    def pre_hook(j: int):
        def hook(_module, args):
            clock = holder["clock"]
            if ("fs", j) not in holder["seen"]:  # a group's first module starts it
                holder["seen"].add(("fs", j))
                clock.mark(("fs", j))
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda _g: clock.mark(("in", j)))

        return hook

    def grad_hook(j: int):
        def hook(_p):
            count = holder["count"]
            holder["clock"].mark(("pg", j, count.setdefault(j, 0)))
            count[j] += 1

        return hook

    for j, (_name, paths) in enumerate(groups):
        for path in paths:
            module = modules[path]
            handles.append(module.register_forward_pre_hook(pre_hook(j)))
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(grad_hook(j)))
    n = len(groups)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    upd: list[float] = []
    try:
        for it in range(warmup + repeats):
            clock = Clock(device)
            holder.update(clock=clock, count={}, seen=set())
            clock.mark(("start",))
            loss = loss_fn(model(inputs), targets)
            clock.mark(("fwd_end",))
            loss.backward()
            clock.mark(("bwd_end",))
            optimizer.step()
            clock.mark(("upd_end",))
            optimizer.zero_grad(set_to_none=True)
            if it < warmup:
                continue
            t = clock.times()
            starts = [t.get(("fs", j)) for j in range(n)]
            f_end, b_end = t[("fwd_end",)], t[("bwd_end",)]
            for j in range(n):
                start = starts[j]
                if start is None:
                    fwd[j].append(0.0)
                    continue
                nxt = next((s for s in starts[j + 1 :] if s is not None), f_end)
                lead = start if j else 0.0  # time before the first group is its own
                fwd[j].append(nxt - lead)
            passed = cumulative = 0.0
            cum = [0.0] * n
            for j in reversed(range(n)):
                marks = [v for k, v in t.items() if k[:2] in (("in", j), ("pg", j))]
                passed = max(marks) - f_end if marks else passed
                cumulative = max(cumulative, passed)
                cum[j] = cumulative
            if n:
                cum[0] = max(cum[0], b_end - f_end)
            for j in range(n):
                bwd[j].append(cum[j] - (cum[j + 1] if j + 1 < n else 0.0))
            upd.append(t[("upd_end",)] - b_end)
    finally:
        for h in handles:
            h.remove()
    param_bytes = sum(
        p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"]
    )
    return StepTiming(
        [GroupTiming(name, _median(fwd[j]), _median(bwd[j])) for j, (name, _) in enumerate(groups)],
        _median(upd),
        param_bytes,
    )
