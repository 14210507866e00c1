"""``tunekit plan PLUGIN WORKLOAD``: a tuner's diagnosis and ranked candidates, no trials."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import click

from tunekit.cli.common import (
    DURATION,
    MEMORY_CAP_OPTION,
    STORE_OPTION,
    Table,
    console,
    marked_headline,
    styled,
    trials_table,
)
from tunekit.config import TuningConfig
from tunekit.diagnosis_text import body_points, headline_of
from tunekit.examples import DEFAULT_EXAMPLE
from tunekit.plugin_loading import check_installed, load_all, select
from tunekit.store import Store
from tunekit.workload_spec import resolve_spec


@click.command("plan")
@click.argument("plugin")
@click.argument("workload", default=f"example:{DEFAULT_EXAMPLE}")
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Ranks (devices) to plan for.",
)
@click.option(
    "--hardware",
    default=None,
    help="Plan for a hardware profile (name or TOML) instead of this machine.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=10, show_default=True, help="Candidates to show."
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tunekit-out"),
    show_default=True,
    help="Where configs too long for one command line are written.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis and candidates as JSON.")
@click.option(
    "--always-plan",
    is_flag=True,
    help="Plan even when the diagnosis does not apply; such candidates are marked "
    "'not applying' (`tunekit auto` never tries them).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=DURATION,
    default=300.0,
    help="Limit on each step in the workload's process (observing it, the tuner's diagnose and plan); "
    "past it, a hang [default: 5m].",
)
@click.option(
    "-v",
    "--explain",
    is_flag=True,
    help="Print the diagnosis in full (its points, after its headline).",
)
@STORE_OPTION
@MEMORY_CAP_OPTION
def plan_cmd(
    plugin,
    workload,
    nproc,
    hardware,
    limit,
    out_dir,
    as_json,
    always_plan,
    explain,
    store_dir,
    timeout_s,
    memory_cap,
):
    """Print PLUGIN's diagnosis and ranked candidates for WORKLOAD with predicted step times.

    Runs no trials. Predictions are calibrated on the latest baseline an earlier
    `tunekit auto` measured for this model on this machine with as many ranks (and the
    same --memory-cap), whatever its --steps/--warmup (the output says which study); without one, every
    figure is the tuner's model alone and is marked uncalibrated. Each candidate comes with a
    command that applies it to a live run (`tunekit apply RUN PLUGIN.knob=value …`);
    a config too long for a command line is written to --out and named by its path.

    The workload is observed, and the tuner diagnoses and plans, in a process of its own
    (as in `tunekit auto`): a workload that crashes, hangs or exits there fails in one line.
    """
    resolve_spec(workload)  # a missing file: one line now, not after torch has loaded
    check_installed([plugin])
    records = load_all()
    tuner = select(records, [plugin])[plugin]
    from tunekit.report import report_data
    from tunekit.trials.launcher import LaunchOptions

    store = Store.open_default(store_dir)
    try:
        static, study, base_row, obs, diag, candidates = asyncio.run(
            _observe_and_plan(
                tuner,
                workload,
                nproc,
                hardware,
                limit,
                store,
                store_dir,
                timeout_s,
                always_plan,
                memory_cap,
            )
        )
        tried = []
        truth = obs.truth
        if study is not None:
            tuners = {r.name: r.tuner for r in records if r.ok}
            rows = report_data(store, study.id, tuners, LaunchOptions(nproc=nproc))["trials"]
            tried = [t for t in rows if t["plugin"] == tuner.name]
    finally:
        store.close()
    rows = ranked_candidates(tuner, candidates, obs.global_batch)
    status = "applying" if diag.applies else "not applying"
    apply_args = [
        _apply_args(r["config"], tuner.defaults(), out_dir / "plan" / f"{tuner.name}-{i}.json")
        for i, r in enumerate(rows, 1)
    ]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "plugin": tuner.name,
                    "workload": static.spec,
                    "nproc": nproc,
                    "hardware": static.hardware.name,
                    "applies": diag.applies,
                    "headline": headline_of(diag),
                    "summary": diag.summary,
                    "points": body_points(diag.summary),
                    "expected_gain": diag.expected_gain,
                    "baseline_step_s": truth.step_s if truth is not None else None,
                    "baseline": baseline_source(study, base_row) if base_row else None,
                    "calibrated": truth is not None,
                    "candidates": [
                        {
                            **r,
                            "config": r["config"].to_dict(),
                            "apply": f"tunekit apply RUN {a}",
                            "status": status,
                        }
                        for r, a in zip(rows, apply_args, strict=True)
                    ],
                },
                indent=2,
                default=str,
            )
        )
        return
    console.print(
        styled(
            "[bold]{}[/] — {} · {} on {} × {}",
            tuner.name,
            tuner.title,
            static.spec,
            nproc,
            static.hardware.name,
        )
    )
    if truth is None:
        console.print(
            styled(
                "[yellow]no measured baseline[/] in the store for this model on this hardware with "
                "{} rank(s) (run `tunekit auto` first): every figure below is the tuner's model "
                "alone, [bold]uncalibrated[/], and may be far from a real step",
                nproc,
            )
        )
    else:
        console.print(f"measured baseline ({baseline_source(study, base_row)}): {truth.describe()}")
    from tunekit.cli.auto import memory_line
    from tunekit.orchestrator import memory_summary

    if line := memory_line(memory_summary(obs)):
        console.print(line)
    console.print(marked_headline(headline_of(diag), diag.applies, muted="yellow"))
    if explain:
        for point in body_points(diag.summary):
            console.print(styled("  [dim]·[/] {}", point))
    if not rows:
        return
    console.print(candidates_table(rows, calibrated=truth is not None, applies=diag.applies))
    console.print(
        "apply one to a live run (`tunekit run`); `tunekit trial` takes the same arguments:"
    )
    for i, a in enumerate(apply_args, 1):
        console.print(f"  #{i}  tunekit apply RUN {a}", soft_wrap=True)
    if tried:
        console.print(trials_table(tried, title=f"{tuner.name}'s trials in study {study.id}"))
    text = tuner.explain(candidates[0])
    if text:
        # As written (Markdown source): rich's Markdown tables end cells in "…" when the
        # terminal is narrow, and a figure a user reads is never cut (issue 19).
        console.print("Best candidate in detail", style="bold")
        console.print(text, markup=False, soft_wrap=True)


LONGEST_COMMAND_ARGS = 160
"""Past this many characters, a candidate's PLUGIN.knob=value pairs go to a file instead."""


def ranked_candidates(tuner, candidates, base_batch: int) -> list[dict]:
    """Candidates with their full config, fastest predicted per sample first (a tuner's own
    order is kept among equals, and for candidates without a prediction, which come last)."""
    defaults = {tuner.name: tuner.defaults()}
    rows = []
    for c in candidates:
        cfg = TuningConfig({tuner.name: tuner.validate(c.knobs)})
        batch = c.global_batch or base_batch
        rate = batch / c.predicted_step_s if c.predicted_step_s and batch else None
        rows.append(
            {
                "config": cfg,
                "description": cfg.describe(defaults),
                "predicted_step_s": c.predicted_step_s,
                "global_batch": batch,
                "predicted_samples_per_s": rate,
                "predicted_peak_bytes": c.predicted_peak_bytes,
                "rationale": c.rationale,
            }
        )
    return sorted(rows, key=lambda r: -(r["predicted_samples_per_s"] or 0.0))


def _apply_args(config: TuningConfig, defaults: dict, path: Path) -> str:
    """What follows ``tunekit apply RUN``: the knobs off their defaults as shell-quoted pairs
    (the job fills in the rest), or the path of a file with the whole config."""
    changed = TuningConfig(
        {
            name: {k: v for k, v in knobs.items() if defaults.get(k, object()) != v} or knobs
            for name, knobs in config.plugins.items()
        }
    )
    pairs = " ".join(shlex.quote(p) for p in changed.to_pairs())
    if len(pairs) <= LONGEST_COMMAND_ARGS:
        return pairs
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return shlex.quote(str(path))


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f} ms"


def _rate(x: float | None) -> str:
    return "—" if x is None else f"{x:,.1f}"


async def _observe_and_plan(
    tuner,
    workload: str,
    nproc: int,
    hardware: str | None,
    limit: int,
    store: Store,
    store_dir: Path,
    timeout_s: float,
    always_plan: bool = False,
    memory_cap: int | None = None,
):
    """The workload observed and the tuner's diagnose (and plan, where it applies or
    ``always_plan``) run in one process of the workload's own; returns what was observed, the
    stored study, the diagnosis and the candidates. A tuner that fails is one line
    (PluginError) saying where in the plugin it raised; the traceback is in observe.log."""
    from tunekit.errors import PluginError
    from tunekit.observe.observation import Measurement
    from tunekit.observe.static import observe_in_child
    from tunekit.observe.workload_process import OBSERVE_LOG, ObservationFailed, WorkloadProcess
    from tunekit.orchestrator import check_memory_cap, observed_baseline, peak_of
    from tunekit.planning import ChildHooks, TunerFailed, TunerPlanned, diagnose_and_plan

    async with WorkloadProcess(store_dir / OBSERVE_LOG, timeout_s) as child:
        try:
            static = await observe_in_child(
                workload,
                nproc,
                "auto",
                hardware,
                store,
                timeout_s=timeout_s,
                log_dir=store_dir,
                child=child,
            )
        except ObservationFailed as exc:
            raise ObservationFailed(
                exc.status, f"could not observe {workload} ({exc.status}): {exc}"
            ) from None
        check_memory_cap(memory_cap, static, nproc)
        study, base_row = _stored_baseline(store, static, nproc, hardware, memory_cap)
        baseline = Measurement(**base_row.result["measurement"]) if base_row else None
        obs = static.observation(
            nproc,
            baseline,
            store,
            memory_cap_bytes=memory_cap,
            baseline_peak_bytes=peak_of(base_row) if base_row else None,
        )
        if base_row is not None:
            obs.breakdown, obs.telemetry = observed_baseline(base_row)
        diag, candidates = None, []
        hooks = ChildHooks(child, obs)
        async for step in diagnose_and_plan({tuner.name: tuner}, hooks, limit, always_plan):
            if isinstance(step, TunerFailed):
                where = f" (at {step.where}; traceback in {child.log_path})" if step.where else ""
                raise PluginError(f"{tuner.name}'s {step.hook} failed: {step.problem}{where}")
            diag = step.diagnosis
            if isinstance(step, TunerPlanned):
                candidates = step.candidates
    return static, study, base_row, obs, diag, candidates


SAME_JOB = ("nproc", "world_size", "hardware", "memory_cap_bytes", "layout")
"""Study settings a baseline must share to be this job's (the model and the machine are in
the graph hash and the hardware fingerprint; a layout other than plain DDP and a memory cap
change the job). Steps, warm-up, seed and tuners change how a study measured, not what: a
baseline of another ``--steps`` is still this job's step."""


def _stored_baseline(
    store: Store, static, nproc: int, hardware: str | None, memory_cap: int | None = None
):
    """The newest study of this model on this hardware with as many ranks, the same layout and
    memory cap, whatever its ``--steps``/``--warmup``, and its latest successful baseline trial
    that was profiled (its step breakdown comes with it; a study profiles its first), else its
    latest. (None, None) when there is none."""
    from tunekit.orchestrator import AutoSettings, job_settings

    want = job_settings(
        static,
        AutoSettings(
            workload=static.spec, nproc=nproc, hardware=hardware, memory_cap_bytes=memory_cap
        ),
    )
    fingerprint = static.hardware.fingerprint()
    for study in reversed(store.studies()):
        if study.graph_hash != static.graph_hash or study.hw_fingerprint != fingerprint:
            continue
        if any(study.settings.get(k) != want.get(k) for k in SAME_JOB):
            continue
        baselines = [
            t
            for t in store.trials(study.id)
            if t.role == "baseline" and t.status == "ok" and (t.result or {}).get("measurement")
        ]
        profiled = [t for t in baselines if _profiled(t)]
        if baselines:
            return study, (profiled or baselines)[-1]
    return None, None


def _profiled(trial) -> bool:
    where = (trial.result or {}).get("trial_dir")
    return isinstance(where, str) and bool(where) and (Path(where) / "traces").is_dir()


def baseline_source(study, row) -> str:
    """Which measurement the figures are calibrated on: its study, trial and how it was timed."""
    s = study.settings
    timed = f"--steps {s['steps']} --warmup {s['warmup']}" if "steps" in s else "its own settings"
    return f"study {study.id}, baseline trial #{row.seq}, measured with {timed}"


def candidates_table(rows: list[dict], calibrated: bool, applies: bool = True) -> Table:
    """The ranked candidates. Uncalibrated figures (no measured baseline: the tuner's model
    alone) say so in every column that shows one, so no column reads as a prediction; a
    plan shown although its diagnosis does not apply (``--always-plan``) says so too."""
    mark = "" if calibrated else "≈"
    title = (
        "candidates, fastest predicted first (samples/s: time per sample, whatever the batch)"
        if calibrated
        else "candidates by the tuner's model alone, UNCALIBRATED (no measured baseline; ≈: "
        "the model's own figure, not a prediction of this job's step)"
    )
    if not applies:
        title += " — not applying: the diagnosis says the tuner does not help"
    table = Table(title=title, title_justify="left")
    step_col = "predicted step" if calibrated else "model step (uncalibrated)"
    rate_col = "samples/s" if calibrated else "model samples/s (uncalibrated)"
    for col in ("#", "config", step_col, rate_col, "why"):
        table.add_column(col)
    for i, r in enumerate(rows, 1):
        step, rate = _ms(r["predicted_step_s"]), _rate(r["predicted_samples_per_s"])
        table.add_row(
            str(i),
            r["description"],
            step if step == "—" else mark + step,
            rate if rate == "—" else mark + rate,
            r["rationale"],
        )
    return table
