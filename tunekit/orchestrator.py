"""The tuning pipeline: workload → observe → diagnose → plan → trials → decide.

:func:`run_auto` is an async generator of :mod:`tunekit.events`; ``tunekit
auto`` renders them with progress bars and the TUI with widgets. Every stage
writes to the study store, so an interrupted study resumes where it stopped
(finished trials are never re-run) and reports can be re-printed later.

One module, though the longest in the core: the stages share one run's state
(``_Run``: the store, the budget, the live run it pauses, the nodes it
coordinates) and each resumes from what the one before stored; the pieces
that stand alone live elsewhere (observing: ``observe.static``; diagnosing and
planning: ``planning``; scheduling, statistics and decisions: ``trials``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import statistics
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import psutil

from tunekit.config import TuningConfig, resolve
from tunekit.contract import Aspect, Candidate, Diagnosis, Tuner
from tunekit.diagnosis_text import headline_of
from tunekit.errors import ConfigError, ControlError, TunekitError
from tunekit.events import (
    BUDGET_SKIP,
    NOTHING_RAN,
    Decided,
    Diagnosed,
    Event,
    Notice,
    Observed,
    PluginProblem,
    ReportWritten,
    Reranked,
    StudyFinished,
    StudyStarted,
    TrialFinished,
    TrialProgress,
    TrialStarted,
)
from tunekit.hardware import Hardware
from tunekit.layout import Layout
from tunekit.locks import describe_holder
from tunekit.observe.blocks import profile_blocks
from tunekit.observe.breakdown import Breakdown, analyze_trial
from tunekit.observe.observation import Measurement, Observation, TelemetrySummary
from tunekit.observe.probe import DEFAULT_REPEATS, DEFAULT_SIZES, ProbeResult, probe_result
from tunekit.observe.static import (
    StaticObservation,
    describe_hardware,
    observe_in_child,
    probe_cache_key,
    resolve_device_type,
)
from tunekit.observe.telemetry import TelemetrySampler
from tunekit.observe.workload_process import OBSERVE_LOG, ObservationFailed, WorkloadProcess
from tunekit.planning import (
    ChildHooks,
    TunerDiagnosed,
    TunerFailed,
    TunerPlanned,
    TunerStep,
    diagnose_and_plan,
    diagnose_and_plan_side_by_side,
)
from tunekit.plugin_loading import PluginRecord, load_all, select, slow_imports
from tunekit.runtime.rundir import RunDir
from tunekit.store import Store, TrialRow
from tunekit.timings import Timings, own_cpu_s
from tunekit.trials.decide import (
    BASELINE,
    CANDIDATE,
    COMBINED,
    CONFIRM,
    SEARCH,
    PlannedTrial,
    baseline_drift,
    decide,
    leader_to_confirm,
    schedule,
    still_unclear,
)
from tunekit.trials.feedback import (
    Corrector,
    PoolEntry,
    choose_next,
    measured_peak,
    outcomes_of,
    predicted_peaks,
    rank_pool,
)
from tunekit.trials.launcher import (
    LaunchOptions,
    TrialOutcome,
    TrialSpec,
    rank_threads,
    run_trial,
)
from tunekit.trials.length import trial_length, wall_estimate
from tunekit.trials.nodes import (
    Coordinator,
    NodesError,
    describe_hello,
    describe_node,
    describe_slowest,
    host_coordinator,
    node_summary,
)
from tunekit.trials.output import OutputRecord
from tunekit.workload import prepare_arguments


@dataclass
class AutoSettings:
    """Everything ``tunekit auto`` takes."""

    workload: str = "example:cnn"
    nproc: int = 2
    plugins: list[str] | None = None
    """Tuners to use; None: every installed tuner that loads."""
    trials: int | None = 3
    """Candidate trials to run (baseline repeats come on top)."""
    budget_s: float | None = None
    """Wall-clock budget; trials that would not fit are skipped."""
    out_dir: Path = Path("tunekit-out")
    store_dir: Path = Path(".tunekit")
    resume: bool = False
    warmup: int = 3
    steps: int = 16
    timeout_s: float = 300.0
    stall_s: float | None = 60.0
    """A trial that finishes no step for this long is a hang (see ``LaunchOptions.stall_s``)."""
    min_effect: float = 0.01
    """A winner must be faster than the baseline by this fraction beyond noise."""
    baseline_every: int = 3
    """Re-measure the baseline after this many candidates (interleaving)."""
    measure_rounds: int = 3
    """Paired rounds (the leader, and its rival, beside the baseline) a decision that is not yet
    clear may add, within the time budget (see ``still_unclear``)."""
    device: str = "auto"
    hardware: str | None = None
    """Plan for this hardware profile (name or TOML) instead of this machine."""
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    seed: int = 0
    probe: bool = True
    """Measure this machine's collectives once (cached) when no probe is stored."""
    search_steps: int = 60
    """Training steps an in-job search (a tuner's ``search`` hook) may use."""
    plan_limit: int | None = None
    """Candidates each tuner plans (None: as many as ``trials``, at least 8)."""
    in_job_search: bool = True
    """Run the in-job searches of tuners that have one (cgdp, batch_ps_sizing) as trials."""
    rerank: bool = True
    """After every trial, re-rank the candidates left to run by predictions corrected from
    the trials so far (and drop those now predicted slower than the baseline). Off: run
    every tuner's planned candidates in plan order, round-robin across tuners; corrected
    predictions are still recorded (``benchmarks/prediction_error.py`` measures this way)."""
    node_token: str | None = None
    """Several nodes: the token followers must hold (None: a fresh one in the store folder's
    ``node-token``)."""
    join_timeout_s: float = 300.0
    """Several nodes: how long the followers have to join before the study stops."""
    memory_cap_bytes: int | None = None
    """``--memory-cap``: the most memory a rank may hold; a step over it fails its trial as
    out of memory, and planners read it as each device's memory."""
    clock_from: float | None = None
    """``time.monotonic()`` at which the time budget starts counting (None: when the study
    starts). The CLI gives its own process's start, so that ``--budget`` bounds the command."""
    pause_run: RunDir | None = None
    """A live job on this machine to hold at a step boundary while the study measures
    (it would slow the trials, and they it); it resumes when the trials end, fail or
    tunekit exits."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError("--nproc must be at least 1")
        if self.trials is not None and self.trials < 0:
            raise ConfigError("--trials must be 0 or more")
        if self.budget_s is not None and self.budget_s <= 0:
            raise ConfigError("--budget must be positive")
        if self.steps < 2 or self.warmup < 0:
            raise ConfigError("--steps must be at least 2 and --warmup at least 0")
        self.out_dir, self.store_dir = Path(self.out_dir), Path(self.store_dir)
        self.launch.nproc = self.nproc
        self.launch.timeout_s = self.timeout_s
        self.launch.stall_s = self.stall_s

    def study_settings(self) -> dict[str, Any]:
        """The settings that decide what a trial measures (part of the study key)."""
        return {
            "nproc": self.nproc,
            "world_size": self.launch.world_size,
            "warmup": self.warmup,
            "steps": self.steps,
            "device": self.device,
            "hardware": self.hardware,
            "plugins": sorted(self.plugins) if self.plugins else None,
            "seed": self.seed,
            "memory_cap_bytes": self.memory_cap_bytes,
        }


def job_settings(static: StaticObservation, s: AutoSettings) -> dict[str, Any]:
    """The settings that change what a trial measures, and the workload's layout when it is
    not plain DDP (a study keeps them; ``tunekit plan`` matches a stored baseline on them)."""
    layout = static.workload.layout()
    extra = {"layout": layout.to_dict()} if layout != Layout() else {}
    return {**s.study_settings(), **extra}


def study_key_of(static: StaticObservation, s: AutoSettings) -> str:
    """The study key of a job: its model, the hardware and :func:`job_settings`."""
    return study_key(static.graph_hash, static.hardware.fingerprint(), job_settings(static, s))


def study_key(graph_hash: str, hw_fingerprint: str, settings: dict[str, Any]) -> str:
    blob = json.dumps(
        {"graph": graph_hash, "hw": hw_fingerprint, "settings": settings}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# -- the pipeline -------------------------------------------------------------------------


class _Run:
    """State of one ``tunekit auto`` invocation."""

    def __init__(self, settings: AutoSettings):
        self.s = settings
        self.started = settings.clock_from or time.monotonic()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.nodes: Coordinator | None = None
        """Several nodes: the followers' coordinator (this is node 0)."""
        self.node_probes: dict[int, list[dict[str, Any]]] = {}
        """Several nodes: each node's own collective fits (node 0's too)."""
        self.token_hint = ""
        """How a follower gets the token (``--token-file PATH``), when this study made it."""
        self.timings = Timings()
        """Where this run's time went, stage by stage (report.json's ``timings``)."""
        self.probe: dict[str, Any] | None = None
        """What the first baseline trial's ranks probe after their steps (``TrialSpec.probe``)."""
        self.probed: ProbeResult | None = None
        """What they measured."""
        if settings.clock_from is not None:  # the command's own start: its imports, torch's
            self.timings.add("start: tunekit itself", self.elapsed(), own_cpu_s())

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fits_budget(self, walls: list[float]) -> bool:
        """Whether trials of these expected wall times, one after another, fit in the budget left."""
        if self.s.budget_s is None:
            return True
        return self.elapsed() + sum(walls) <= self.s.budget_s

    def wall(
        self, config_id: str, step_s: float | None, rows: list[TrialRow], search: bool = False
    ) -> float:
        """Expected wall seconds of a trial of ``config_id`` (see ``wall_estimate``)."""
        s = self.s
        return wall_estimate(
            config_id, step_s, rows, s.warmup, s.steps, s.search_steps if search else 0
        )

    def walls_for(self, row: TrialRow, rows: list[TrialRow]) -> list[float]:
        """The expected wall times of ``row``'s trial and of those the budget keeps back behind it:
        for a candidate, the baseline that closes its block (if one is planned), a confirmation
        and the baseline beside that, so that a winner is never declared on a single run for
        lack of time (the confirmation of whichever will lead: this candidate, or one measured
        once already that looks faster than the baseline, the longest of them); for a
        confirmation, its baseline."""
        step_s = row.corrected_s or row.predicted_s
        own = self.wall(row.config_id, step_s, rows, search=bool(row.config.get("search")))
        base = self.wall(TuningConfig().config_id, None, rows)
        if row.role in (CANDIDATE, SEARCH, COMBINED):
            later = [t for t in rows if not t.done and t.seq > row.seq]
            closing = [base] if any(t.role == BASELINE for t in later) else []
            leaders = [
                self.wall(r["config_id"], r["median_s"], rows)
                for r in decide(rows, self.s.min_effect)["candidates"]
                if r.get("comparison")
                and r["runs"] == 1
                and r["comparison"]["speedup"] > 1 + self.s.min_effect
            ]
            confirm = max([self.wall(row.config_id, step_s, rows), *leaders])
            return [own, *closing, confirm, base]
        return [own, base] if row.role == CONFIRM else [own]


async def run_auto(settings: AutoSettings) -> AsyncIterator[Event]:
    """Run (or resume) a study; yield events as it goes. Bad input raises TunekitError."""
    s = settings
    run = _Run(s)
    store = Store.open_default(s.store_dir)
    sid: int | None = None
    held = contextlib.ExitStack()  # the live job's pause, if any
    # The workload's code runs in this child: observation, then (after the baseline trial,
    # which it waits out idle) the tuners' hooks. Its start-up overlaps loading the plugins.
    observer = WorkloadProcess(s.store_dir / OBSERVE_LOG, s.timeout_s)
    lock = None  # this study's, held until the end
    try:
        if s.launch.nnodes > 1:
            for notice in _coordinate(run, s):
                yield notice
        with run.timings.stage("start: load the tuners"):
            await observer.start()
            records = load_all()
            tuners = select(records, s.plugins)
        not_loaded = [r for r in records if not r.ok and (s.plugins is None or r.name in s.plugins)]
        for rec in not_loaded:
            yield PluginProblem(rec.name, rec.package, rec.status, rec.error, rec.traceback)
        for line in slow_imports([r for r in records if r.name in tuners]):
            yield Notice(line, "warning")
        paused = False
        if s.pause_run is not None:
            paused, notice = await _pause(held, s.pause_run, s.workload)
            yield notice
        try:
            static = await observe_in_child(
                s.workload,
                s.launch.world_size,
                s.device,
                s.hardware,
                store,
                s.seed,
                s.launch.threads_per_rank,
                True,
                False,  # the baseline trial's ranks probe, where no probe is cached (below)
                s.timeout_s,
                s.store_dir,
                observer,
                run.timings,
            )
        except (
            ObservationFailed
        ) as exc:  # no study yet (its key is the graph's hash): an event says it
            store.log_event(
                None,
                "observation_failed",
                {"workload": s.workload, "status": exc.status, "error": str(exc)},
            )
            raise ObservationFailed(
                exc.status, f"could not observe {s.workload} ({exc.status}): {exc}"
            ) from None
        if (
            static.device_type == "cuda"
        ):  # its CUDA context would hold GPU memory beside the baseline trial
            await observer.close()  # the tuners' hooks then start a fresh one
        spec, graph_hash, hardware = static.spec, static.graph_hash, static.hardware
        wants_probe = (
            s.probe
            and not s.hardware
            and s.launch.loopback_nodes == 1
            and s.launch.nnodes == 1
            and s.launch.world_size >= 2
            and not hardware.collectives
        )
        if wants_probe:
            run.probe = {"sizes": list(DEFAULT_SIZES), "repeats": DEFAULT_REPEATS}
        for text in static.notices:
            yield Notice(text, "warning")
        check_memory_cap(s.memory_cap_bytes, static, s.launch.world_size)
        key = study_key_of(static, s)
        lock = store.lock_study(
            key, spec
        )  # before anything is reset or planned: one runner per study
        for other in store.other_runners(key):
            yield Notice(
                f"{describe_holder(other)} is running a study of {other.get('workload', 'another workload')} "
                "in this store now: its trials and these share this machine, which skews both",
                "warning",
            )

        study = store.latest_study(key, unfinished=True) if s.resume else None
        resumed = study is not None
        if s.resume and not resumed:
            yield Notice(
                "--resume: no unfinished study of this workload and settings; starting a new one",
                "warning",
            )
        if study is None:
            sid = store.create_study(
                key=key,
                workload=spec,
                graph_hash=graph_hash,
                hw_fingerprint=hardware.fingerprint(),
                nproc=s.nproc,
                settings=job_settings(static, s),
            )
            store.add_trial(
                sid,
                seq=0,
                role=BASELINE,
                plugin=None,
                config_id=TuningConfig().config_id,
                config=TuningConfig().to_dict(),
            )
            study = store.study(sid)
        else:
            store.reset_unfinished(study.id)
            store.set_study(study.id, status="running")
            earlier = (study.observation or {}).get("timings", [])
            run.timings.stages[:0] = Timings(earlier).stages
        sid = study.id
        lock.update(study=sid)
        if "plans" in (study.observation or {}):  # planned already: no tuner hook will run
            await observer.close()
        done = [t for t in store.trials(sid) if t.done]
        yield StudyStarted(sid, spec, s.nproc, hardware.name, resumed, len(done), s.launch.nnodes)
        store.log_event(sid, "started", {"resumed": resumed, "settings": s.study_settings()})

        if run.nodes is not None:
            async for ev in _wait_for_followers(run, store, sid):
                yield ev
        # Baseline first, observed (telemetry, profiled steps): every tuner reads it.
        async for ev in _run_pending(run, store, sid, spec, tuners, only_seq=0, observe=True):
            yield ev
        base_row = store.trials(sid)[0]
        if wants_probe and base_row.status == "ok":
            static.hardware, probe_notes = await _probed(run, store, static, s)
            for text in probe_notes:
                yield Notice(text, "warning")
        if base_row.status != "ok":
            store.set_study(
                sid,
                status="finished",
                finished=time.time(),
                decision={"winner": BASELINE, "reason": f"baseline failed: {base_row.error}"},
            )
            raise TunekitError(f"the baseline trial failed ({base_row.status}): {base_row.error}")
        assert base_row.result is not None  # a finished trial has its result
        baseline = Measurement(**base_row.result["measurement"])
        obs = static.observation(
            s.launch.world_size,
            baseline,
            store,
            memory_cap_bytes=s.memory_cap_bytes,
            baseline_peak_bytes=peak_of(base_row),
        )
        with run.timings.stage("observe: analyse the baseline's profile"):
            obs.breakdown, obs.telemetry = observed_baseline(base_row)
        observation = study.observation or {}
        if run.nodes is not None:  # who joined this time (a resumed study may meet other machines)
            observation["nodes"] = {str(r): hello for r, hello in sorted(run.nodes.nodes.items())}
        if "summary" not in observation:
            observation["summary"] = _observation_summary(obs)
            if run.nodes is not None:
                observation["summary"]["nodes"] = _nodes_summary(
                    run.nodes, obs, base_row, run.node_probes
                )
                if line := describe_slowest(observation["summary"]["nodes"]):
                    yield Notice(line)
        yield Observed(observation["summary"])

        if "plans" not in observation:  # not planned yet (a plan is written whole or not at all)
            observation["problems"] = [_load_problem(r) for r in not_loaded]
            async for ev in _diagnose_and_plan(run, store, sid, obs, tuners, observation, observer):
                yield ev
        else:
            for name, diag in observation.get("diagnoses", {}).items():
                stored = Diagnosis(
                    diag["applies"],
                    diag["summary"],
                    diag.get("expected_gain"),
                    headline=diag.get("headline", ""),
                )
                yield Diagnosed(
                    name, stored.applies, stored.summary, stored.expected_gain, headline_of(stored)
                )

        async for ev in _run_pending(run, store, sid, spec, tuners):
            yield ev
        # A winner that needed more rounds to show gets its combination after them.
        for _ in range(2):
            async for ev in _combine_winners(run, store, sid, spec, tuners):
                yield ev
            async for ev in _confirm_leader(run, store, sid, spec, tuners):
                yield ev
            async for ev in _measure_more(run, store, sid, spec, tuners):
                yield ev
        if paused:
            assert s.pause_run is not None  # paused only when there is a run to pause
            held.close()
            yield Notice(f"run {s.pause_run.run_id} resumed")

        with run.timings.stage("decide"):
            trials = store.trials(sid)
            decision = decide(trials, s.min_effect, _describer(tuners))
            decision["global_batch"] = obs.global_batch
            notices = _qualify(decision, trials, s, store.study(sid).observation or {})
        for notice in notices:
            yield notice
        if run.nodes is not None and (refused := run.nodes.refusals.summary()):
            store.log_event(sid, "node_values_refused", {"count": run.nodes.refusals.count})
            yield Notice(refused, "warning")
        store.set_study(sid, status="finished", finished=time.time(), decision=decision)
        yield Decided(decision)
        from tunekit.report import write_report

        _store_timings(store, sid, run.timings)  # the report shows them, up to here
        with run.timings.stage("write the report"):
            paths = write_report(store, sid, s.out_dir, tuners, launch=s.launch)
        timings = _store_timings(store, sid, run.timings)  # `tunekit report` shows them all
        yield ReportWritten({k: str(v) for k, v in paths.items()})
        store.log_event(sid, "finished", {"winner": decision["winner"]})
        yield StudyFinished(sid, decision["winner"], decision.get("speedup"), timings)
    except (asyncio.CancelledError, KeyboardInterrupt, GeneratorExit, NodesError):
        if sid is not None:  # leave the study resumable: the trial in flight runs again
            store.reset_unfinished(sid)
            store.set_study(sid, status="interrupted")
        raise
    finally:
        if run.nodes is not None:
            await asyncio.to_thread(run.nodes.close)
        held.close()
        await observer.close(kill=True)  # already ended, unless the study stopped before planning
        if lock is not None:
            lock.release()
        store.close()


async def _probed(
    run: _Run, store: Store, static: StaticObservation, s: AutoSettings
) -> tuple[Hardware, list[str]]:
    """This machine with the collectives the baseline trial's ranks timed, cached for later
    studies; or, where they did not (a study resumed after its baseline, a probe that failed),
    probed now by ranks of its own."""
    probed = run.probed
    if probed is None:
        with run.timings.stage("observe: probe the collectives (ranks of its own)"):
            return await asyncio.to_thread(
                describe_hardware, s.launch.world_size, static.device_type, None, store, True
            )
    hw = probed.hardware
    store.cache_put(probe_cache_key(hw), [asdict(f) for f in hw.collectives])
    return hw, [
        f"probed this machine's collectives in the baseline trial ({probed.wall_s:.0f} s); "
        "cached for later studies (tunekit hardware probe re-measures)"
    ]


def _store_timings(store: Store, sid: int, timings: Timings) -> list[dict[str, Any]]:
    """The stages so far (a resumed study's earlier runs first) into the study's observation."""
    observation = store.study(sid).observation or {}
    rows = timings.to_list()
    observation["timings"] = rows
    store.set_study(sid, observation=observation)
    return rows


def _coordinate(run: _Run, s: AutoSettings) -> list[Notice]:
    """Host the followers' store (this is node 0); say how each follower joins."""
    if s.launch.node_rank != 0:
        raise ConfigError("node ranks above 0 follow the coordinator: run `tunekit follow` there")
    if not s.launch.rdzv_endpoint:
        raise ConfigError(
            "several nodes need --rdzv-endpoint HOST:PORT: where this node hosts the coordinator"
        )
    loop = asyncio.get_running_loop()

    def say(
        line: str,
    ) -> None:  # from whichever thread reads the store; yielded with the next events
        loop.call_soon_threadsafe(run.queue.put_nowait, Notice(line, "warning"))

    run.nodes, run.token_hint = host_coordinator(
        s.launch.rdzv_endpoint, s.launch.nnodes, s.node_token, s.store_dir, say
    )
    return [Notice(run.nodes.how_to_follow(run.token_hint))]


async def _wait_for_followers(run: _Run, store: Store, sid: int) -> AsyncIterator[Event]:
    """Every follower joined, or a NodesError naming those that did not."""
    nodes = run.nodes
    assert nodes is not None  # only a study across nodes waits for followers
    loop = asyncio.get_running_loop()

    def joined(r: int, _: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(run.queue.put_nowait, Notice(describe_hello(nodes, r)))

    waiting = asyncio.create_task(
        asyncio.to_thread(nodes.wait_for_followers, run.s.join_timeout_s, run.token_hint, joined)
    )
    while not waiting.done():  # each node said as it joins, or fails to authenticate
        with contextlib.suppress(TimeoutError):
            yield await asyncio.wait_for(run.queue.get(), timeout=0.2)
    await asyncio.sleep(0)  # the last call_soon_threadsafe
    while not run.queue.empty():
        yield run.queue.get_nowait()
    waiting.result()
    store.log_event(
        sid, "nodes_joined", {str(r): hello for r, hello in sorted(nodes.nodes.items())}
    )
    s = run.s
    if (
        s.probe and not s.hardware and s.nproc >= 2
    ):  # each node's own collectives, measured on it, once
        yield Notice(
            f"measuring each node's collectives on its {s.nproc} ranks (once per node; cached)"
        )
        own = asyncio.create_task(asyncio.to_thread(_probe_here, s.nproc, s.device, store))
        replies = await asyncio.to_thread(nodes.probe, s.nproc, s.timeout_s)
        run.node_probes = {0: await own}
        for r in nodes.followers:
            reply = replies.get(r) or {"error": "no answer"}
            if "fits" in reply:
                run.node_probes[r] = reply["fits"]
            else:
                yield Notice(
                    f"{nodes.describe(r)} could not measure its collectives: {reply['error']}",
                    "warning",
                )


def _qualify(
    decision: dict[str, Any], trials: list[TrialRow], s: AutoSettings, observation: dict[str, Any]
) -> list[Notice]:
    """Say in the decision what limited it: no candidate asked for, every candidate predicted
    slower, a winner left unconfirmed by the budget, trials skipped for time, a machine too
    noisy to decide. Returns warnings."""
    notices = []
    tried = [t for t in trials if t.role != BASELINE]
    if s.trials == 0 and not tried:
        decision["reason"] = (
            "--trials 0: the baseline was measured and every tuner diagnosed and planned "
            "(see the report); no candidate was tried"
        )
    elif not tried and observation.get("dropped"):
        decision["reason"] = (
            f"all {len(observation['dropped'])} planned candidate(s) were predicted slower than "
            "the baseline, so none was tried (--no-rerank tries them anyway)"
        )
    skipped = [t for t in trials if t.status == "skipped" and t.error == BUDGET_SKIP]
    if skipped:
        decision["budget_skipped"] = len(skipped)
        decision["reason"] += (
            f"; {len(skipped)} planned trial(s) did not fit the {s.budget_s:g} s budget"
        )
    winner = next(
        (
            r
            for r in decision.get("candidates", [])
            if r.get("trial_id") == decision.get("winner_trial")
        ),
        None,
    )
    if winner is not None and winner.get("runs") == 1:
        why = " (the time budget left no room)" if s.budget_s is not None else ""
        decision["reason"] += f"; not confirmed by a second run{why}"
    more = observation.get("measured_more") or {}
    settled = bool(more.get("clear")) and more.get("rounds", 0) > 0
    if more:
        decision["measured_more"] = more
        n = more.get("rounds", 0)
        rounds = f"{n} more paired round(s)"
        if settled:
            decision["reason"] += f"; clear after {rounds} beside the baseline"
        elif not more.get("clear"):
            budget = f"the {s.budget_s:g} s budget" if s.budget_s is not None else "the budget"
            unclear = more.get("why", "")
            if more.get("spent") == "time budget":
                spent = budget
            else:
                spent = f"its {n} round(s)" if n else "--measure-rounds 0"
            if more.get("rival_only"):  # the win is settled; which of two winners is open
                decision["reason"] += (
                    f"; the win is clear, but not which of two is faster ({unclear}): either "
                    f"gains about as much"
                    + (f" ({rounds}, then {spent} spent)" if n else f" ({spent} left no room)")
                )
            else:
                decision["reason"] += (
                    f"; still unclear after {rounds} ({unclear}): {spent} spent"
                    if n
                    else f"; unclear ({unclear}), and {spent} left no room to measure more"
                )
    drift = baseline_drift(trials)
    if drift is not None:
        decision["baseline_drift"] = drift
        runs = " → ".join(f"{m * 1e3:.0f}" for m in drift["medians_s"])
        verdict = (
            "noisy, and the paired rounds settled the decision regardless"
            if settled
            else "too noisy to decide"
            if decision.get("winner") == BASELINE
            else "too noisy to trust this winner without a rerun"
        )
        advice = (
            ""
            if settled
            else "; close other work on this machine (or pause it: `tunekit auto --apply RUN` "
            "pauses RUN), then run again with more --steps"
        )
        decision["reason"] += f"; the baseline drifted between its runs ({runs} ms/step): {verdict}"
        notices.append(
            Notice(
                f"the baseline drifted {drift['ratio']:.1f}x between its {len(drift['medians_s'])} runs "
                f"({runs} ms/step): this machine was {verdict}{advice}",
                "info" if settled else "warning",
            )
        )
    return notices


async def _pause(held: contextlib.ExitStack, rd: RunDir, workload: str) -> tuple[bool, Notice]:
    """Hold the live job for as long as ``held`` is open; whether it is held, and a word on it."""
    from tunekit.runtime.supervisor import client

    pause = client(rd).paused(f"tunekit auto is measuring {workload}")
    try:
        reply = await asyncio.to_thread(held.enter_context, pause)
    except ControlError as exc:
        return False, Notice(
            f"run {rd.run_id} could not be paused ({exc}); the trials share the machine with it",
            "warning",
        )
    return True, Notice(
        f"run {rd.run_id} paused at step {reply['paused_at']} while the trials measure this machine"
    )


def _describer(tuners: Mapping[str, Tuner]):
    defaults = {name: t.defaults() for name, t in tuners.items()}

    def describe(cfg: dict[str, Any]) -> str:
        return TuningConfig.from_dict(cfg).describe(defaults)

    return describe


def _probe_here(nproc: int, device: str, store: Store) -> list[dict[str, Any]]:
    """This node's collectives on ``nproc`` ranks, from the store's cache or measured now."""
    hw, _ = describe_hardware(nproc, resolve_device_type(device), None, store, probe=True)
    return [asdict(f) for f in hw.collectives]


def _node_telemetry(trial_dir: Path, followers: list[int]) -> dict[str, Any]:
    out = {}
    for r in followers:
        try:
            out[str(r)] = json.loads((trial_dir / f"telemetry-node{r}.json").read_text())
        except (OSError, ValueError):
            continue
    return out


def _nodes_summary(
    nodes: Coordinator,
    obs: Observation,
    base_row: TrialRow,
    probes: dict[int, list[dict[str, Any]]],
) -> dict[str, Any]:
    """Each node of the baseline: what it is, how long its ranks computed, how busy its CPUs were."""
    result = base_row.result or {}
    hellos = {0: describe_node(), **nodes.nodes}
    compute = {}
    if obs.breakdown is not None:
        compute = {rb.rank: rb.summary()["compute_s"] for rb in obs.breakdown.ranks}
    telemetry = {
        0: result.get("telemetry"),
        **{int(r): t for r, t in (result.get("telemetry_nodes") or {}).items()},
    }
    return node_summary(
        hellos,
        max(1, obs.nproc // nodes.nnodes),
        compute,
        telemetry,  # obs.nproc: the world
        probes,
    )


def check_memory_cap(cap: int | None, static: StaticObservation, world_size: int) -> None:
    """Refuse, in one line, a cap below what the model's parameters alone take on a rank."""
    if cap is None:
        return
    shards = world_size if static.workload.layout().sharded else 1
    own = static.summary.param_bytes / shards
    if cap < own:
        from tunekit.memory import format_bytes

        raise ConfigError(
            f"--memory-cap {format_bytes(cap)} is below this job's own parameters per rank "
            f"({format_bytes(own)}{', sharded over ' + str(shards) + ' ranks' if shards > 1 else ''}): "
            "nothing could run; give a larger cap"
        )


def combined_over_cap(trials: list[TrialRow], config_ids: list[str], s: AutoSettings) -> str:
    """Why winners together would run out of ``--memory-cap`` ("" when they fit or nothing
    says): each winner's measured rise over the baseline's peak, added up."""
    cap = s.memory_cap_bytes
    if cap is None:
        return ""
    peaks: dict[str, float] = {}
    for t in trials:
        peak = peak_of(t) if t.status == "ok" else None
        if peak is not None:
            peaks[t.config_id] = max(peak, peaks.get(t.config_id, 0.0))
    base = peaks.get(TuningConfig().config_id)
    rises = [peaks.get(c) for c in config_ids]
    if base is None or any(p is None for p in rises):
        return ""
    combined = base + sum(p - base for p in rises if p is not None)
    if combined <= cap:
        return ""
    from tunekit.memory import format_bytes

    return (
        f"their measured peaks add up to ~{format_bytes(combined)} per rank, over the "
        f"--memory-cap of {format_bytes(cap)}"
    )


def peak_of(row: TrialRow) -> float | None:
    """A trial's measured peak memory per rank: the largest over its ranks (None: unmeasured)."""
    return measured_peak(row.result)


def memory_summary(obs: Observation) -> dict[str, Any] | None:
    """What fills a rank's memory in the baseline: the model's parts, calibrated on the
    measured peak, beside the measured figure."""
    predicted = obs.predict_memory()
    if predicted is None:
        return None
    return {
        "measured_peak_bytes": obs.baseline_peak_bytes,
        "predicted": predicted.to_dict(),
        "cap_bytes": obs.memory_cap_bytes,
        "layout": obs.workload.layout().describe(),
        "line": predicted.describe(),
    }


def _observation_summary(obs: Observation) -> dict[str, Any]:
    return {
        "workload": obs.workload_spec,
        "num_params": obs.model.num_params,
        "param_mib": obs.model.param_bytes / 2**20,
        "layers": len(obs.model.layers),
        "world_size": obs.nproc,
        "batch_size": obs.workload.batch_size,
        "global_batch": obs.global_batch,
        "backend": obs.backend,
        "device": obs.device_type,
        "hardware": obs.hardware.name,
        "baseline_median_s": obs.baseline.median_s if obs.baseline else None,
        "baseline_spread_s": obs.baseline.spread_s if obs.baseline else None,
        "baseline_samples_per_s": obs.baseline.samples_per_s if obs.baseline else None,
        "graph": obs.graph.summary() if obs.graph is not None else None,
        "breakdown": obs.breakdown.summary() if obs.breakdown is not None else None,
        "truth": _truth_dict(obs),
        "telemetry": obs.telemetry,
        "top_layers": [_layer_row(obs, t) for t in obs.layer_profile.top(5)]
        if obs.layer_profile is not None
        else [],
        "blocks": profile_blocks(obs.graph, obs.layer_profile, obs.workload.batch_size),
        "memory": memory_summary(obs),
        "training": prepare_arguments(obs.workload),  # best_config.md's prepare(...) call
    }


def _layer_row(obs: Observation, t) -> dict[str, Any]:
    """One timed layer for the report, with its forward FLOPs per rank at the job's batch."""
    graph, flops = obs.graph, None
    if graph is not None and t.name in graph.layers and graph.batch_size:
        flops = graph.layers[t.name].flops * obs.workload.batch_size / graph.batch_size
    return {
        "name": t.name,
        "label": graph.layer_label(t.name) if graph is not None else t.name,
        "kind": t.kind,
        "forward_s": t.forward_s,
        "backward_s": t.backward_s,
        "flops": flops,
    }


@dataclass
class _Planning:
    """What the tuners' diagnoses and plans add up to, tuner by tuner."""

    diagnoses: dict[str, Any] = field(default_factory=dict)
    plans: dict[str, Any] = field(default_factory=dict)
    pool: list[dict[str, Any]] = field(default_factory=list)
    searches: list[PlannedTrial] = field(default_factory=list)
    gains: dict[str, float] = field(default_factory=dict)
    problems: list[dict[str, Any]] = field(default_factory=list)
    """Tuners whose diagnose or plan failed (the report lists them, with the traceback)."""

    def keep(self, step: TunerStep, tuner: Tuner, s: AutoSettings) -> None:
        """What the schedule and the store need of one step of :func:`diagnose_and_plan`."""
        name = step.name
        if isinstance(step, TunerFailed):
            self.problems.append(step.to_dict())
            if step.diagnosis is not None:
                self.diagnoses[name] = asdict(step.diagnosis)
        elif isinstance(step, TunerDiagnosed):
            self.diagnoses[name] = asdict(step.diagnosis)
        elif isinstance(step, TunerPlanned):
            planned = list(zip(step.candidates, step.configs, strict=True))
            if s.in_job_search and type(tuner).search is not Tuner.search:
                # A search from the candidates its tuner marked, else from the defaults.
                starts: list[tuple[Candidate | None, TuningConfig]] = [
                    (c, cfg) for c, cfg in planned if c.search
                ]
                planned = [(c, cfg) for c, cfg in planned if not c.search]
                if not starts:
                    starts = [(None, TuningConfig({name: tuner.defaults()}))]
                self.searches += [
                    PlannedTrial(
                        SEARCH,
                        name,
                        cfg,
                        c.predicted_step_s if c is not None else None,
                        search={"plugin": name, "max_steps": s.search_steps},
                    )
                    for c, cfg in starts
                    if c is None or self._fits(c, s)
                ]
            self.plans[name] = [asdict(c) for c in step.candidates]
            self.pool += [
                {
                    "plugin": name,
                    "config": cfg.to_dict(),
                    "config_id": cfg.config_id,
                    "predicted_s": c.predicted_step_s,
                    "global_batch": c.global_batch,
                    "predicted_peak_bytes": c.predicted_peak_bytes,
                }
                for c, cfg in planned
            ]
            self.gains[name] = step.diagnosis.expected_gain or 0.0

    @staticmethod
    def _fits(c: Candidate, s: AutoSettings) -> bool:
        """Whether a search's starting point is predicted to fit ``--memory-cap``."""
        cap = s.memory_cap_bytes
        return cap is None or (c.predicted_peak_bytes or 0) <= cap


async def _diagnose_and_plan(
    run: _Run, store: Store, sid: int, obs: Observation, tuners, observation, child: WorkloadProcess
) -> AsyncIterator[Event]:
    """Every tuner's diagnose and plan, then the schedule they add up to, stored at once."""
    limit = run.s.plan_limit or max(run.s.trials or 8, 1)
    # Tuners time pieces of the model: their hooks run in the workload's process, under the
    # trial timeout; in two of them side by side where a trial's ranks would use two.
    got = _Planning()
    processes = diagnosing_processes(obs, run.s, len(tuners))
    async with contextlib.AsyncExitStack() as stack:
        children = [await stack.enter_async_context(child)]
        for i in range(2, processes + 1):
            log = run.s.store_dir / OBSERVE_LOG.replace(".log", f"-{i}.log")
            children.append(await stack.enter_async_context(WorkloadProcess(log, run.s.timeout_s)))
            await children[-1].start()  # torch imports there while the first tuner runs here
        within = f"diagnose and plan: {len(children)} workload processes side by side"
        if len(children) == 1:
            steps = diagnose_and_plan(tuners, ChildHooks(child, obs, run.timings), limit)
        else:
            hooks = [ChildHooks(c, obs, run.timings, part_of=within) for c in children]
            steps = diagnose_and_plan_side_by_side(tuners, hooks, limit)
        with run.timings.stage(within) if len(children) > 1 else contextlib.nullcontext() as whole:
            async for step in steps:
                got.keep(step, tuners[step.name], run.s)
                if isinstance(step, TunerFailed):
                    store.log_event(sid, "plugin_failed", step.to_dict())
                yield step.event()
            if whole is not None:  # the workload processes' CPU, tuner by tuner
                parts = [t for t in run.timings.stages if t.part_of == within]
                whole.cpu_s = sum(t.cpu_s or 0.0 for t in parts)
    with run.timings.stage("plan: schedule the trials"):
        for ev in _schedule(run, store, sid, obs, observation, got):
            yield ev


def diagnosing_processes(obs: Observation, s: AutoSettings, tuners: int) -> int:
    """Workload processes the tuners' hooks share: two where the job computes on CPU ranks of
    a thread or more each and this machine holds two of them (a tuner times pieces of the model
    at a rank's threads, so two side by side load the cores as two ranks of a trial do), else
    one. Not on GPUs: two processes timing on one GPU would skew each other."""
    if obs.device_type != "cpu" or tuners < 2:
        return 1
    threads = rank_threads(s.launch.nproc * s.launch.loopback_nodes, s.launch.threads_per_rank)
    cores = psutil.cpu_count(logical=False) or 1
    return 2 if 2 * threads <= cores else 1


def _schedule(
    run: _Run, store: Store, sid: int, obs: Observation, observation, got: _Planning
) -> Iterator[Event]:
    """The trials the tuners' plans add up to, stored at once with the plans."""
    diagnoses, plans, pool, searches, gains = (
        got.diagnoses,
        got.plans,
        got.pool,
        got.searches,
        got.gains,
    )
    searches.sort(key=lambda t: -gains[_tuner_of(t)])
    cap = run.s.memory_cap_bytes
    over = [e for e in pool if cap is not None and (e.get("predicted_peak_bytes") or 0) > cap]
    if over:
        from tunekit.memory import format_bytes

        pool = [e for e in pool if e not in over]
        observation["over_cap"] = over
        yield Notice(
            f"{len(over)} planned candidate(s) not scheduled: predicted to peak over the "
            f"--memory-cap of {format_bytes(cap)} per rank"
        )
    if run.s.rerank:
        # The first candidates: every tuner's best, then the best predicted (no trials yet
        # to correct the predictions); after each trial `_feedback` re-ranks what is left.
        slots = None if run.s.trials is None else max(0, run.s.trials - len(searches))
        assert obs.baseline is not None  # planned after the measured baseline
        ranked = rank_pool(
            (PoolEntry(**e) for e in pool), Corrector(obs.baseline.median_s), obs.global_batch
        )
        chosen, dropped = choose_next(
            ranked,
            {_tuner_of(t) for t in searches},
            len(pool) if slots is None else slots,
            run.s.min_effect,
            by_gain=run.s.budget_s is not None,
        )
        if dropped:
            observation["dropped"] = [
                {
                    "plugin": r.entry.plugin,
                    "config": r.entry.config,
                    "predicted_s": r.entry.predicted_s,
                }
                for r in dropped
            ]
            yield Notice(
                f"{len(dropped)} planned candidate(s) not scheduled: predicted slower than the baseline "
                f"by more than --min-effect {run.s.min_effect:g} (--no-rerank tries them anyway)"
            )
        queue = searches + [
            PlannedTrial(
                CANDIDATE,
                r.entry.plugin,
                TuningConfig.from_dict(r.entry.config),
                r.entry.predicted_s,
                corrected_s=r.corrected_s,
            )
            for r in chosen
        ]
        planned = schedule({"all": queue}, run.s.trials, run.s.baseline_every)
    else:  # every tuner's plan in its own order, round-robin by expected gain
        queues: dict[str, list[PlannedTrial]] = {_tuner_of(t): [t] for t in searches}
        for e in pool:
            queues.setdefault(e["plugin"], []).append(
                PlannedTrial(
                    CANDIDATE,
                    e["plugin"],
                    TuningConfig.from_dict(e["config"]),
                    e["predicted_s"],
                    corrected_s=e["predicted_s"],
                )
            )
        planned = schedule(
            dict(sorted(queues.items(), key=lambda kv: -gains.get(kv[0], 0.0))),
            run.s.trials,
            run.s.baseline_every,
        )
    # After the baseline (and anything run of a part-written plan an older tunekit left).
    first = max(t.seq for t in store.trials(sid) if t.done or t.seq == 0) + 1
    rows = [
        {
            "seq": seq,
            "role": pt.role,
            "plugin": pt.plugin,
            "config_id": pt.config.config_id,
            "config": {**pt.config.to_dict(), **({"search": pt.search} if pt.search else {})},
            "predicted_s": pt.predicted_s,
            "corrected_s": pt.corrected_s,
        }
        for seq, pt in enumerate(planned, start=first)
    ]
    observation.update(diagnoses=diagnoses, plans=plans, pool=pool, truth=_truth_dict(obs))
    observation["problems"] = observation.get("problems", []) + got.problems
    store.add_trials(
        sid, rows, observation=observation, drop_pending=True
    )  # the schedule and its reasons, at once


def _load_problem(rec: PluginRecord) -> dict[str, Any]:
    """A plugin that did not load, as the report lists it beside tuners whose hooks failed."""
    return {
        "plugin": rec.name,
        "what": f"{rec.status} ({rec.package})",
        "error": rec.error,
        "where": "",
        "traceback": rec.traceback,
    }


def _truth_dict(obs: Observation) -> dict[str, Any] | None:
    truth = obs.truth
    return truth.to_dict() if truth is not None else None


def _feedback(
    store: Store, sid: int, min_effect: float, rerank: bool = True, budget: bool = False
) -> Reranked | None:
    """Refit every tuner's correction from the trials so far; re-rank the candidates left to run
    (with ``rerank`` off, only their corrected predictions are updated).

    Returns what changed, or None when nothing is left to re-rank.
    """
    study = store.study(sid)
    observation = study.observation or {}
    pool = [PoolEntry(**e) for e in observation.get("pool", [])]
    trials = store.trials(sid)
    pending = [t for t in trials if t.role == CANDIDATE and t.status == "pending"]
    base = [t.median_s for t in trials if t.role == BASELINE and t.status == "ok" and t.median_s]
    if not pool or not base:
        return None
    corrector = Corrector(statistics.median(base), outcomes_of(trials))
    observation["corrections"] = corrector.summary()
    store.set_study(sid, observation=observation)
    if not pending:
        return None
    if not rerank:
        for t in pending:
            store.set_corrected(t.id, corrector.corrected(t.plugin, t.predicted_s))
        return None
    not_pending = {
        t.config_id for t in trials if not (t.role == CANDIDATE and t.status == "pending")
    }
    tried = {
        _tuner_of(t)
        for t in trials
        if t.role in (CANDIDATE, SEARCH, CONFIRM) and t.status != "pending"
    }
    base_batch = (observation.get("summary") or {}).get("global_batch") or 1
    ranked = rank_pool((e for e in pool if e.config_id not in not_pending), corrector, base_batch)
    chosen, dropped = choose_next(ranked, tried, len(pending), min_effect, by_gain=budget)
    store.replace_pending_candidates(
        sid,
        [
            {
                "plugin": r.entry.plugin,
                "config_id": r.entry.config_id,
                "config": r.entry.config,
                "predicted_s": r.entry.predicted_s,
                "corrected_s": r.corrected_s,
            }
            for r in chosen
        ],
    )

    def row(r) -> dict[str, Any]:
        return {
            "plugin": r.entry.plugin,
            "config": r.entry.config,
            "predicted_s": r.entry.predicted_s,
            "corrected_s": r.corrected_s,
        }

    return Reranked(corrector.summary(), [row(r) for r in chosen], [row(r) for r in dropped])


async def _combine_winners(
    run: _Run, store: Store, sid: int, spec: str, tuners
) -> AsyncIterator[Event]:
    """Try the winners of different aspects together once; or, where one tuner's winner
    changes the batch, that winner with the best config of another aspect (``batch_partner``).

    A gradient-sync setting that gains nothing at the job's batch can pay at a larger one
    (the compute it overlaps grows with the batch, the gradients do not): judged at the
    baseline's batch only, it would never meet the batch it pays at."""
    trials = store.trials(sid)
    if any(t.role == COMBINED for t in trials):
        return
    decision = decide(trials, run.s.min_effect)
    best: dict[str, dict[str, Any]] = {}
    used: set[str] = set()  # tuners whose knobs a winner already sets
    for row in sorted(
        (r for r in decision["candidates"] if r.get("comparison", {}).get("significant")),
        key=lambda r: -r["comparison"]["speedup"],
    ):
        tuner = tuners.get(row["plugin"])
        knobs_of = set(row["config"].get("plugins", {}))  # more than one: a combined candidate
        if tuner is not None and str(tuner.aspect) not in best and not knobs_of & used:
            best[str(tuner.aspect)] = row
            used |= knobs_of
    parts = [TuningConfig.from_dict(row["config"]) for row in best.values()]
    if len(best) < 2:
        leader = max(best.values(), key=lambda r: r["comparison"]["speedup"], default=None)
        observation = store.study(sid).observation or {}
        partner = batch_partner(
            leader, decision, observation.get("pool", []), tuners, run.s.min_effect
        )
        if partner is None:
            return
        parts.append(TuningConfig.from_dict(partner))
    merged = TuningConfig()
    for part in parts:
        merged = merged.merged(part)
    try:
        resolve(merged, tuners)
    except ConfigError as exc:
        yield Notice(f"winners cannot be combined: {exc}")
        return
    over = combined_over_cap(trials, [p.config_id for p in parts], run.s)
    if over:
        yield Notice(f"winners not combined: {over}")
        return
    seq = max(t.seq for t in trials) + 1
    store.add_trials(
        sid,
        [  # a combined run and its baseline, or neither
            {
                "seq": seq,
                "role": COMBINED,
                "plugin": "+".join(sorted(merged.plugins)),
                "config_id": merged.config_id,
                "config": merged.to_dict(),
            },
            {
                "seq": seq + 1,
                "role": BASELINE,
                "config_id": TuningConfig().config_id,
                "config": TuningConfig().to_dict(),
            },
        ],
    )
    async for ev in _run_pending(run, store, sid, spec, tuners):
        yield ev


def batch_partner(
    leader: dict[str, Any] | None,
    decision: dict[str, Any],
    pool: list[dict[str, Any]],
    tuners: Mapping[str, Tuner],
    min_effect: float,
) -> dict[str, Any] | None:
    """For a winner that changes the batch (``leader``, a row of ``decide``): the config of
    another aspect most worth trying beside it, or None.

    The best of those tried, by their own trials' speed-up (any not clearly slower than the
    baseline); none tried, the best predicted (any not predicted slower by ``min_effect``).
    Placements are left out: they replace the step the batch runs in; so is a config that
    cannot run beside the winner (a gradient strategy next to a winner whose layout shards
    with FSDP, planned by the sharding tuner with the batch as one candidate).
    """
    if leader is None or leader.get("global_batch") == decision.get("baseline_global_batch"):
        return None
    taken = {tuners[n].aspect for n in leader["config"].get("plugins", {}) if n in tuners}
    if Aspect.BATCH not in taken:
        return None
    leading = TuningConfig.from_dict(leader["config"])

    def other(plugin: str, config: dict[str, Any]) -> bool:
        t = tuners.get(plugin)
        if t is None or t.aspect in taken | {Aspect.PLACEMENT} or t.excludes & taken:
            return False
        try:
            resolve(leading.merged(TuningConfig.from_dict(config)), tuners)
        except ConfigError:
            return False
        return True

    tried = [
        (r["comparison"]["speedup"], r["config"])
        for r in decision.get("candidates", [])
        if r.get("comparison")
        and r["comparison"]["ci_high"] >= 1.0
        and other(r["plugin"] or "", r["config"])
    ]
    base = decision.get("baseline_median_s")
    predicted = [
        (base / e["predicted_s"], e["config"])  # the same batch: per step is per sample
        for e in pool
        if e.get("predicted_s")
        and base
        and not e.get("global_batch")
        and other(e["plugin"], e["config"])
    ]
    predicted = [sc for sc in predicted if sc[0] > 1 - min_effect]
    scored = tried or predicted
    return max(scored, key=lambda sc: sc[0])[1] if scored else None


MAX_CONFIRMATIONS = 2


async def _confirm_leader(
    run: _Run, store: Store, sid: int, spec: str, tuners
) -> AsyncIterator[Event]:
    """Run the leading candidate again, beside another baseline run, before crowning it.

    Repeats (up to ``MAX_CONFIRMATIONS``) while the leader has a single run:
    a confirmation can knock it out and promote another single-run candidate.
    """
    async for ev in _run_pending(run, store, sid, spec, tuners):  # resumed mid-confirmation
        yield ev
    while True:
        trials = store.trials(sid)
        if sum(t.role == CONFIRM for t in trials) >= MAX_CONFIRMATIONS:
            return
        leader = leader_to_confirm(
            decide(trials, run.s.min_effect, _describer(tuners)), run.s.min_effect
        )
        base = run.wall(TuningConfig().config_id, None, trials)
        if leader is None or not run.fits_budget(
            [run.wall(leader["config_id"], leader["predicted_s"], trials), base]
        ):
            return
        seq = max(t.seq for t in trials) + 1
        store.add_trials(
            sid,
            [  # a confirmation and its baseline, or neither
                {
                    "seq": seq,
                    "role": CONFIRM,
                    "plugin": leader["plugin"],
                    "config_id": leader["config_id"],
                    "config": leader["config"],
                    "predicted_s": leader["predicted_s"],
                },
                {
                    "seq": seq + 1,
                    "role": BASELINE,
                    "config_id": TuningConfig().config_id,
                    "config": TuningConfig().to_dict(),
                },
            ],
        )
        yield Notice(
            f"confirming the leader, {leader['description']}, with a second run beside the baseline"
        )
        async for ev in _run_pending(run, store, sid, spec, tuners):
            yield ev


async def _measure_more(
    run: _Run, store: Store, sid: int, spec: str, tuners
) -> AsyncIterator[Event]:
    """Where the decision is not yet clear (``still_unclear``), measure more where it decides:
    paired, interleaved rounds of the leader (and its rival, when the two cannot be told apart)
    beside the baseline, until it is clear or ``measure_rounds`` or the time budget is spent.
    What it came to goes into the decision (``_qualify``)."""
    s = run.s
    observation = store.study(sid).observation or {}
    rounds = int((observation.get("measured_more") or {}).get("rounds", 0))  # a resumed study's
    while True:
        trials = store.trials(sid)
        unclear = still_unclear(
            decide(trials, s.min_effect, _describer(tuners)), trials, s.min_effect
        )
        state: dict[str, Any] = {"rounds": rounds, "clear": unclear is None}
        if unclear is not None:
            state["why"] = unclear.why
            state["rival_only"] = unclear.rival_only
            state["spent"] = "round limit" if rounds >= s.measure_rounds else "time budget"
        walls = (
            [run.wall(r["config_id"], r["predicted_s"], trials) for r in unclear.rows]
            if unclear
            else []
        )
        walls.append(run.wall(TuningConfig().config_id, None, trials))
        if unclear is None or rounds >= s.measure_rounds or not run.fits_budget(walls):
            observation = store.study(sid).observation or {}
            observation["measured_more"] = state
            store.set_study(sid, observation=observation)
            return
        seq = max(t.seq for t in trials) + 1
        rows = [
            {
                "seq": seq + i,
                "role": CONFIRM,
                "plugin": r["plugin"],
                "config_id": r["config_id"],
                "config": r["config"],
                "predicted_s": r["predicted_s"],
            }
            for i, r in enumerate(unclear.rows)
        ]
        rows.append(
            {
                "seq": seq + len(rows),
                "role": BASELINE,
                "config_id": TuningConfig().config_id,
                "config": TuningConfig().to_dict(),
            }
        )
        rounds += 1
        observation = store.study(sid).observation or {}
        observation["measured_more"] = {"rounds": rounds, "clear": False, "why": unclear.why}
        store.add_trials(sid, rows, observation=observation)  # a round, or none of it
        names = " and ".join(r["description"] for r in unclear.rows)
        yield Notice(
            f"not clear yet ({unclear.why}): round {rounds}, {names} again beside the baseline"
        )
        async for ev in _run_pending(run, store, sid, spec, tuners):
            yield ev


PROFILE_STEPS = 3


def _tuner_of(trial: PlannedTrial | TrialRow) -> str:
    """The tuner a candidate, search or confirmation trial belongs to (baselines have none)."""
    assert trial.plugin is not None, trial
    return trial.plugin


def observed_baseline(row: TrialRow) -> tuple[Breakdown | None, TelemetrySummary | None]:
    """The baseline trial's step breakdown (from its traces) and telemetry summary."""
    result = row.result or {}
    breakdown = None
    trial_dir = Path(result.get("trial_dir", ""))
    if (trial_dir / "traces").is_dir():
        try:
            breakdown = analyze_trial(trial_dir)
        except (OSError, ValueError, KeyError) as exc:  # a broken trace must not stop the study
            result.setdefault("notices", []).append(f"could not analyse the baseline traces: {exc}")
    return breakdown, cast(TelemetrySummary | None, result.get("telemetry"))


async def _run_pending(
    run: _Run,
    store: Store,
    sid: int,
    spec: str,
    tuners,
    only_seq: int | None = None,
    observe: bool = False,
) -> AsyncIterator[Event]:
    s = run.s
    describe = _describer(tuners)

    def next_pending() -> TrialRow | None:
        # Read afresh each time: feedback after a trial may have re-ranked the rest.
        rows = [
            t for t in store.trials(sid) if not t.done and (only_seq is None or t.seq == only_seq)
        ]
        return rows[0] if rows else None

    while True:
        row = next_pending()
        if row is None:
            return
        # Trial i of n over the whole study (a confirmation adds to n), never per batch of trials.
        study_rows = store.trials(sid)
        index, total = sum(t.done for t in study_rows) + 1, len(study_rows)
        length = trial_length(row, store.trials(sid), s.warmup, s.steps, s.launch.timeout_s)
        fits = run.fits_budget(run.walls_for(row, study_rows))
        skip = BUDGET_SKIP if not fits else length.skip_reason
        if not skip and row.role == BASELINE and nothing_to_interleave(row, study_rows):
            skip = NOTHING_RAN
        if skip:
            store.finish_trial(
                row.id, status="skipped", error=skip, result={"length": length.to_dict()}
            )
            yield TrialFinished(
                row.id,
                row.seq,
                row.role,
                row.plugin,
                describe(row.config),
                "skipped",
                None,
                None,
                row.predicted_s,
                skip,
                row.corrected_s,
            )
            continue
        if length.shortened:
            yield Notice(f"trial {row.seq} {describe(row.config)}: {length.reason}")
        yield TrialStarted(
            row.id,
            row.seq,
            row.role,
            row.plugin,
            describe(row.config),
            row.predicted_s,
            index,
            total,
            row.corrected_s,
        )
        store.start_trial(row.id)
        spec_ = TrialSpec(
            workload=spec,
            config={k: v for k, v in row.config.items() if k != "search"},
            warmup=length.warmup,
            steps=length.steps,
            seed=s.seed,
            device=s.device,
            search=row.config.get("search"),
            profile_steps=PROFILE_STEPS if observe else 0,
            memory_cap_bytes=s.memory_cap_bytes,
            probe=run.probe if observe else None,
        )
        trial_dir = (s.store_dir / "trials" / f"study{sid}" / f"{row.seq:03d}-{row.role}").resolve()
        sampler = (
            TelemetrySampler(trial_dir / "pids", interval_s=0.5, pyspy_interval_s=2.0)
            if observe
            else None
        )
        if sampler is not None:
            shutil.rmtree(trial_dir / "pids", ignore_errors=True)
            sampler.start()

        def progress(p: dict[str, Any], trial_id=row.id) -> None:
            run.queue.put_nowait(
                TrialProgress(trial_id, p["phase"], p["index"], p["total"], p.get("step_s"))
            )

        started, cpu = time.monotonic(), own_cpu_s()
        task = asyncio.create_task(run_trial(spec_, s.launch, trial_dir, progress, run.nodes))
        while not task.done():
            try:
                yield await asyncio.wait_for(run.queue.get(), timeout=0.2)
            except TimeoutError:
                pass
        while not run.queue.empty():
            yield run.queue.get_nowait()
        if sampler is not None:
            sampler.stop()
            for notice in sampler.notices:
                yield Notice(notice)
        outcome: TrialOutcome = task.result()
        if spec_.probe and outcome.ok and "all_reduce" in (outcome.ranks[0].get("probe") or {}):
            first = outcome.ranks[0]["probe"]
            run.probed = probe_result(
                first, s.launch.world_size, resolve_device_type(s.device), first["wall_s"]
            )
        run.timings.add(
            f"trial {row.seq} {row.role}",
            time.monotonic() - started,
            own_cpu_s() - cpu,
            describe(row.config),
        )
        if run.nodes is not None and (lost := run.nodes.lost()):
            # Not the config's fault: the trial stays unfinished and runs again on --resume.
            why = "; ".join(lost.values())
            store.log_event(sid, "node_lost", {"seq": row.seq, "nodes": sorted(lost), "why": why})
            yield TrialFinished(
                row.id,
                row.seq,
                row.role,
                row.plugin,
                describe(row.config),
                outcome.status,
                None,
                None,
                row.predicted_s,
                why,
                row.corrected_s,
            )
            raise NodesError(
                f"{why}; the study is saved: start that node's follower again and continue "
                "with --resume"
            )
        for out in outcome.output:
            if out["dropped_bytes"]:
                yield Notice(
                    f"trial {row.seq} printed too much to keep: {OutputRecord(**out).describe()}"
                )
        result = {**_trial_result(outcome), "length": length.to_dict()}
        if sampler is not None:
            result["telemetry"] = sampler.summary()
            if run.nodes is not None:  # every follower's own, sent with its files
                result["telemetry_nodes"] = _node_telemetry(trial_dir, run.nodes.followers)
        m = outcome.measurement
        config_desc = describe(row.config)
        if outcome.search and outcome.ok:
            # The search settled on knobs and measured them: record what ran.
            row_cfg = found_config(outcome.ranks[0].get("config") or row.config, tuners)
            config_desc = describe(row_cfg) + " (found in-job)"
            result["config_found"] = row_cfg
        store.finish_trial(
            row.id,
            status=outcome.status,
            median_s=m.median_s if m else None,
            spread_s=m.spread_s if m else None,
            samples_per_s=m.samples_per_s if m else None,
            result=result,
            error=outcome.error or None,
        )
        if outcome.search and outcome.ok:
            _record_search_config(store, row.id, result["config_found"])
        peaks = predicted_peaks(store.study(sid).observation or {})
        yield TrialFinished(
            row.id,
            row.seq,
            row.role,
            row.plugin,
            config_desc,
            outcome.status,
            m.median_s if m else None,
            m.spread_s if m else None,
            row.predicted_s,
            outcome.error or None,
            row.corrected_s,
            samples_per_s=m.samples_per_s if m else None,
            predicted_peak_bytes=peaks.get(row.config_id)
            or (peaks.get(f"search:{row.plugin}") if row.role == SEARCH else None),
            peak_bytes=measured_peak(result),
        )
        if row.role != BASELINE:
            reranked = _feedback(store, sid, s.min_effect, s.rerank, s.budget_s is not None)
            if reranked is not None:
                yield reranked


def found_config(config: dict[str, Any], tuners: Mapping[str, Tuner]) -> dict[str, Any]:
    """The config an in-job search settled on; the baseline's (empty) config where it kept
    every knob at its default: then it found nothing to change, and no decision weighs it
    against the baseline as if it were a candidate."""
    cfg = TuningConfig.from_dict(config)
    for name, knobs in cfg.plugins.items():
        tuner = tuners.get(name)
        if tuner is None or tuner.validate(knobs) != tuner.defaults():
            return config
    return TuningConfig().to_dict()


def nothing_to_interleave(row: TrialRow, rows: list[TrialRow]) -> bool:
    """Whether a baseline run would follow another baseline run with nothing measured between
    (the candidates planned between them all skipped, for time, or failed: crashed, hung, out
    of memory): it would only spend time."""
    before = [
        t
        for t in rows
        if t.seq < row.seq
        and ((t.role == BASELINE and t.status != "skipped") or (t.result or {}).get("measurement"))
    ]
    return bool(before) and max(before, key=lambda t: t.seq).role == BASELINE


def _record_search_config(store: Store, trial_id: int, config: dict[str, Any]) -> None:
    """A search trial measured the config it found: store that as the trial's config."""
    cfg = TuningConfig.from_dict(config)
    store.set_trial_config(trial_id, cfg.config_id, cfg.to_dict())


def _trial_result(outcome: TrialOutcome) -> dict[str, Any]:
    """What the store keeps of a trial: the measurement and per-rank summaries."""
    ranks = []
    for r in outcome.ranks:
        metrics = [m for m in r.get("metrics", []) if m]
        rs = [m.get("overlap_R") for m in metrics if m.get("overlap_R") is not None]
        ranks.append(
            {
                "rank": r.get("rank"),
                "status": r.get("status"),
                "step_s": r.get("step_s"),
                "loss": r.get("loss"),
                "data_s": r.get("data_s"),
                "peak_memory_bytes": r.get("peak_memory_bytes"),
                "peak_bytes": r.get("peak_bytes"),
                "memory_method": r.get("memory_method"),
                "batch_size": r.get("batch_size"),
                "global_batch": r.get("global_batch"),
                "overlap_R": sum(rs) / len(rs) if rs else None,
            }
        )
    return {
        "measurement": outcome.measurement.to_dict() if outcome.measurement else None,
        "ranks": ranks,
        "wall_s": outcome.wall_s,
        "trial_dir": outcome.trial_dir,
        "search": outcome.search,
        "startup_s": outcome.startup_s,
        "output": outcome.output,
    }
