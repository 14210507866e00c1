"""Step breakdown from torch.profiler Chrome traces: where each rank's step time goes.

Every step of every rank is split into parts that sum to the step's wall time:

* ``compute``   the rank's compute timeline runs forward/backward/loss ops (on the
  CPU: profiler ops such as ``aten::*`` and autograd nodes, not annotation ranges);
* ``comm_exposed``  communication the rank waited for or spent time posting:
  on the CPU, the compute thread launching a collective (``c10d::*``) or idle
  while a collective is in flight (gloo's run-loop threads); on a GPU, NCCL
  kernels running while no compute kernel runs;
* ``data``      getting the batch (``tunekit.data`` / ``DataLoader`` ranges; without
  such a range, the time from the step's start to its first forward);
* ``optimizer`` ``Optimizer.step#*`` / ``Optimizer.zero_grad#*`` (on a GPU: the
  kernels they launched);
* ``idle``      nothing of the above (Python and scheduling between ops, a GPU
  starved by its launcher).

``comm_total`` is the union of the collectives' own time (gloo run-loop events,
NCCL kernels), hidden or not. The overlap ratio of Lee et al. (Eq. 11) is
``R = 100 * sum_i (T_c^i - T_b^i) / sum_i T_c^i`` with ``T_c^i`` collective i's
own time and ``T_b^i`` the time the rank was blocked on it: compute-thread idle
time while it was in flight (CPU), or its kernel time not overlapped by compute
kernels (GPU). Idle time with several collectives in flight is shared equally.
The time spent posting a collective counts as exposed communication but not as
``T_b``: the rank is busy, not waiting.

How steps are found, in order of preference: ``ProfilerStep#N`` (a profiler with
a schedule) or ``tunekit.step#N`` ranges; else the forward markers
(``DistributedDataParallel.forward``, ``tunekit.forward``) moved back by the
rank's measured data time (``data_s`` from the trial's ``rank<R>.json``); else
the whole recorded window as one block.

The analyzers take a parsed trace (:func:`load_trace`) and return plain data
(:class:`RankBreakdown`, :class:`Breakdown`), in the manner of Holistic Trace
Analysis; traces may be ``.json`` or ``.json.gz``.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "TraceEvent",
    "Trace",
    "CollectiveTiming",
    "StepParts",
    "RankBreakdown",
    "Breakdown",
    "load_trace",
    "analyze_rank",
    "analyze_trial",
    "PARTS",
]

PARTS = ("compute", "comm_exposed", "data", "optimizer", "idle")
"""The parts a step is divided into; they sum to the step's time."""

_STEP_MARKERS = ("ProfilerStep#", "tunekit.step#")
_FORWARD_MARKERS = ("tunekit.forward", "DistributedDataParallel.forward", "## forward ##")
_DATA_MARKERS = ("tunekit.data", "enumerate(DataLoader)", "DataLoader")
_OPTIMIZER_MARKERS = ("Optimizer.step#", "Optimizer.zero_grad#", "tunekit.optimizer")
_COMM_LAUNCH = ("c10d::", "nccl:", "gloo:", "record_param_comms")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Not work on a timeline: trace spans, flow arrows, Python stacks, the GPU's copy of
# CPU annotations, the profiler's own buffer requests.
_IGNORED_CATS = ("Trace", "ac2g", "fwdbwd", "python_function", "gpu_user_annotation", "overhead")


# -- parsing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEvent:
    """A complete ("X") event; times in microseconds as Chrome traces store them."""

    name: str
    cat: str
    ts: float
    dur: float
    pid: Any
    tid: Any
    args: Mapping[str, Any]

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class Trace:
    """One rank's parsed trace."""

    events: list[TraceEvent]
    thread_names: dict[Any, str]
    rank: int | None = None
    backend: str | None = None
    path: str = ""

    @property
    def has_device_events(self) -> bool:
        return any(e.cat in _DEVICE_CATS for e in self.events)


def load_trace(source: str | Path | Mapping[str, Any]) -> Trace:
    """Parse a Chrome trace (path to ``.json``/``.json.gz``, or the loaded dict)."""
    path = ""
    if isinstance(source, str | Path):
        path = str(source)
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
    else:
        data = source
    raw = data["traceEvents"] if isinstance(data, Mapping) else data
    events, names = [], {}
    for e in raw:
        ph = e.get("ph")
        if ph == "M" and e.get("name") == "thread_name":
            names[e.get("tid")] = e.get("args", {}).get("name", "")
        if ph != "X" or not isinstance(e.get("dur"), int | float):
            continue
        if e.get("cat") in _IGNORED_CATS or not isinstance(e.get("ts"), int | float):
            continue
        events.append(
            TraceEvent(
                str(e.get("name", "")),
                str(e.get("cat", "")),
                float(e["ts"]),
                float(e["dur"]),
                e.get("pid"),
                e.get("tid"),
                e.get("args") or {},
            )
        )
    events.sort(key=lambda e: (e.ts, -e.dur))
    info = data.get("distributedInfo", {}) if isinstance(data, Mapping) else {}
    return Trace(events, names, info.get("rank"), info.get("backend"), path)


# -- results -------------------------------------------------------------------------------


@dataclass
class CollectiveTiming:
    """One collective of one step on one rank."""

    name: str
    start_s: float
    """Seconds after the step's start."""
    own_s: float
    """T_c: the collective's own time."""
    blocked_s: float
    """T_b: the time the rank was blocked on it."""


@dataclass
class StepParts:
    """One step of one rank; ``compute + comm_exposed + data + optimizer + idle == total_s``."""

    step: int
    total_s: float
    compute_s: float
    comm_exposed_s: float
    data_s: float
    optimizer_s: float
    idle_s: float
    comm_total_s: float
    collectives: list[CollectiveTiming] = field(default_factory=list)

    def parts_sum(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.data_s + self.optimizer_s + self.idle_s

    @property
    def overlap_R(self) -> float | None:
        return overlap_ratio(self.collectives)


def overlap_ratio(collectives: Iterable[CollectiveTiming]) -> float | None:
    """Lee et al. Eq. 11: R = 100 * sum(T_c - T_b) / sum(T_c); None without communication."""
    cs = list(collectives)
    total = sum(c.own_s for c in cs)
    if total <= 0:
        return None
    return 100.0 * sum(c.own_s - c.blocked_s for c in cs) / total


@dataclass
class RankBreakdown:
    """Every analysed step of one rank, with means over steps."""

    rank: int
    timeline: str
    """``cpu`` (compute-thread events) or ``gpu`` (kernels)."""
    steps_from: str
    """``markers`` (ProfilerStep#), ``forward+data_s``, or ``window``."""
    steps: list[StepParts]
    measured_step_s: list[float] | None = None
    """The rank's own per-step wall times, when known (``rank<R>.json``)."""

    def mean(self, part: str) -> float:
        """Mean seconds per step of ``part`` (``compute``, ``comm_total``, ``total`` ...)."""
        if not self.steps:
            return 0.0
        return statistics.fmean(getattr(s, f"{part}_s") for s in self.steps)

    @property
    def overlap_R(self) -> float | None:
        return overlap_ratio(c for s in self.steps for c in s.collectives)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "steps": len(self.steps)}
        for part in ("total",) + PARTS + ("comm_total",):
            out[f"{part}_s"] = self.mean(part)
        out["overlap_R"] = self.overlap_R
        if self.measured_step_s:
            out["measured_step_s"] = statistics.fmean(self.measured_step_s)
        return out


@dataclass
class Breakdown:
    """The breakdown of every rank of one profiled run."""

    ranks: list[RankBreakdown]

    def summary(self) -> dict[str, Any]:
        """Means over ranks of each rank's per-step means, with fractions of the step."""
        if not self.ranks:
            return {}
        per_rank = [r.summary() for r in self.ranks]
        out: dict[str, Any] = {"ranks": len(self.ranks)}
        for part in ("total",) + PARTS + ("comm_total",):
            out[f"{part}_s"] = statistics.fmean(r[f"{part}_s"] for r in per_rank)
        total = out["total_s"] or 1.0
        out["fractions"] = {p: out[f"{p}_s"] / total for p in PARTS}
        out["overlap_R"] = overlap_ratio(
            c for r in self.ranks for s in r.steps for c in s.collectives
        )
        measured = [r["measured_step_s"] for r in per_rank if "measured_step_s" in r]
        if measured:
            out["measured_step_s"] = statistics.fmean(measured)
        out["slowest_rank"] = max(per_rank, key=lambda r: r["total_s"])["rank"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": [asdict(r) for r in self.ranks], "summary": self.summary()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Breakdown:
        ranks = []
        for r in d["ranks"]:
            steps = [
                StepParts(
                    **{k: v for k, v in s.items() if k != "collectives"},
                    collectives=[CollectiveTiming(**c) for c in s["collectives"]],
                )
                for s in r["steps"]
            ]
            ranks.append(
                RankBreakdown(
                    r["rank"], r["timeline"], r["steps_from"], steps, r.get("measured_step_s")
                )
            )
        return cls(ranks)


# -- analysis ----------------------------------------------------------------------------------


def _starts(name: str, prefixes: tuple[str, ...]) -> bool:
    return name.startswith(prefixes)


def _is_collective_kernel(e: TraceEvent) -> bool:
    return e.cat in _DEVICE_CATS and "nccl" in e.name.lower()


def _compute_thread(trace: Trace, cpu_events: list[TraceEvent]):
    for markers in (_STEP_MARKERS, _FORWARD_MARKERS + _OPTIMIZER_MARKERS):
        for e in cpu_events:
            if _starts(e.name, markers):
                return e.tid
    busy: dict[Any, float] = {}
    for e in cpu_events:
        busy[e.tid] = busy.get(e.tid, 0.0) + e.dur
    return max(busy, key=lambda tid: busy[tid]) if busy else None


def _comm_threads(trace: Trace, cpu_events: list[TraceEvent], main_tid) -> set:
    """Threads that run collectives (gloo's run loops), not compute."""
    tids = {e.tid for e in cpu_events if e.tid != main_tid and e.name.startswith("gloo:")}
    tids |= {t for t, n in trace.thread_names.items() if "gloo" in n and t != main_tid}
    return tids


def _top_level(events: list[TraceEvent]) -> list[TraceEvent]:
    """Events not nested inside another event of the same thread."""
    out: list[TraceEvent] = []
    end_by_tid: dict[Any, float] = {}
    for e in events:  # sorted by (ts, -dur)
        if e.ts >= end_by_tid.get(e.tid, float("-inf")):
            out.append(e)
            end_by_tid[e.tid] = e.end
    return out


def _step_windows(
    main: list[TraceEvent], data_s: Sequence[float] | None
) -> tuple[list[tuple[float, float]], str]:
    marked = [e for e in main if _starts(e.name, _STEP_MARKERS)]
    if marked:
        # The profiler opens one more step range at its last step() call, closed
        # empty at exit: keep only ranges that hold work.
        work = [e for e in main if not _starts(e.name, _STEP_MARKERS)]
        windows = [(e.ts, e.end) for e in marked if any(e.ts <= w.ts < e.end for w in work)]
        return windows, "markers"
    if not main:
        return [], "window"
    last_end = max(e.end for e in main)
    forwards = _top_level([e for e in main if _starts(e.name, _FORWARD_MARKERS)])
    if forwards and data_s is not None and len(data_s) >= len(forwards):
        # The trial measured each step's data time just before its forward.
        starts = [f.ts - d * 1e6 for f, d in zip(forwards, data_s, strict=False)]
        ends = starts[1:] + [last_end]
        return list(zip(starts, ends, strict=True)), "forward+data_s"
    return [(min(e.ts for e in main), last_end)], "window"


# Labels painted on the timeline, highest priority first, with the part each counts as.
_CPU_LABELS = ("comm_launch", "optimizer", "data", "data_lead", "compute", "in_flight")
_GPU_LABELS = ("compute", "optimizer", "data", "comm_kernel", "cpu_data", "cpu_optimizer")
_PART_OF = {
    "comm_launch": "comm_exposed",
    "in_flight": "comm_exposed",
    "comm_kernel": "comm_exposed",
    "optimizer": "optimizer",
    "cpu_optimizer": "optimizer",
    "data": "data",
    "cpu_data": "data",
    "data_lead": "data",
    "compute": "compute",
}


def _paint(
    window: tuple[float, float],
    labelled: list[tuple[float, float, str, int | None]],
    labels: Sequence[str],
) -> tuple[dict[str, float], dict[int, float]]:
    """Sweep the window; each elementary segment goes to its highest-priority active label.

    ``labelled`` holds ``(start, end, label, collective index or None)``. Returns
    seconds per part (idle included) and, per collective index, the seconds it was
    the winning "blocked" label (its T_b share).
    """
    a, b = window
    prio = {lab: i for i, lab in enumerate(labels)}
    points: list[tuple[float, int, str, int | None]] = []
    for s, e, lab, idx in labelled:
        s, e = max(s, a), min(e, b)
        if e > s:
            points.append((s, 1, lab, idx))
            points.append((e, -1, lab, idx))
    points.sort(key=lambda p: (p[0], p[1]))
    counts = [0] * len(labels)
    active_coll: dict[int, int] = {}
    parts = dict.fromkeys(PARTS, 0.0)
    blocked: dict[int, float] = {}
    i = 0

    def advance(t: float) -> None:
        nonlocal i
        while i < len(points) and points[i][0] <= t:
            _, delta, lab, idx = points[i]
            counts[prio[lab]] += delta
            if idx is not None and lab in ("in_flight", "comm_kernel"):
                active_coll[idx] = active_coll.get(idx, 0) + delta
                if active_coll[idx] == 0:
                    del active_coll[idx]
            i += 1

    t = a
    advance(t)
    while t < b:
        nxt = min(points[i][0] if i < len(points) else b, b)
        seg = (nxt - t) * 1e-6
        win = next((k for k, c in enumerate(counts) if c > 0), None)
        if win is None:
            parts["idle"] += seg
        else:
            lab = labels[win]
            parts[_PART_OF[lab]] += seg
            if lab in ("in_flight", "comm_kernel") and active_coll:
                share = seg / len(active_coll)
                for idx in active_coll:
                    blocked[idx] = blocked.get(idx, 0.0) + share
        t = nxt
        advance(t)
    return parts, blocked


def _union_seconds(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    a, b = window
    clipped = sorted((max(s, a), min(e, b)) for s, e in intervals if min(e, b) > max(s, a))
    total = 0.0
    cur: tuple[float, float] | None = None  # the merged interval being extended
    for s, e in clipped:
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = (s, e)
        else:
            cur = (cur[0], max(cur[1], e))
    if cur is not None:
        total += cur[1] - cur[0]
    return total * 1e-6


def analyze_rank(
    trace: Trace,
    rank: int | None = None,
    *,
    data_s: Sequence[float] | None = None,
    measured_step_s: Sequence[float] | None = None,
) -> RankBreakdown:
    """Break every step of one rank's trace into :data:`PARTS` (see the module docstring)."""
    rank = trace.rank if rank is None else rank
    cpu_events = [e for e in trace.events if e.cat not in _DEVICE_CATS]
    main_tid = _compute_thread(trace, cpu_events)
    comm_tids = _comm_threads(trace, cpu_events, main_tid)
    main = [e for e in cpu_events if e.tid == main_tid]
    windows, steps_from = _step_windows(main, data_s)
    gpu = trace.has_device_events
    compute_events = (
        [
            e
            for e in cpu_events
            if e.tid not in comm_tids
            and not _starts(e.name, _STEP_MARKERS)
            and e.pid == main[0].pid
        ]
        if main
        else []
    )
    data_ranges = [(e.ts, e.end) for e in main if _starts(e.name, _DATA_MARKERS)]
    opt_ranges = [(e.ts, e.end) for e in main if _starts(e.name, _OPTIMIZER_MARKERS)]
    forwards = [e for e in main if _starts(e.name, _FORWARD_MARKERS)]
    if gpu:
        collectives = [e for e in trace.events if _is_collective_kernel(e)]
        labelled = _gpu_labels(trace, cpu_events, data_ranges, opt_ranges)
        labels = _GPU_LABELS
        in_flight_label = "comm_kernel"
    else:
        collectives = [e for e in cpu_events if e.tid in comm_tids and e.name.startswith("gloo:")]
        labelled = _cpu_labels(compute_events)
        labels = _CPU_LABELS
        in_flight_label = "in_flight"
    for idx, c in enumerate(collectives):
        labelled.append((c.ts, c.end, in_flight_label, idx))
    steps = []
    for k, (a, b) in enumerate(windows):
        extra: list[tuple[float, float, str, int | None]] = []
        if not data_ranges:
            # No data annotation: the rank gets its batch between the step's start
            # and its first forward (the Session's loop order).
            fwd = next((f.ts for f in forwards if a <= f.ts < b), None)
            if fwd is not None and not gpu:
                extra.append((a, fwd, "data_lead", None))
            elif fwd is not None:
                extra.append((a, fwd, "cpu_data", None))
        parts, blocked = _paint((a, b), labelled + extra, labels)
        in_step = [(i, c) for i, c in enumerate(collectives) if min(c.end, b) > max(c.ts, a)]
        colls = [
            CollectiveTiming(
                c.name,
                (max(c.ts, a) - a) * 1e-6,
                (min(c.end, b) - max(c.ts, a)) * 1e-6,
                min(blocked.get(i, 0.0), (min(c.end, b) - max(c.ts, a)) * 1e-6),
            )
            for i, c in in_step
        ]
        steps.append(
            StepParts(
                step=k,
                total_s=(b - a) * 1e-6,
                compute_s=parts["compute"],
                comm_exposed_s=parts["comm_exposed"],
                data_s=parts["data"],
                optimizer_s=parts["optimizer"],
                idle_s=parts["idle"],
                comm_total_s=_union_seconds([(c.ts, c.end) for _, c in in_step], (a, b)),
                collectives=colls,
            )
        )
    return RankBreakdown(
        rank=int(rank) if rank is not None else 0,
        timeline="gpu" if gpu else "cpu",
        steps_from=steps_from,
        steps=steps,
        measured_step_s=list(measured_step_s) if measured_step_s is not None else None,
    )


def _cpu_labels(compute_events: list[TraceEvent]) -> list[tuple[float, float, str, int | None]]:
    """Ops are compute; annotations only mark phases (data, optimizer, posting a collective).

    An annotation such as ``DistributedDataParallel.forward`` or a user's
    ``record_function`` range is not work by itself: counting it as compute
    would hide the waits and the Python time between its ops.
    """
    out: list[tuple[float, float, str, int | None]] = []
    for e in compute_events:
        if _starts(e.name, _COMM_LAUNCH):
            out.append((e.ts, e.end, "comm_launch", None))
        elif _starts(e.name, _OPTIMIZER_MARKERS):
            out.append((e.ts, e.end, "optimizer", None))
        elif _starts(e.name, _DATA_MARKERS):
            out.append((e.ts, e.end, "data", None))
        elif e.cat != "user_annotation":
            out.append((e.ts, e.end, "compute", None))
    return out


def _gpu_labels(
    trace: Trace,
    cpu_events: list[TraceEvent],
    data_ranges: list[tuple[float, float]],
    opt_ranges: list[tuple[float, float]],
) -> list[tuple[float, float, str, int | None]]:
    """Kernels labelled by what launched them (correlation id -> CPU launch time)."""
    launch_ts = {
        e.args.get("correlation"): e.ts
        for e in cpu_events
        if e.cat in ("cuda_runtime", "cuda_driver") and e.args.get("correlation") is not None
    }

    def inside(t: float | None, ranges) -> bool:
        return t is not None and any(s <= t <= e for s, e in ranges)

    out: list[tuple[float, float, str, int | None]] = []
    for e in trace.events:
        if e.cat not in _DEVICE_CATS or _is_collective_kernel(e):
            continue
        t = launch_ts.get(e.args.get("correlation"))
        if inside(t, opt_ranges):
            out.append((e.ts, e.end, "optimizer", None))
        elif inside(t, data_ranges):
            out.append((e.ts, e.end, "data", None))
        else:
            out.append((e.ts, e.end, "compute", None))
    out += [(s, e, "cpu_data", None) for s, e in data_ranges]
    out += [(s, e, "cpu_optimizer", None) for s, e in opt_ranges]
    return out


# -- a trial directory ---------------------------------------------------------------------------


def analyze_trial(trial_dir: str | Path) -> Breakdown:
    """Every rank of a profiled trial: ``traces/rank<R>.json[.gz]`` plus ``rank<R>.json``."""
    trial_dir = Path(trial_dir)
    trace_dir = trial_dir / "traces"
    paths = sorted(trace_dir.glob("rank*.json")) + sorted(trace_dir.glob("rank*.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no traces under {trace_dir}")
    ranks = []
    for path in paths:
        r = int(path.name.removeprefix("rank").split(".")[0])
        result_path = trial_dir / f"rank{r}.json"
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        timed = result.get("profiled") or result  # the traced steps' own times
        ranks.append(
            analyze_rank(
                load_trace(path),
                r,
                data_s=timed.get("data_s"),
                measured_step_s=timed.get("step_s"),
            )
        )
    ranks.sort(key=lambda rb: rb.rank)
    return Breakdown(ranks)
