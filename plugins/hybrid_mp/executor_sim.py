"""The executor, simulated: one forward and backward of a split program
(:class:`~tunekit.plugins.hybrid_mp.split_program.SplitProgram`) as the ranks of a
model-parallel worker run it, device by device, message by message."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tunekit.plugins.hybrid_mp.executor_costs import ExecutorOverheads, Link

__all__ = ["ExecutorStep", "simulate_executor"]


@dataclass
class ExecutorStep:
    """One forward and backward of the split model, as the executor runs it (simulated)."""

    makespan_s: float
    """From the first segment's start to the last backward segment's end, slowest device."""
    busy_s: dict[int, float]
    """Per device: its segments' compute plus the executor's own work (overheads, copies)."""
    transfers: int
    """Messages sent (values forward, their gradients backward)."""
    transfer_bytes: float
    transfer_s: float
    """Time of all messages: each ``latency + bytes / bandwidth``, or on the ranks' cores
    its latency and both ends' copies."""
    segments: int
    overhead_s: float
    """The executor's own work summed over devices (interpreter, autograd calls,
    gradient assembly, copies on the ranks' cores)."""

    @property
    def wait_s(self) -> dict[int, float]:
        """Per device: time spent waiting on other devices."""
        return {d: max(0.0, self.makespan_s - b) for d, b in self.busy_s.items()}

    def scaled(self, factor: float) -> ExecutorStep:
        """The same step with every time multiplied by ``factor`` (model units -> seconds)."""
        return ExecutorStep(
            self.makespan_s * factor,
            {d: b * factor for d, b in self.busy_s.items()},
            self.transfers,
            self.transfer_bytes,
            self.transfer_s * factor,
            self.segments,
            self.overhead_s * factor,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["busy_s"] = {str(k): v for k, v in self.busy_s.items()}
        d["wait_s"] = {str(k): v for k, v in self.wait_s.items()}
        return d


@dataclass
class _Task:
    """One piece of a device's work in the executor's order: a segment, or a message's copy."""

    work: float
    own: float
    """The executor's share of ``work`` (not the layers')."""
    waits: list[tuple[str, str, int]]
    """Messages that must have arrived first: (phase, value, device)."""
    sends: list[tuple[str, str, int]] = field(default_factory=list)
    """Messages it sends when it ends."""


def simulate_executor(
    program,
    forward_s: Mapping[str, float],
    backward_s: Mapping[str, float],
    value_bytes: Mapping[str, float],
    link: Link,
    overheads: ExecutorOverheads,
    copies_on_ranks: bool = False,
) -> ExecutorStep:
    """The step of :class:`~tunekit.plugins.hybrid_mp.runtime.HybridSync` for ``program``.

    ``forward_s`` / ``backward_s`` give each fx node's time, ``value_bytes`` the bytes
    of each value crossing devices. Each device runs, in the executor's own order:

    * its forward segments, each once the values it reads from other devices have
      arrived (blocking receives), sending its outputs when it ends;
    * then its backward segments in reverse, each once the gradient of every output
      read on another device has come back from the first segment there that reads
      it (the one that returns it), returning its inputs' gradients when it ends.

    ``copies_on_ranks``: the ranks' own cores copy every message in and out (CPU
    ranks without spare cores: gloo's threads take the time from the compute), so
    each end spends half of ``overheads.copy_s_per_byte`` (else ``1 / bandwidth``)
    per byte of its device time on it and the message arrives ``latency`` after the
    sender's copy. Otherwise the link carries the message beside the compute
    (``latency + bytes / bandwidth`` after it was sent, one message at a time per
    pair of ranks).
    """
    per_byte = overheads.copy_s_per_byte / 2 if overheads.copy_s_per_byte else 1.0 / link.bandwidth

    def copy_s(value: str) -> float:
        return float(value_bytes.get(value, 0.0)) * per_byte if copies_on_ranks else 0.0

    tasks = _executor_tasks(program, forward_s, backward_s, value_bytes, overheads, copy_s)
    nbytes = {
        (ph, v, d): float(value_bytes.get(v, 0.0))
        for ts in tasks.values()
        for t in ts
        for ph, v, d in t.sends
    }
    run = _run_tasks(tasks, nbytes, link, copies_on_ranks)
    messages = list(nbytes.items())
    return ExecutorStep(
        makespan_s=run["end"],
        busy_s={d: run["busy"].get(d, 0.0) for d in range(program.mp)},
        transfers=len(messages),
        transfer_bytes=sum(b for _, b in messages),
        transfer_s=sum(
            2 * b * per_byte + link.latency if copies_on_ranks else link.time(b)
            for _, b in messages
        ),
        segments=len(program.segments),
        overhead_s=sum(t.own for ts in tasks.values() for t in ts),
    )


def _executor_tasks(program, forward_s, backward_s, value_bytes, overheads, copy_s):
    """Each device's work in the executor's order (see :func:`simulate_executor`)."""
    segs = program.segments
    dev_of = [s.device for s in segs]
    tasks: dict[int, list[_Task]] = {d: [] for d in range(program.mp)}

    def foreign(seg, values):
        return [v for v in values if dev_of[program.producer[v]] != seg.device]

    def add(device: int, work: float, own: float, waits, sends) -> None:
        copies = [(m, copy_s(m[1])) for m in sends]
        if any(c > 0 for _, c in copies):  # the sender copies each message, then it flies
            tasks[device].append(_Task(work, own, waits))
            for m, c in copies:
                tasks[device].append(_Task(c, c, [], [m]))
        else:
            tasks[device].append(_Task(work, own, waits, list(sends)))

    for seg in segs:
        received = foreign(seg, seg.inputs)
        own = overheads.node_s * len(seg.nodes) + sum(copy_s(v) for v in received)
        sends = [
            ("fwd", v, dst)
            for v in seg.outputs
            for dst in sorted({dev_of[c] for c in program.consumers[v]} - {seg.device})
        ]
        work = sum(forward_s.get(n.name, 0.0) for n in seg.nodes) + own
        add(seg.device, work, own, [("fwd", v, seg.device) for v in received], sends)
    floating = {v for s in segs for v in s.outputs if value_bytes.get(v, 0.0) > 0}
    for seg in reversed(segs):
        returned = [
            v
            for v in seg.outputs
            if v in floating and any(dev_of[c] != seg.device for c in program.consumers[v])
        ]
        # gradients this segment returns: the first local consumer of each sums them
        gives = [
            v
            for v in foreign(seg, seg.inputs)
            if v in floating
            and seg.index == next(c for c in program.consumers[v] if dev_of[c] == seg.device)
        ]
        own = (
            overheads.backward_call_s
            + sum(copy_s(v) for v in returned)
            + sum(overheads.assemble_s_per_byte * value_bytes.get(v, 0.0) for v in gives)
        )
        work = sum(backward_s.get(n.name, 0.0) for n in seg.nodes) + own
        waits = [("bwd", v, seg.device) for v in returned]
        add(seg.device, work, own, waits, [("bwd", v, dev_of[program.producer[v]]) for v in gives])
    return tasks


def _run_tasks(tasks, nbytes, link: Link, copies_on_ranks: bool) -> dict[str, Any]:
    """Event by event: devices start their next task once its messages are in; returns the
    end and each device's time working."""
    now = 0.0
    nxt = {d: 0 for d in tasks}
    left: dict[int, float] = {}  # device -> work left of the task it runs
    arrival: dict[tuple[str, str, int], float] = {}
    channel_free: dict[tuple[int, int], float] = {}
    busy: dict[int, float] = {}
    eps = 1e-15

    def emit(device: int, task: _Task) -> None:
        for key in task.sends:
            _, _, dst = key
            if copies_on_ranks:
                arrival[key] = now + link.latency
            else:
                start = max(now, channel_free.get((device, dst), 0.0))
                channel_free[(device, dst)] = start + nbytes[key] / link.bandwidth
                arrival[key] = start + link.time(nbytes[key])

    while True:
        for d, ts in tasks.items():  # start whatever can start now
            if d not in left and nxt[d] < len(ts):
                task = ts[nxt[d]]
                if all(arrival.get(k, math.inf) <= now + eps for k in task.waits):
                    left[d] = task.work
        done = [d for d, w in left.items() if w <= eps]
        if done:  # zero work left: it ends now
            for d in done:
                emit(d, tasks[d][nxt[d]])
                del left[d]
                nxt[d] += 1
            continue
        if not left:
            if all(nxt[d] >= len(ts) for d, ts in tasks.items()):
                return {"end": now, "busy": busy}
            pending = [
                arrival[k]
                for d, ts in tasks.items()
                if nxt[d] < len(ts)
                for k in ts[nxt[d]].waits
                if k in arrival and arrival[k] > now
            ]
            if not pending:
                raise RuntimeError(
                    "executor simulation: every device waits on a message never sent"
                )
            now = min(pending)
            continue
        step = min(left.values())
        later = [
            arrival[k]
            for d, ts in tasks.items()
            if d not in left and nxt[d] < len(ts)
            for k in ts[nxt[d]].waits
            if k in arrival and arrival[k] > now + eps
        ]
        if later:
            step = min(step, min(later) - now)
        for d in left:
            left[d] -= step
            busy[d] = busy.get(d, 0.0) + step
        now += step
