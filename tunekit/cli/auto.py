"""``tunekit auto``: the whole pipeline, headless, with progress bars and a report."""

from __future__ import annotations

import asyncio
import inspect
import json
import shlex
from pathlib import Path

import click
from click.core import ParameterSource
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from tunekit.cli.common import (
    DURATION,
    MEMORY_CAP_OPTION,
    STORE_OPTION,
    Interrupted,
    Table,
    console,
    ensure_writable,
    marked_headline,
    split_names,
    stops_on_sigterm,
    styled,
)
from tunekit.cli.follow import JOIN_TIMEOUT_OPTION, TOKEN_FILE_OPTION, node_options, run_follower
from tunekit.config import TuningConfig
from tunekit.diagnosis_text import body_points, headline_of, outcomes
from tunekit.events import (
    BUDGET_SKIP,
    NOTHING_RAN,
    Decided,
    Diagnosed,
    Notice,
    Observed,
    Planned,
    PluginProblem,
    ReportWritten,
    Reranked,
    StudyFinished,
    StudyStarted,
    TrialFinished,
    TrialProgress,
    TrialStarted,
)
from tunekit.examples import DEFAULT_EXAMPLE, examples_help
from tunekit.observe.truth import PART_LABELS
from tunekit.plugin_loading import check_installed
from tunekit.runtime.rundir import RunDir
from tunekit.timings import total
from tunekit.trials import warm_start
from tunekit.workload_spec import resolve_spec


@click.command("auto")
@click.argument("workload", required=False)
@click.option(
    "--nproc", type=click.IntRange(min=1), default=2, show_default=True, help="Ranks per node."
)
@click.option(
    "--plugins",
    "plugins",
    multiple=True,
    metavar="NAMES",
    help="Tuners to use (comma-separated; default: all).",
)
@click.option(
    "--trials",
    type=click.IntRange(min=0),
    default=None,
    help="Candidate trials to run [default: 3].",
)
@click.option(
    "--budget",
    type=DURATION,
    default=None,
    help="Time budget instead of a trial count (90s, 5m, 1h); time for confirming the leader is kept back.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tunekit-out"),
    show_default=True,
)
@STORE_OPTION
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the last unfinished study of this workload; finished trials are not re-run.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    default=16,
    show_default=True,
    help="Measured steps per trial.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Warm-up steps per trial.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=DURATION,
    default=300.0,
    help="Per-trial limit; past it the trial is too_slow (steps still finishing) or a hang [default: 5m].",
)
@click.option(
    "--stall",
    "stall_s",
    type=DURATION,
    default=60.0,
    help="A trial whose steps stop for this long (and 10x its slowest step) is a hang [default: 1m].",
)
@click.option(
    "--measure-rounds",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Paired rounds (the leader, and a rival it cannot be told from, beside the baseline) "
    "a decision not yet clear may add; 0: none.",
)
@click.option(
    "--min-effect",
    type=click.FloatRange(min=0, max=1),
    default=0.01,
    show_default=True,
    help="Smallest speed-up that counts, beyond noise.",
)
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
)
@click.option(
    "--hardware",
    default=None,
    help="Plan for a hardware profile (name or TOML) instead of this machine.",
)
@node_options
@click.option("--rdzv-id", default=None, help="Rendezvous id (several machines).")
@TOKEN_FILE_OPTION
@JOIN_TIMEOUT_OPTION
@click.option(
    "--loopback-nodes",
    type=click.IntRange(min=1),
    default=1,
    help="Run N torchrun agents here as N nodes.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print events as JSON lines instead of progress bars."
)
@click.option(
    "--apply",
    "apply_run",
    default=None,
    metavar="RUN",
    help="Apply the winner to this live run (tunekit run).",
)
@click.option(
    "--keep-running",
    is_flag=True,
    help="With --apply: let the run train while the trials measure (they share the machine).",
)
@click.option(
    "--no-probe",
    is_flag=True,
    help="Do not measure this machine's collectives when none are cached.",
)
@click.option(
    "--no-rerank",
    is_flag=True,
    help="Run the tuners' plans in their own order: no re-ranking by corrected predictions, nothing dropped.",
)
@click.option(
    "-v",
    "--explain",
    is_flag=True,
    help="Print each diagnosis in full (its points, after its headline), each plan, and where the time went.",
)
@click.option(
    "--search-steps",
    type=click.IntRange(min=4),
    default=60,
    show_default=True,
    help="Steps an in-job search may use.",
)
@MEMORY_CAP_OPTION
@stops_on_sigterm
def auto_cmd(
    workload,
    nproc,
    plugins,
    trials,
    budget,
    out_dir,
    store_dir,
    resume,
    steps,
    warmup,
    timeout_s,
    stall_s,
    measure_rounds,
    min_effect,
    device,
    hardware,
    nnodes,
    node_rank,
    rdzv_endpoint,
    rdzv_id,
    token_file,
    join_timeout_s,
    loopback_nodes,
    as_json,
    apply_run,
    keep_running,
    no_probe,
    no_rerank,
    explain,
    search_steps,
    memory_cap,
):
    """Tune WORKLOAD (path/file.py:fn, package.module:fn or example:NAME).

    Without WORKLOAD, the demo: example:cnn in about a minute (a 55 s budget), the
    tuners' best planned candidates tried (no in-job searches), 8 measured steps a trial.

    Measures a baseline, asks every tuner for a diagnosis and a plan, verifies
    the best candidates with short torchrun trials, and writes report.md,
    report.json, best_config.json, best_config.md and trials.png to --out.
    With --apply RUN, that live run is paused while the trials measure.
    """
    if trials is not None and budget is not None:
        raise click.UsageError("give --trials or --budget, not both")
    demo = workload is None
    if demo:  # what the user left at its default takes the demo's value
        workload = f"example:{DEFAULT_EXAMPLE}"
        given = click.get_current_context().get_parameter_source
        if trials is None and budget is None:
            budget = DEMO_BUDGET_S
        if given("steps") is ParameterSource.DEFAULT:
            steps = DEMO_STEPS
        if given("warmup") is ParameterSource.DEFAULT:
            warmup = DEMO_WARMUP
    from tunekit.trials.nodes import node_place, read_token

    place = node_place(nnodes, node_rank, rdzv_endpoint)
    if place.nnodes > 1 and loopback_nodes > 1:
        raise click.UsageError("give --nnodes or --loopback-nodes, not both")
    if place.node_rank > 0:  # the same command on every node: all but node 0 follow it
        run_follower(place.endpoint, place.node_rank, token_file, store_dir, join_timeout_s)
        return
    if keep_running and not apply_run:
        raise click.UsageError("--keep-running goes with --apply RUN")
    run_dir = (
        RunDir.find(apply_run, store_dir) if apply_run else None
    )  # fail before tuning, not after
    ensure_writable(store_dir, "the study store folder (--store)")
    ensure_writable(out_dir, "the report folder (--out)")
    resolve_spec(workload)  # a missing file: one line now, not after torch has loaded
    names = split_names(plugins)
    if names is not None:
        check_installed(names)
    from tunekit.orchestrator import AutoSettings
    from tunekit.trials.launcher import LaunchOptions

    warm_start.prepare()  # torch is in: fork the processes' server before threads start
    settings = AutoSettings(
        workload=workload,
        nproc=nproc,
        plugins=names,
        trials=3 if trials is None and budget is None else trials,
        budget_s=budget,
        out_dir=out_dir,
        store_dir=store_dir,
        resume=resume,
        warmup=warmup,
        steps=steps,
        timeout_s=timeout_s,
        stall_s=stall_s,
        min_effect=min_effect,
        measure_rounds=measure_rounds,
        device=device,
        hardware=hardware,
        probe=not no_probe,
        search_steps=search_steps,
        in_job_search=not demo,
        rerank=not no_rerank,
        pause_run=None if keep_running else run_dir,
        launch=LaunchOptions(
            nproc=nproc,
            nnodes=place.nnodes,
            node_rank=0,
            rdzv_endpoint=place.endpoint,
            rdzv_id=rdzv_id,
            loopback_nodes=loopback_nodes,
        ),
        node_token=read_token(token_file),
        join_timeout_s=join_timeout_s,
        memory_cap_bytes=memory_cap,
        clock_from=process_started(),
    )
    if demo and not as_json:
        console.print(
            f"demo: {workload} within {budget:g} s, the tuners' best candidates, {steps} steps a "
            f"trial (`tunekit auto {workload}` tunes it in full)"
            if budget is not None
            else f"demo: {workload}, {steps} steps a trial (`tunekit auto {workload}` tunes it in full)"
        )
    try:
        decision = asyncio.run(_drive(settings, as_json, explain))
    except KeyboardInterrupt:  # the study is stored as interrupted: say how to go on
        raise Interrupted.saying(
            f"the study is saved: continue it with `{resume_command()}`"
        ) from None
    if run_dir is not None:
        _apply_winner(run_dir, decision, as_json)


def process_started() -> float:
    """This process's start on the ``time.monotonic()`` clock: a budget counts from it."""
    import time

    import psutil

    return time.monotonic() - max(0.0, time.time() - psutil.Process().create_time())


DEMO_BUDGET_S = 55.0
"""The demo's time budget (``tunekit auto`` without a workload): observing, diagnosing and
trials, a confirmation kept room for, what does not fit skipped and said; with starting
tunekit and writing the report, the command's minute."""
DEMO_STEPS, DEMO_WARMUP = 8, 2
"""The demo's measured and warm-up steps a trial (where a decision is unclear, more paired
rounds measure more, within the budget)."""

# `tunekit auto --help` lists the examples (docs/workloads.md sends readers there)
auto_cmd.help = f"{inspect.cleandoc(auto_cmd.help or '')}\n\n{examples_help()}"


def resume_command() -> str:
    """This ``tunekit auto`` command line as given, with ``--resume``."""
    ctx = click.get_current_context()
    parts = ["tunekit", "auto"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if isinstance(param, click.Argument):
            if value is not None:  # None: the demo
                parts.append(shlex.quote(str(value)))
        elif param.name != "resume" and value not in (None, (), False) and value != param.default:
            opt = max(param.opts, key=len)
            values = value if param.multiple else [value]
            flag = isinstance(param, click.Option) and param.is_flag
            parts += [opt] if flag else [f"{opt} {shlex.quote(str(v))}" for v in values]
    return " ".join([*parts, "--resume"])


def _quiet_cancellation(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Ctrl-C cancels the trial in flight: its cancellation is expected, not an error to print."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


async def _drive(settings, as_json: bool, explain: bool = False) -> dict | None:
    from tunekit.orchestrator import run_auto

    asyncio.get_running_loop().set_exception_handler(_quiet_cancellation)
    decision = None
    if as_json:
        async for ev in run_auto(settings):
            click.echo(json.dumps(ev.to_dict(), default=str))
            if isinstance(ev, Decided):
                decision = ev.decision
        return decision
    view = _ProgressView(explain)
    with view.progress:
        async for ev in run_auto(settings):
            view.handle(ev)
    view.finish()
    return view.decision


def _apply_winner(run_dir: RunDir, decision: dict | None, as_json: bool) -> None:
    from tunekit.runtime.client import apply_to_run

    if not decision or decision.get("winner") == "baseline":
        message = f"nothing to apply to run {run_dir.run_id}: the baseline stays"
        result = {"applied": False}
    else:
        outcome = apply_to_run(run_dir, TuningConfig.from_dict(decision["winner_config"]))
        message = f"run {run_dir.run_id}: {outcome.message}"
        result = outcome.to_dict()
    if as_json:
        click.echo(
            json.dumps(
                {"event": "Applied", "run": run_dir.run_id, "message": message, **result},
                default=str,
            )
        )
    else:
        console.print(message)


def _ms(x):
    return "—" if x is None else f"{x * 1e3:.1f} ms"


class _ProgressView:
    """Renders orchestrator events as lines and one progress bar per running trial."""

    def __init__(self, explain: bool = False):
        self.explain = explain
        """Bodies of diagnoses, plans and the timings too (``-v``)."""
        self.diagnoses: dict[str, dict] = {}
        self.progress = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[last]}", markup=False),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.tasks: dict[int, TaskID] = {}
        self.budget_skipped: list[int] = []
        """Trials skipped for time: one line at the end, not one each."""
        self.decision: dict | None = None
        self.paths: dict[str, str] | None = None
        self.finished: StudyFinished | None = None

    def say(self, *parts: str | Text) -> None:
        self.progress.console.print(*parts)

    def handle(self, ev) -> None:
        if isinstance(ev, StudyStarted):
            extra = f" (resumed: {ev.finished_trials} trial(s) already done)" if ev.resumed else ""
            self.say(
                styled("[bold]study {}[/]", ev.study_id),
                f"· {ev.workload} · {ev.nproc} rank(s)/node{f' × {ev.nnodes} nodes' if ev.nnodes > 1 else ''} · hardware {ev.hardware}{extra}",
            )
        elif isinstance(ev, Notice):
            self.say(
                styled("[yellow]note:[/] {}", ev.message) if ev.level == "warning" else ev.message
            )
        elif isinstance(ev, PluginProblem):
            where = "; traceback in the report's Problems" if ev.traceback else ""
            self.say(styled("[yellow]plugin {} {}:[/] {}{}", ev.plugin, ev.status, ev.error, where))
        elif isinstance(ev, Observed):
            s = ev.summary
            self.say(
                f"observed: {s['num_params']:,} parameters, global batch {s['global_batch']}, "
                f"baseline {_ms(s['baseline_median_s'])} ± {_ms(s['baseline_spread_s'])} per step"
            )
            t = s.get("truth")
            if t and t.get("parts_s"):
                parts = " · ".join(
                    f"{PART_LABELS[p]} {f:.0%}" for p, f in t["fractions"].items() if f >= 0.005
                )
                r = f" · overlap R {t['overlap_R']:.0f}" if t.get("overlap_R") is not None else ""
                self.say(f"  where the step goes (measured): {parts}{r}")
            if line := memory_line(s.get("memory")):
                self.say(f"  {line}")
        elif isinstance(ev, Diagnosed):
            self.diagnoses[ev.plugin] = ev.to_dict()
            self.say(styled("  {}: ", ev.plugin) + marked_headline(headline_of(ev), ev.applies))
            if self.explain:
                for point in body_points(ev.summary):
                    self.say(styled("    [dim]·[/] {}", point))
        elif isinstance(ev, Planned):
            if self.explain:
                self.say(f"  {ev.plugin}: planned {len(ev.candidates)} candidate(s)")
        elif isinstance(ev, TrialStarted):
            pred = _prediction(ev.predicted_s, ev.corrected_s)
            pred = f", predicted {pred}" if pred else ""
            self.tasks[ev.trial_id] = self.progress.add_task(
                f"[{ev.index}/{ev.total}] {ev.role} {ev.description}{pred}", total=None, last=""
            )
        elif isinstance(ev, TrialProgress):
            task = self.tasks.get(ev.trial_id)
            if task is not None:
                label = f"{ev.phase} {_ms(ev.step_s)}" if ev.step_s else ev.phase
                self.progress.update(task, completed=ev.index, total=ev.total, last=label)
        elif isinstance(ev, TrialFinished):
            task = self.tasks.pop(ev.trial_id, None)
            if task is not None:
                self.progress.remove_task(task)
            if ev.status == "skipped" and ev.error in (BUDGET_SKIP, NOTHING_RAN):
                # Said once, as ranges, after the trials; a baseline with nothing run since the
                # last one is no news at all.
                if ev.error == BUDGET_SKIP:
                    self.budget_skipped.append(ev.seq)
            elif ev.status == "ok":
                pred = _prediction(ev.predicted_s, ev.corrected_s)
                self.say(
                    f"  trial {ev.seq} {ev.role} {ev.description}: {_ms(ev.median_s)} ± {_ms(ev.spread_s)}"
                    + (f" (predicted {pred})" if pred else "")
                )
            else:
                self.say(
                    styled(
                        "  trial {} {} {}: [red]{}[/] {}",
                        ev.seq,
                        ev.role,
                        ev.description,
                        ev.status,
                        ev.error or "",
                    )
                )
        elif isinstance(ev, Reranked):
            learnt = "; ".join(f"{p}: {c['text']}" for p, c in ev.corrections.items())
            if learnt and self.explain:  # after every trial, every tuner's: -v only
                self.say(styled("  [dim]feedback — {}[/]", learnt))
            if ev.dropped:
                self.say(
                    styled(
                        "  [dim]dropped {} candidate(s) now predicted slower than the baseline[/]",
                        len(ev.dropped),
                    )
                )
        elif isinstance(ev, Decided):
            self.decision = ev.decision
        elif isinstance(ev, ReportWritten):
            self.paths = ev.paths
        elif isinstance(ev, StudyFinished):
            self.finished = ev

    def finish(self) -> None:
        if self.budget_skipped:
            console.print(
                f"skipped {len(self.budget_skipped)} planned trial(s) that did not fit the time budget "
                f"({_ranges(self.budget_skipped)})"
            )
        if self.decision is not None:
            console.print(result_table(self.decision))
            console.print(f"decision: {self.decision.get('reason', '')}")
            # Where a verdict and what its trials measured differ, the line that says why.
            for o in outcomes(self.diagnoses, self.decision):
                if o.note:
                    console.print(styled("  {}: {}", o.plugin, o.note))
        if self.explain and self.finished is not None and self.finished.timings:
            console.print(timings_table(self.finished.timings))
        if self.paths:
            console.print(
                f"report: {self.paths['report_md']} · best config: {self.paths['best_config']}"
            )


def memory_line(memory: dict | None) -> str:
    """``memory per rank (fsdp ...): 1.2 GiB measured peak; model: activations 0.7 GiB, ...``."""
    if not memory:
        return ""
    from tunekit.memory import PART_WORDS, format_bytes

    predicted = memory["predicted"]
    total = predicted["peak_bytes"] or 1.0
    parts = sorted(
        ((k, v) for k, v in predicted["parts"].items() if abs(v) >= 0.01 * total),
        key=lambda kv: -abs(kv[1]),
    )
    what = ", ".join(f"{PART_WORDS.get(k, k)} {format_bytes(v)}" for k, v in parts)
    measured = memory.get("measured_peak_bytes")
    head = (
        f"{format_bytes(measured)} measured peak"
        if measured
        else f"{format_bytes(predicted['peak_bytes'])} predicted peak"
    )
    cap = f" of a {format_bytes(memory['cap_bytes'])} cap" if memory.get("cap_bytes") else ""
    return (
        f"memory per rank ({memory['layout']}): {head}{cap}; at the {predicted['moment']} "
        f"peak: {what}"
    )


def _ranges(seqs: list[int]) -> str:
    """``#4–#9, #12``: trial numbers, runs of consecutive ones as ranges."""
    runs: list[list[int]] = []
    for n in sorted(seqs):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"#{r[0]}" if len(r) == 1 else f"#{r[0]}–#{r[-1]}" for r in runs)


def timings_table(stages: list[dict]) -> Table:
    """Where the study's time went: every stage's wall and CPU seconds, in order."""
    table = Table(
        title="where the time went (CPU: every process that worked on it)", title_justify="left"
    )
    for col in ("stage", "wall", "CPU", "what"):
        table.add_column(col)
    for s in stages:
        cpu = "—" if s.get("cpu_s") is None else f"{s['cpu_s']:.1f} s"
        name = f"  {s['stage']}" if s.get("part_of") else s["stage"]  # within the row after it
        table.add_row(name, f"{s['wall_s']:.1f} s", cpu, s.get("detail", ""))
    wall, cpu_s = total(stages)
    table.add_row("total", f"{wall:.1f} s", f"{cpu_s:.1f} s", "")
    return table


def _prediction(raw: float | None, corrected: float | None) -> str:
    """``12.3 ms`` or ``12.3 ms → 14.0 ms corrected`` (empty without a prediction)."""
    if not raw:
        return ""
    if corrected and abs(corrected - raw) > 0.0005 * raw:
        return f"{_ms(raw)} → {_ms(corrected)} corrected"
    return _ms(raw)


def result_table(decision: dict) -> Table:
    """Baseline against the best config: median step, samples/s, speed-up with its interval."""
    table = Table(title="baseline vs best", title_justify="left")
    for col in ("config", "median step", "samples/s", "speed-up"):
        table.add_column(col)
    base = decision.get("baseline_median_s")
    best = decision.get("winner_median_s") or base
    base_gb = decision.get("baseline_global_batch") or decision.get("global_batch")
    best_gb = decision.get("winner_global_batch") or base_gb

    def rate(x, gb):
        return "—" if not x or not gb else f"{gb / x:,.1f}"

    table.add_row("baseline", _ms(base), rate(base, base_gb), "1.00x")
    if decision.get("winner", "baseline") == "baseline":
        return table
    ci = decision.get("ci")
    sp = decision.get("speedup") or 1.0
    table.add_row(
        decision.get("winner", "baseline"),
        _ms(best),
        rate(best, best_gb),
        f"{sp:.2f}x" + (f" (95% CI {ci[0]:.2f}–{ci[1]:.2f})" if ci else ""),
    )
    return table
