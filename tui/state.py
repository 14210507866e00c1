"""What the app shows, as immutable values built from the core's own formats.

Each screen renders one view. The app replaces a view, never mutates it, so
that Textual's reactive attributes see the change (frozen dataclasses compare
by value: an unchanged poll repaints nothing). The functions here are pure and
read exactly what the core writes: ``status.json`` and ``metrics.jsonl`` of a
live run, the telemetry sampler's time series, ``tunekit profile``'s report,
the orchestrator's events. They are tested without Textual or processes.

One module, though past 600 lines: every screen's state is derived here from
the same few files, and keeping the derivations side by side keeps the screens
agreeing on what a figure means.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tunekit.config import TuningConfig
from tunekit.diagnosis_text import headline_of
from tunekit.events import (
    Decided,
    Diagnosed,
    Event,
    Notice,
    Observed,
    Planned,
    PluginProblem,
    ReportWritten,
    StudyFinished,
    StudyStarted,
    TrialFinished,
    TrialProgress,
    TrialStarted,
)
from tunekit.observe.breakdown import PARTS
from tunekit.observe.telemetry import summarize_pyspy
from tunekit.trials.feedback import relative_error

if TYPE_CHECKING:
    from tunekit.runtime.client import ApplyOutcome

HISTORY = 120
"""Points kept per time series (one per step or per telemetry sample)."""

BASELINE = "baseline"

# -- live ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceView:
    """One GPU's recent NVML samples."""

    index: int
    name: str = ""
    util_pct: tuple[float, ...] = ()
    mem_used: tuple[float, ...] = ()
    mem_total: float | None = None
    power_w: tuple[float, ...] = ()
    pcie_tx: tuple[float, ...] = ()
    pcie_rx: tuple[float, ...] = ()
    nvlink_tx: tuple[float, ...] = ()
    """Bytes/s between samples (NVML's NVLink counters are cumulative)."""
    nvlink_rx: tuple[float, ...] = ()


@dataclass(frozen=True)
class RankView:
    """One rank's process as the host sees it."""

    rank: int
    pid: int | None = None
    cpu_pct: tuple[float, ...] = ()
    rss_bytes: float | None = None
    threads: int | None = None


@dataclass(frozen=True)
class LiveView:
    """The live job: its status, step history, telemetry and the config it runs."""

    run_id: str = ""
    workload: str = ""
    status: str = "starting"
    step: int = 0
    total_steps: int | None = None
    world_size: int | None = None
    loss: float | None = None
    step_s: float | None = None
    samples_per_s: float | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    config_id: str = ""
    watch: Mapping[str, Any] | None = None
    error: str | None = None
    step_ms: tuple[float, ...] = ()
    samples_rate: tuple[float, ...] = ()
    losses: tuple[float, ...] = ()
    step_configs: tuple[int, ...] = ()
    """Per point of ``step_ms``: which of the configs seen it ran under (0, 1 …; a rollback
    returns to an earlier one's number)."""
    changes: tuple[tuple[int, str], ...] = ()
    """(index into ``step_ms`` of the first step after a change, ``apply`` or ``rollback``)."""
    applied: int = 0
    """Applies not rolled back yet (the job's stack of configs to go back to)."""
    devices: tuple[DeviceView, ...] = ()
    ranks: tuple[RankView, ...] = ()
    system_cpu: tuple[float, ...] = ()
    gpu: bool = False
    """Whether NVML sampled any GPU (False: host metrics only)."""
    notices: tuple[str, ...] = ()
    attached: bool = False
    """The app attached to a run it did not start (it is left running on quit)."""


def _values(samples: Iterable[Any]) -> tuple[float, ...]:
    return tuple(float(v) for v in samples if v is not None)


def _devices(
    nvml: Sequence[Mapping[str, Any]], static: Mapping[str, Any]
) -> tuple[DeviceView, ...]:
    names = {d["index"]: d.get("name") or "" for d in static.get("devices", [])}
    per: dict[int, list[tuple[float, Mapping[str, Any]]]] = {}
    for s in nvml:
        for g in s["data"].get("gpus", []):
            per.setdefault(int(g["index"]), []).append((s["t"], g))
    out = []
    for idx in sorted(per):
        rows = per[idx]

        def col(key: str, rows=rows) -> tuple[float, ...]:
            return _values(g.get(key) for _, g in rows)

        def counter_rate(key: str, rows=rows) -> tuple[float, ...]:
            pts = [(t, g[key]) for t, g in rows if g.get(key) is not None]
            return tuple(
                (b - a) / (tb - ta)
                for (ta, a), (tb, b) in zip(pts, pts[1:], strict=False)
                if tb > ta
            )

        totals = col("mem_total_bytes")
        out.append(
            DeviceView(
                index=idx,
                name=names.get(idx, ""),
                util_pct=col("util_gpu_pct"),
                mem_used=col("mem_used_bytes"),
                mem_total=totals[-1] if totals else None,
                power_w=col("power_w"),
                pcie_tx=col("pcie_tx_bytes_s"),
                pcie_rx=col("pcie_rx_bytes_s"),
                nvlink_tx=counter_rate("nvlink_tx_bytes"),
                nvlink_rx=counter_rate("nvlink_rx_bytes"),
            )
        )
    return tuple(out)


def _ranks(host: Sequence[Mapping[str, Any]]) -> tuple[RankView, ...]:
    per: dict[int, list[Mapping[str, Any]]] = {}
    for s in host:
        for rank, r in s["data"].get("ranks", {}).items():
            per.setdefault(int(rank), []).append(r)
    out = []
    for rank in sorted(per):
        rows = per[rank]
        last = rows[-1]
        out.append(
            RankView(
                rank,
                last.get("pid"),
                _values(r.get("cpu_pct") for r in rows),
                last.get("rss_bytes"),
                last.get("threads"),
            )
        )
    return tuple(out)


CHANGE_KINDS = {"applied": "apply", "rolled_back": "rollback"}
"""The run's events (``events.jsonl``) that change its config, as the charts mark them."""


def config_changes(
    metrics: Sequence[Mapping[str, Any]], events: Sequence[Mapping[str, Any]]
) -> tuple[tuple[int, str], ...]:
    """(index of the first metric at or after the change's step, kind) for each apply or
    rollback that falls among ``metrics``."""
    steps = [int(m.get("step", 0)) for m in metrics]
    out = []
    for e in events:
        kind = CHANGE_KINDS.get(str(e.get("kind")))
        if kind is None or e.get("step") is None or not steps:
            continue
        step = int(e["step"])
        if steps[0] < step <= steps[-1]:
            out.append((next(i for i, s in enumerate(steps) if s >= step), kind))
    return tuple(out)


def _ordinals(ids: Sequence[str]) -> tuple[int, ...]:
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(i, len(seen)) for i in ids)


def live_view(
    run_id: str,
    workload: str,
    status: Mapping[str, Any],
    metrics: Sequence[Mapping[str, Any]],
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    static: Mapping[str, Any] | None = None,
    notices: Sequence[str] = (),
    attached: bool = False,
    history: int = HISTORY,
    events: Sequence[Mapping[str, Any]] = (),
    applied: int = 0,
) -> LiveView:
    """The live view from a run's status, its recent metrics and the telemetry series.

    ``series`` is :meth:`TimeSeries.to_dict` (or part of it): ``host``, ``nvml``
    sample lists; ``static`` is :meth:`TelemetrySampler.static`; ``events`` the run's
    events (its applies and rollbacks are marked); ``applied`` how many applies the
    job could still roll back (``run.json``'s ``applied``).
    """
    metrics = [m for m in list(metrics)[-history:] if m.get("step_s") is not None]
    last = status.get("last") or (metrics[-1] if metrics else {})
    host = list(series.get("host", ()))[-history:]
    nvml = list(series.get("nvml", ()))[-history:]
    devices = _devices(nvml, (static or {}).get("nvml", {}))
    return LiveView(
        run_id=run_id,
        workload=workload,
        status=str(status.get("status", "starting")),
        step=int(status.get("step") or 0),
        total_steps=status.get("total_steps"),
        world_size=status.get("world_size"),
        loss=last.get("loss"),
        step_s=last.get("step_s"),
        samples_per_s=last.get("samples_per_s"),
        config=dict(status.get("config") or {}),
        config_id=str(status.get("config_id", "")),
        watch=status.get("watch"),
        error=status.get("error"),
        step_ms=_values(m["step_s"] * 1e3 for m in metrics),
        samples_rate=_values(m.get("samples_per_s") for m in metrics),
        losses=_values(m.get("loss") for m in metrics),
        step_configs=_ordinals([str(m.get("config_id", "")) for m in metrics]),
        changes=config_changes(metrics, events),
        applied=applied,
        devices=devices,
        ranks=_ranks(host),
        system_cpu=_values(s["data"].get("system", {}).get("cpu_pct") for s in host),
        gpu=bool(devices),
        notices=tuple(notices),
        attached=attached,
    )


# -- profile ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerRow:
    name: str
    """The layer as the model names it (``features.3 Conv2d``; the traced node's name where
    the report gives no label)."""
    kind: str
    forward_s: float
    backward_s: float
    activation_bytes: int = 0
    flops: float | None = None

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class HotSpots:
    """One rank's py-spy samples: what its main thread was doing."""

    rank: str
    samples: int
    categories: tuple[tuple[str, float], ...]
    """(category, fraction of samples), largest first."""
    top: tuple[tuple[str, float], ...]
    """(innermost function, fraction of samples), largest first."""
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProfileView:
    """The step breakdown, the per-layer times and the hot spots of one observation."""

    source: str = ""
    step_s: float | None = None
    """Mean analysed step (the parts sum to it)."""
    measured_step_s: float | None = None
    parts: tuple[tuple[str, float, float], ...] = ()
    """(part, seconds, fraction of the step) in :data:`PARTS` order."""
    overlap_R: float | None = None
    comm_total_s: float | None = None
    layers: tuple[LayerRow, ...] = ()
    hotspots: tuple[HotSpots, ...] = ()
    notices: tuple[str, ...] = ()


def _parts(summary: Mapping[str, Any]) -> tuple[tuple[str, float, float], ...]:
    fractions = summary.get("fractions") or {}
    return tuple(
        (p, float(summary.get(f"{p}_s") or 0.0), float(fractions.get(p) or 0.0)) for p in PARTS
    )


def hotspots(pyspy_samples: Sequence[Mapping[str, Any]], top: int = 5) -> tuple[HotSpots, ...]:
    """Per rank hot spots from the sampler's ``pyspy`` series (the core's summary, one rank at a time)."""
    ranks = sorted({r for s in pyspy_samples for r in s["data"].get("ranks", {})}, key=int)
    out = []
    for rank in ranks:
        mine = [
            {"t": s["t"], "data": {"ranks": {rank: s["data"]["ranks"][rank]}}}
            for s in pyspy_samples
            if rank in s["data"].get("ranks", {})
        ]
        summary = summarize_pyspy(mine, top=top)
        if not summary["samples"]:
            continue
        cats = sorted(summary["categories"].items(), key=lambda kv: -kv[1])
        out.append(
            HotSpots(
                rank,
                summary["samples"],
                tuple(cats),
                tuple((f["function"], f["fraction"]) for f in summary["top_functions"]),
                tuple(summary["flags"]),
            )
        )
    return tuple(out)


def _hotspots_from_summary(pyspy: Mapping[str, Any]) -> tuple[HotSpots, ...]:
    """Per rank categories from a py-spy summary (top functions are only known over all ranks)."""
    out = []
    for rank, counts in sorted((pyspy.get("per_rank") or {}).items(), key=lambda kv: int(kv[0])):
        n = sum(counts.values())
        if not n:
            continue
        cats = tuple(sorted(((c, k / n) for c, k in counts.items()), key=lambda kv: -kv[1]))
        top = (
            tuple((f["function"], f["fraction"]) for f in pyspy.get("top_functions", []))
            if rank == "0"
            else ()
        )
        out.append(
            HotSpots(rank, n, cats, top, tuple(pyspy.get("flags", ())) if rank == "0" else ())
        )
    return tuple(out)


def profile_from_report(
    report: Mapping[str, Any], pyspy_samples: Sequence[Mapping[str, Any]] = (), source: str = ""
) -> ProfileView:
    """From :func:`tunekit.observe.profile_job.profile_job`'s report (and its py-spy series)."""
    summary = (report.get("breakdown") or {}).get("summary") or {}
    flops = {t["name"]: t.get("flops") for t in report.get("top_layers", [])}
    labels = report.get("layer_labels") or {}
    layers = tuple(
        LayerRow(
            labels.get(t["name"]) or t["name"],
            t["kind"],
            t["forward_s"],
            t["backward_s"],
            t.get("activation_bytes", 0),
            flops.get(t["name"]),
        )
        for t in (report.get("layer_profile") or {}).get("layers", [])
    )
    spots = (
        hotspots(pyspy_samples)
        if pyspy_samples
        else _hotspots_from_summary((report.get("telemetry") or {}).get("pyspy") or {})
    )
    return ProfileView(
        source=source
        or f"profiled run: {report.get('nproc')} rank(s), {report.get('steps')} step(s) on {report.get('device')}",
        step_s=summary.get("total_s"),
        measured_step_s=summary.get("measured_step_s"),
        parts=_parts(summary),
        overlap_R=summary.get("overlap_R"),
        comm_total_s=summary.get("comm_total_s"),
        layers=layers,
        hotspots=spots,
        notices=tuple(report.get("notices", ())),
    )


def profile_from_observed(summary: Mapping[str, Any], source: str = "") -> ProfileView:
    """From a study's :class:`~tunekit.events.Observed` summary (its baseline trial)."""
    breakdown = summary.get("breakdown") or {}
    layers = tuple(
        LayerRow(t.get("label") or t["name"], t["kind"], t["forward_s"], t["backward_s"])
        for t in summary.get("top_layers", [])
    )
    telemetry = summary.get("telemetry") or {}
    return ProfileView(
        source=source or "baseline trial of the tuning (top layers only)",
        step_s=breakdown.get("total_s"),
        measured_step_s=summary.get("baseline_median_s"),
        parts=_parts(breakdown),
        overlap_R=breakdown.get("overlap_R"),
        comm_total_s=breakdown.get("comm_total_s"),
        layers=layers,
        hotspots=_hotspots_from_summary(telemetry.get("pyspy") or {}),
        notices=tuple(telemetry.get("notices", ())),
    )


# -- tuners -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaselineView:
    """What the tuners' predictions are against: the job's measured untuned steps, or nothing."""

    global_batch: int
    """Samples per step of the untuned job (all ranks)."""
    step_s: float | None = None
    """Median measured step of the untuned job; None: predictions from the models alone."""
    source: str = ""

    @property
    def samples_per_s(self) -> float | None:
        return self.global_batch / self.step_s if self.step_s else None


@dataclass(frozen=True)
class CandidateView:
    config: Mapping[str, Any]
    """The candidate as a config dict (``TuningConfig.to_dict``)."""
    description: str
    predicted_s: float | None
    rationale: str = ""
    global_batch: int | None = None
    """Samples per step of this candidate when it changes them (a batch tuner's)."""
    predicted_peak_bytes: float | None = None
    """Predicted peak memory per rank (the core memory model), when the tuner gave one."""

    def samples_per_s(self, baseline: BaselineView | None) -> float | None:
        """Predicted throughput, at this candidate's own global batch (else the baseline's)."""
        batch = self.global_batch or (baseline.global_batch if baseline else None)
        return batch / self.predicted_s if batch and self.predicted_s else None

    def speedup(self, baseline: BaselineView | None) -> float | None:
        """Predicted samples/s over the measured baseline's (None without a measured baseline)."""
        rate = self.samples_per_s(baseline)
        base = baseline.samples_per_s if baseline else None
        return rate / base if rate and base else None


@dataclass(frozen=True)
class TunerView:
    """One installed plugin: whether it loaded, whether it is enabled, what it said."""

    name: str
    title: str = ""
    aspect: str = ""
    package: str = ""
    status: str = "ok"
    """The plugin loader's verdict: ok, failed, incompatible, invalid."""
    error: str = ""
    enabled: bool = True
    state: str = "idle"
    """idle | waiting (its turn to diagnose is to come) | diagnosing | diagnosed | failed."""
    applies: bool | None = None
    summary: str = ""
    """The diagnosis's body (or why it failed)."""
    expected_gain: float | None = None
    candidates: tuple[CandidateView, ...] = ()
    headline: str = ""
    """The diagnosis in one line (:func:`tunekit.diagnosis_text.headline_of`)."""
    activity: str = ""
    """What its diagnosis is doing now ("planning its candidates"), while it runs."""

    @property
    def loaded(self) -> bool:
        return self.status == "ok"

    def best(self, baseline: BaselineView | None) -> CandidateView | None:
        """The candidate predicted to process the most samples per second (the tuner's first
        among equals, or when none has a prediction)."""
        if not self.candidates:
            return None
        return max(self.candidates, key=lambda c: c.samples_per_s(baseline) or 0.0)


def baseline_from_observed(summary: Mapping[str, Any]) -> BaselineView | None:
    """The baseline a tuning's predictions are against (its ``Observed`` summary)."""
    batch = summary.get("global_batch")
    if not batch:
        return None
    return BaselineView(int(batch), summary.get("baseline_median_s"), "the tuning's baseline trial")


def tuner_views(
    records: Iterable[Any], enabled: Iterable[str] | None = None
) -> tuple[TunerView, ...]:
    """From :func:`tunekit.plugin_loading.load_all`'s records; plugins that did not load are disabled."""
    chosen = None if enabled is None else set(enabled)
    return tuple(
        TunerView(
            name=r.name,
            title=r.title,
            aspect=r.aspect,
            package=r.package,
            status=r.status,
            error=r.error,
            enabled=r.ok and (chosen is None or r.name in chosen),
        )
        for r in records
    )


def candidate_view(
    plugin: str, candidate: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> CandidateView:
    """A candidate (``dataclasses.asdict(Candidate)``) of ``plugin`` as a config; knobs at ``defaults`` are not described."""
    others = {k: dict(v) for k, v in (candidate.get("combined_with") or {}).items()}
    config = TuningConfig({plugin: dict(candidate.get("knobs") or {}), **others})
    described = config.describe({plugin: dict(defaults)} if defaults else None)
    return CandidateView(
        config.to_dict(),
        described,
        candidate.get("predicted_step_s"),
        candidate.get("rationale", ""),
        candidate.get("global_batch"),
        candidate.get("predicted_peak_bytes"),
    )


def replace_tuner(views: tuple[TunerView, ...], name: str, **changes: Any) -> tuple[TunerView, ...]:
    return tuple(dataclasses.replace(v, **changes) if v.name == name else v for v in views)


def next_to_diagnose(views: tuple[TunerView, ...]) -> tuple[TunerView, ...]:
    """The first tuner waiting for its turn is diagnosing now (tuners run one at a time, in
    the order listed)."""
    if any(v.state == "diagnosing" for v in views):
        return views
    first = next((v for v in views if v.state == "waiting"), None)
    if first is None:
        return views
    return replace_tuner(views, first.name, state="diagnosing", activity="diagnosing")


def start_diagnosis(views: tuple[TunerView, ...], names: Iterable[str]) -> tuple[TunerView, ...]:
    """``names`` wait for their turn to diagnose (their earlier verdicts cleared)."""
    wanted = set(names)
    return tuple(
        dataclasses.replace(
            v, state="waiting", activity="", applies=None, summary="", headline="",
            expected_gain=None, candidates=(),
        )
        if v.name in wanted
        else v
        for v in views
    )  # fmt: skip


def fold_tuners(views: tuple[TunerView, ...], ev: Event) -> tuple[TunerView, ...]:
    """A tuning's diagnoses, plans and plugin problems into the tuner views.

    The enabled tuners wait from the study's start; once the observation is in, the
    orchestrator diagnoses them one after the other, so the first still waiting is the
    one diagnosing."""
    if isinstance(ev, StudyStarted):
        return start_diagnosis(views, [v.name for v in views if v.enabled and v.loaded])
    if isinstance(ev, Observed):
        return next_to_diagnose(views)
    if isinstance(ev, Diagnosed):
        views = replace_tuner(
            views,
            ev.plugin,
            state="diagnosed" if not ev.applies else "diagnosing",
            activity="planning its candidates" if ev.applies else "",
            applies=ev.applies,
            summary=ev.summary,
            headline=headline_of(ev),
            expected_gain=ev.expected_gain,
            candidates=(),
        )
        return views if ev.applies else next_to_diagnose(views)
    if isinstance(ev, Planned):
        views = replace_tuner(
            views,
            ev.plugin,
            state="diagnosed",
            activity="",
            candidates=tuple(candidate_view(ev.plugin, c) for c in ev.candidates),
        )
        return next_to_diagnose(views)
    if isinstance(ev, PluginProblem):
        views = replace_tuner(
            views, ev.plugin, state="failed", activity="", summary=f"{ev.status}: {ev.error}"
        )
        return next_to_diagnose(views)
    if (isinstance(ev, TrialStarted) and ev.role != BASELINE) or isinstance(
        ev, Decided | StudyFinished
    ):
        # Candidates run once every tuner has planned: none is diagnosing any more.
        return diagnosis_over(views)
    return views


def diagnosis_over(views: tuple[TunerView, ...]) -> tuple[TunerView, ...]:
    """No tuner waits or diagnoses any more (the diagnosis ended, or the tuning did)."""
    return tuple(
        dataclasses.replace(v, state="idle", activity="")
        if v.state in ("waiting", "diagnosing")
        else v
        for v in views
    )


# -- trials -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialView:
    trial_id: int
    seq: int
    role: str
    plugin: str | None
    description: str
    predicted_s: float | None = None
    median_s: float | None = None
    spread_s: float | None = None
    status: str = "running"
    error: str | None = None
    config: Mapping[str, Any] | None = None
    """The config the trial measured (None until known)."""
    corrected_s: float | None = None
    """``predicted_s`` corrected by the trials before this one."""
    samples_per_s: float | None = None
    """Measured throughput at the trial's own global batch: what the decision compares."""
    predicted_peak_bytes: float | None = None
    """Predicted peak memory per rank (the core memory model), when the tuner gave one."""
    peak_bytes: float | None = None
    """Measured peak memory per rank (the largest rank's)."""
    started_at: float | None = None
    """When the app saw it start (the app's clock, for the time left)."""
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.status != "running"

    @property
    def wall_s(self) -> float | None:
        """How long it ran, start to finish, as the app saw it (None if skipped or unseen)."""
        if self.status in ("skipped", "cancelled") or self.started_at is None:
            return None
        return None if self.finished_at is None else self.finished_at - self.started_at

    @property
    def global_batch(self) -> float | None:
        """Samples per step, as its measurement says (samples/s × step time)."""
        return self.samples_per_s * self.median_s if self.samples_per_s and self.median_s else None

    @property
    def predicted_samples_per_s(self) -> float | None:
        """Its prediction in samples/s, at its own measured batch (None unmeasured)."""
        batch = self.global_batch
        return batch / self.predicted_s if batch and self.predicted_s else None

    @property
    def prediction_error(self) -> float | None:
        return relative_error(self.predicted_s, self.median_s)

    @property
    def corrected_error(self) -> float | None:
        return relative_error(self.corrected_s, self.median_s)


@dataclass(frozen=True)
class StudyView:
    """A tuning started from the app: its progress, its trials and its decision."""

    state: str = "idle"
    """idle | running | finished | failed | cancelled."""
    study_id: int | None = None
    message: str = ""
    current: int | None = None
    """Trial id in flight."""
    index: int = 0
    total: int = 0
    phase: str = ""
    step: int = 0
    steps: int = 0
    step_s: float | None = None
    trials: tuple[TrialView, ...] = ()
    decision: Mapping[str, Any] | None = None
    observed: Mapping[str, Any] | None = None
    report: Mapping[str, str] | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def baseline_median_s(self) -> float | None:
        """The decision's pooled baseline, or the median of the baseline runs so far."""
        if self.decision and self.decision.get("baseline_median_s"):
            return self.decision["baseline_median_s"]
        runs = [
            t.median_s
            for t in self.trials
            if t.role == BASELINE and t.status == "ok" and t.median_s
        ]
        return statistics.median(runs) if runs else None

    @property
    def baseline_samples_per_s(self) -> float | None:
        """The baseline's throughput: the decision's pooled one, or the median of its runs so far."""
        d = self.decision or {}
        batch = d.get("baseline_global_batch") or d.get("global_batch")
        if batch and d.get("baseline_median_s"):
            return batch / d["baseline_median_s"]
        runs = [
            t.samples_per_s
            for t in self.trials
            if t.role == BASELINE and t.status == "ok" and t.samples_per_s
        ]
        if runs:
            return statistics.median(runs)
        base, batch = self.baseline_median_s, (self.observed or {}).get("global_batch")
        return batch / base if base and batch else None

    @property
    def best(self) -> TrialView | None:
        """The measured candidate with the most samples per second so far (significant or
        not): per sample, as the decision judges, since a batch change makes steps longer."""
        ok = [t for t in self.trials if t.role != BASELINE and t.status == "ok" and t.median_s]
        if not ok:
            return None
        return max(ok, key=lambda t: t.samples_per_s or 1 / t.median_s)

    def speedup(self, trial: TrialView) -> float | None:
        """``trial``'s samples/s over the baseline's."""
        base = self.baseline_samples_per_s
        return trial.samples_per_s / base if base and trial.samples_per_s else None

    def trial(self, trial_id: int) -> TrialView | None:
        return next((t for t in self.trials if t.trial_id == trial_id), None)

    @property
    def done(self) -> int:
        """Trials over (measured, failed, skipped or cancelled)."""
        return sum(t.done for t in self.trials)

    def time_left_s(self, now: float) -> float | None:
        """The tuning's time left: the trials to come at the mean wall time of those that ran
        (the one in flight counted from when it started); None before any trial ran."""
        ran = [t.wall_s for t in self.trials if t.wall_s is not None]
        if not self.running or not ran:
            return None
        mean = sum(ran) / len(ran)
        current = self.trial(self.current) if self.current is not None else None
        to_come = max(self.total - self.done - (1 if current else 0), 0)
        left = to_come * mean
        if current is not None and current.started_at is not None:
            left += max(mean - (now - current.started_at), 0.1 * mean)
        return left


def _upsert(trials: tuple[TrialView, ...], view: TrialView) -> tuple[TrialView, ...]:
    if any(t.trial_id == view.trial_id for t in trials):
        return tuple(view if t.trial_id == view.trial_id else t for t in trials)
    return (*trials, view)


def fold_study(
    study: StudyView, ev: Event, config: Mapping[str, Any] | None = None, now: float | None = None
) -> StudyView:
    """Apply one orchestrator event; ``config`` is a finished trial's config when known,
    ``now`` the app's clock when the event arrived (trials' wall times, the time left)."""
    r = dataclasses.replace
    if isinstance(ev, StudyStarted):
        extra = f" (resumed, {ev.finished_trials} trial(s) done)" if ev.resumed else ""
        return r(
            study,
            state="running",
            study_id=ev.study_id,
            message=f"study {ev.study_id} on {ev.hardware}{extra}",
        )
    if isinstance(ev, Notice | PluginProblem):
        text = (
            ev.message if isinstance(ev, Notice) else f"plugin {ev.plugin} {ev.status}: {ev.error}"
        )
        return r(study, message=text)
    if isinstance(ev, Observed):
        return r(study, observed=ev.summary)
    if isinstance(ev, TrialStarted):
        old = study.trial(ev.trial_id)
        view = TrialView(
            ev.trial_id,
            ev.seq,
            ev.role,
            ev.plugin,
            ev.description,
            ev.predicted_s,
            config=old.config if old else None,
            corrected_s=ev.corrected_s,
            started_at=now,
        )
        return r(
            study,
            trials=_upsert(study.trials, view),
            current=ev.trial_id,
            index=ev.index,
            total=ev.total,
            phase="starting",
            step=0,
            steps=0,
            step_s=None,
        )
    if isinstance(ev, TrialProgress):
        if ev.trial_id != study.current:
            return study
        return r(study, phase=ev.phase, step=ev.index, steps=ev.total, step_s=ev.step_s)
    if isinstance(ev, TrialFinished):
        old = study.trial(ev.trial_id)
        view = TrialView(
            ev.trial_id,
            ev.seq,
            ev.role,
            ev.plugin,
            ev.description,
            ev.predicted_s,
            ev.median_s,
            ev.spread_s,
            ev.status,
            ev.error,
            config if config is not None else (old.config if old else None),
            ev.corrected_s,
            getattr(ev, "samples_per_s", None),
            predicted_peak_bytes=getattr(ev, "predicted_peak_bytes", None),
            peak_bytes=getattr(ev, "peak_bytes", None),
            started_at=old.started_at if old else None,
            finished_at=now,
        )
        current = None if study.current == ev.trial_id else study.current
        return r(
            study,
            trials=_upsert(study.trials, view),
            current=current,
            phase="" if current is None else study.phase,
        )
    if isinstance(ev, Decided):
        return r(study, decision=ev.decision, message=ev.decision.get("reason", ""))
    if isinstance(ev, ReportWritten):
        return r(study, report=ev.paths)
    if isinstance(ev, StudyFinished):
        return r(study, state="finished", current=None, phase="")
    return study


def end_study(study: StudyView, state: str, message: str) -> StudyView:
    """The tuning ended early (cancelled, failed): the trial in flight ended with it."""
    trials = tuple(
        dataclasses.replace(t, status=state) if t.status == "running" else t for t in study.trials
    )
    return dataclasses.replace(
        study, state=state, message=message, current=None, phase="", step=0, steps=0,
        trials=trials,
    )  # fmt: skip


# -- apply --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyTarget:
    """A config the user may apply to the live job, and where it came from."""

    config: Mapping[str, Any]
    label: str
    significant: bool = True
    """False for a measured candidate the decision did not crown."""
    caveat: str = ""
    """What the decision said against trusting it ("too noisy to trust this winner …")."""


CAVEATS = ("too noisy", "not confirmed", "drifted")
"""Words that mark a part of the decision's reason as a reservation about its winner."""


def decision_caveat(decision: Mapping[str, Any] | None) -> str:
    """The parts of the decision's reason that say its verdict is not to be trusted as is."""
    parts = str((decision or {}).get("reason", "")).split("; ")
    return "; ".join(p for p in parts if any(w in p for w in CAVEATS))


def best_target(study: StudyView) -> ApplyTarget | None:
    """The decision's winner; when it kept the baseline, the fastest measured candidate."""
    d = study.decision
    of = f" of study {study.study_id}" if study.study_id is not None else ""
    caveat = decision_caveat(d)
    if d and d.get("winner", BASELINE) != BASELINE and d.get("winner_config"):
        return ApplyTarget(
            dict(d["winner_config"]),
            f"winner{of} {d['winner']} ({d.get('speedup', 1):.2f}x the baseline's samples/s)",
            caveat=caveat,
        )
    best = study.best
    if best is None or best.config is None:
        return None
    sp = study.speedup(best)
    vs = f", {sp:.2f}x the baseline's samples/s" if sp else ""
    why = f"the decision{of} kept the baseline; " if d else f"best so far{of}: "
    return ApplyTarget(
        dict(best.config),
        f"{why}fastest candidate {best.description}{vs}",
        significant=False,
        caveat=caveat,
    )


def trial_target(trial: TrialView) -> ApplyTarget | None:
    if trial.config is None:
        return None
    return ApplyTarget(
        dict(trial.config), f"trial {trial.seq}: {trial.description}", significant=False
    )


@dataclass(frozen=True)
class ApplyView:
    """The apply screen: what would be applied, and what the last apply did."""

    target: ApplyTarget | None = None
    state: str = "idle"
    """idle | applying | kept | rolled_back | relaunched | failed | rolling_back."""
    message: str = ""
    result: ApplyOutcome | None = None
