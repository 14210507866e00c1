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
    trials_table,
)
from tunekit.config import TuningConfig
from tunekit.examples import DEFAULT_EXAMPLE
from tunekit.plugin_loading import load_all, select
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
    "--timeout",
    "timeout_s",
    type=DURATION,
    default=300.0,
    help="Limit on each step in the workload's process (observing it, the tuner's diagnose and plan); "
    "past it, a hang [default: 5m].",
)
@STORE_OPTION
@MEMORY_CAP_OPTION
def plan_cmd(
    plugin, workload, nproc, hardware, limit, out_dir, as_json, store_dir, timeout_s, memory_cap
):
    """Print PLUGIN's diagnosis and ranked candidates for WORKLOAD with predicted step times.

    Runs no trials. A baseline measured by an earlier `tunekit auto` with the
    same settings is used when the store has one. Each candidate comes with a
    command that applies it to a live run (`tunekit apply RUN PLUGIN.knob=value …`);
    a config too long for a command line is written to --out and named by its path.

    The workload is observed, and the tuner diagnoses and plans, in a process of its own
    (as in `tunekit auto`): a workload that crashes, hangs or exits there fails in one line.
    """
    resolve_spec(workload)  # a missing file: one line now, not after torch has loaded
    records = load_all()
    tuner = select(records, [plugin])[plugin]
    from tunekit.report import report_data
    from tunekit.trials.launcher import LaunchOptions

    store = Store.open_default(store_dir)
    try:
        static, study, obs, diag, candidates = asyncio.run(
            _observe_and_plan(
                tuner, workload, nproc, hardware, limit, store, store_dir, timeout_s, memory_cap
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
                    "summary": diag.summary,
                    "expected_gain": diag.expected_gain,
                    "baseline_step_s": truth.step_s if truth is not None else None,
                    "candidates": [
                        {**r, "config": r["config"].to_dict(), "apply": f"tunekit apply RUN {a}"}
                        for r, a in zip(rows, apply_args, strict=True)
                    ],
                },
                indent=2,
                default=str,
            )
        )
        return
    console.print(
        f"[bold]{tuner.name}[/] — {tuner.title} · {static.spec} on {nproc} × {static.hardware.name}"
    )
    if truth is None:
        console.print(
            "[dim]no measured baseline in the store for these settings (run `tunekit auto` first); "
            "predictions use the model alone[/]"
        )
    else:
        console.print(f"measured baseline (study {study.id}): {truth.describe()}")
    from tunekit.cli.auto import memory_line
    from tunekit.orchestrator import memory_summary

    if line := memory_line(memory_summary(obs)):
        console.print(line)
    console.print(
        ("[green]applies[/]: " if diag.applies else "[yellow]does not apply[/]: ") + diag.summary
    )
    if not rows:
        return
    table = Table(
        title="candidates, fastest predicted first (samples/s: time per sample, whatever the batch)",
        title_justify="left",
    )
    for col in ("#", "config", "predicted step", "samples/s", "why"):
        table.add_column(col)
    for i, r in enumerate(rows, 1):
        table.add_row(
            str(i),
            r["description"],
            _ms(r["predicted_step_s"]),
            _rate(r["predicted_samples_per_s"]),
            r["rationale"],
        )
    console.print(table)
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
    memory_cap: int | None = None,
):
    """The workload observed and the tuner's diagnose (and plan, where it applies) run in one
    process of the workload's own; returns what was observed, the stored study, the diagnosis
    and the candidates. A tuner that fails is one line (PluginError)."""
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
        async for step in diagnose_and_plan({tuner.name: tuner}, ChildHooks(child, obs), limit):
            if isinstance(step, TunerFailed):
                raise PluginError(f"{tuner.name}'s {step.hook} failed: {step.problem}")
            diag = step.diagnosis
            if isinstance(step, TunerPlanned):
                candidates = step.candidates
    return static, study, obs, diag, candidates


def _stored_baseline(
    store: Store, static, nproc: int, hardware: str | None, memory_cap: int | None = None
):
    """The newest study with the same model, hardware and settings, and its first successful
    baseline trial (None, None when there is none)."""
    from tunekit.orchestrator import AutoSettings, study_key_of

    settings = AutoSettings(
        workload=static.spec, nproc=nproc, hardware=hardware, memory_cap_bytes=memory_cap
    )
    key = study_key_of(static, settings)
    study = store.latest_study(key)
    if study is None:
        return None, None
    for t in store.trials(study.id):
        if t.role == "baseline" and t.status == "ok" and t.result and t.result.get("measurement"):
            return study, t
    return None, None
