"""Live jobs: ``tunekit run``, ``apply``, ``status``, ``trial``, ``rollback``, ``stop``."""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tunekit.cli.common import (
    MEMORY_CAP_OPTION,
    STORE_OPTION,
    Interrupted,
    console,
    ensure_writable,
    stops_on_sigterm,
    styled,
)
from tunekit.cli.follow import JOIN_TIMEOUT_OPTION, TOKEN_FILE_OPTION, node_options, run_follower
from tunekit.config import TuningConfig, check_batch
from tunekit.errors import ConfigError, shown
from tunekit.locks import holder_if_held
from tunekit.runtime.client import apply_to_run, stop_run
from tunekit.runtime.control import JobNotRunning, JobRelaunching
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import (
    client,
    create_run,
    prepare_resume,
    supervise,
    supervising,
)
from tunekit.trials import warm_start
from tunekit.workload_spec import resolve_spec

CONFIG_FORMS = """CONFIG is one of: PLUGIN.knob=value pairs (`tunekit plan` prints them),
e.g. `overlap_chunking.mode=two_chunk overlap_chunking.k=9`; a config file
(best_config.json); or inline JSON, e.g.
'{"overlap_chunking": {"mode": "two_chunk", "k": 9}}'."""


def read_config(args: str | tuple[str, ...] | list[str]) -> TuningConfig:
    """A config from PLUGIN.knob=value pairs, a file (best_config.json) or inline JSON."""
    args = (args,) if isinstance(args, str) else tuple(args)
    if not args:
        raise ConfigError("no CONFIG given. " + CONFIG_FORMS)
    if len(args) == 1 and args[0].lstrip().startswith("{"):
        return TuningConfig.from_json(args[0], where="inline config")
    if all("=" in a and "." in a.partition("=")[0] for a in args):
        return TuningConfig.from_pairs(args)
    if len(args) == 1:
        text = args[0]
        if "(" in text and text.rstrip().endswith(")"):  # `tunekit plan`'s description, pasted
            raise ConfigError(f"{shown(text)} is a description, not a config. " + CONFIG_FORMS)
        return TuningConfig.load(text)
    bad = next(a for a in args if not ("=" in a and "." in a.partition("=")[0]))
    raise ConfigError(f"{shown(bad)} is not PLUGIN.knob=value. " + CONFIG_FORMS)


@click.command("run")
@click.argument("workload", required=False)
@click.option(
    "--nproc", type=click.IntRange(min=1), default=2, show_default=True, help="Ranks per node."
)
@click.option(
    "--config", "config_path", default=None, help="Start with this config (file or inline JSON)."
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many steps [default: run until stopped].",
)
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=50, show_default=True)
@click.option(
    "--watch-window",
    type=click.IntRange(min=2),
    default=10,
    show_default=True,
    help="Steps compared before and after an apply.",
)
@click.option(
    "--min-effect",
    type=click.FloatRange(0, 1),
    default=0.02,
    show_default=True,
    help="Slowdown beyond noise that rolls back.",
)
@click.option(
    "--resume", "resume", default=None, metavar="RUN", help="Continue RUN from its last checkpoint."
)
@click.option("--name", default=None, help="Run id (default: a timestamp).")
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
)
@node_options
@TOKEN_FILE_OPTION
@JOIN_TIMEOUT_OPTION
@STORE_OPTION
@MEMORY_CAP_OPTION
@stops_on_sigterm
def run_cmd(
    workload,
    nproc,
    config_path,
    steps,
    checkpoint_every,
    watch_window,
    min_effect,
    resume,
    name,
    device,
    nnodes,
    node_rank,
    rdzv_endpoint,
    token_file,
    join_timeout_s,
    store_dir,
    memory_cap,
):
    """Train WORKLOAD under torchrun until done or stopped; control it with apply/trial/rollback/stop."""
    from tunekit.trials.nodes import node_place

    place = node_place(nnodes, node_rank, rdzv_endpoint, follower=True)
    if place.node_rank > 0:  # the same command on every node: all but node 0 follow it
        run_follower(place.endpoint, place.node_rank, token_file, store_dir, join_timeout_s)
        return
    if resume and nnodes is None:  # a resumed run spans the nodes it was made for
        nnodes = int(RunDir.find(resume, store_dir).read_run().get("nnodes") or 1)
    place = node_place(nnodes, 0, rdzv_endpoint)
    if resume:
        if workload:
            raise click.UsageError("give WORKLOAD or --resume RUN, not both")
        rd = RunDir.find(resume, store_dir)
    else:
        if not workload:
            raise click.UsageError("missing WORKLOAD (or --resume RUN)")
        config = read_config(config_path) if config_path else None
        ensure_writable(store_dir, "the study store folder (--store)")
        resolve_spec(workload)  # a bad name: one line now, not after torch has loaded
        rd = create_run(
            store_dir,
            workload,
            nproc=nproc,
            config=config,
            steps=steps,
            checkpoint_every=checkpoint_every,
            watch_window=watch_window,
            min_effect=min_effect,
            device=device,
            name=name,
            nnodes=place.nnodes,
            memory_cap_bytes=memory_cap,
        )
    if resume and memory_cap is not None:  # the resumed job takes the new cap
        rd.update_run(memory_cap_bytes=memory_cap)
    if resume and int(rd.read_run().get("nnodes") or 1) != place.nnodes:
        raise click.UsageError(
            f"run {rd.run_id} spans {rd.read_run().get('nnodes') or 1} node(s), not {place.nnodes}"
        )
    with supervising(rd):  # one supervisor and one job per run, or a one-line refusal
        if resume:
            ckpt = prepare_resume(rd)
            console.print(styled("resuming run [bold]{}[/] from {}", rd.run_id, ckpt.name))
        else:
            console.print(styled("run [bold]{}[/] in {}", rd.run_id, rd.path))
        warm_start.prepare()  # the agents' server, forked before the progress display's thread
        with coordinating(place, token_file, store_dir, join_timeout_s) as nodes:
            code = _supervise_with_progress(rd, nodes)
    st = rd.read_status()
    console.print(
        f"run {rd.run_id} {st.get('status')} at step {st.get('step')}"
        + (f": {st['error']}" if st.get("error") else "")
        + (
            f" before its relaunch with {st['pending_relaunch']} rank(s): "
            f"`tunekit run --resume {rd.run_id}` carries it out"
            if st.get("pending_relaunch")
            else ""
        )
    )
    raise SystemExit(code)


@contextlib.contextmanager
def coordinating(place, token_file: Path | None, store_dir: Path, join_timeout_s: float):
    """Node 0 of a job across nodes: host the followers' coordinator and wait for them to join
    (None on one node); announces the end when the job is over."""
    if place.nnodes == 1:
        yield None
        return
    from tunekit.trials.nodes import describe_hello, host_coordinator, read_token

    nodes, hint = host_coordinator(
        place.endpoint, place.nnodes, read_token(token_file), store_dir, console.print
    )
    try:
        console.print(nodes.how_to_follow(hint))
        nodes.wait_for_followers(
            join_timeout_s, hint, lambda r, _: console.print(describe_hello(nodes, r))
        )
        yield nodes
    finally:
        nodes.close()
        if refused := nodes.refusals.summary():
            console.print(refused)


def _supervise_with_progress(rd: RunDir, nodes=None) -> int:
    total = rd.read_run().get("steps")
    progress = Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}", markup=False),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task("training", total=total, info="starting")
    seen_events = [0]

    def tick(rd: RunDir) -> None:
        st = rd.read_status()
        last = st.get("last") or {}
        if last:
            info = (
                f"loss {last['loss']:.4f} · {last['step_s'] * 1e3:.1f} ms/step · "
                f"{st.get('world_size')} rank(s) · config {st.get('config_id', '?')}"
            )
            progress.update(task, completed=st.get("step", 0), info=info)
        events = rd.read_events()
        for ev in events[seen_events[0] :]:
            if ev["kind"] == "memory":
                progress.console.print(f"  {ev['line']}")
            elif ev["kind"] not in ("started",):
                progress.console.print(
                    f"  {ev['kind']}: "
                    + ", ".join(
                        f"{k}={v}"
                        for k, v in ev.items()
                        if k in ("step", "nproc", "reason", "error")
                    )
                )
        seen_events[0] = len(events)

    try:
        with progress:
            return supervise(rd, on_tick=tick, nodes=nodes)
    except KeyboardInterrupt:
        raise Interrupted.saying(
            f"the run checkpointed and stopped: continue it with `tunekit run --resume {rd.run_id}`"
        ) from None


ENDED = ("stopped", "finished", "crashed")


def died_without_a_word(rd: RunDir, status: dict) -> bool:
    """Whether the job's status says it lives (running, paused, starting, relaunching) while
    nothing of it does: neither its supervisor nor its rank 0 holds its lock (the kernel drops a
    lock with its holder, so a job killed with ``kill -9``, or one whose status could not be
    written on a full disk, leaves none)."""
    if status.get("status") in ENDED:
        return False
    return holder_if_held(rd.supervisor_lock) is None and holder_if_held(rd.rank0_lock) is None


def _find(run: str, store_dir: Path) -> RunDir:
    return RunDir.find(run, store_dir)


@click.command("apply", epilog=CONFIG_FORMS)
@click.argument("run")
@click.argument("config", nargs=-1, required=True)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=None,
    help="Relaunch with this many ranks in all (a job across nodes splits them evenly over its nodes).",
)
@click.option(
    "--watch", type=click.IntRange(min=2), default=None, help="Steps to watch before keeping it."
)
@click.option(
    "--no-wait", is_flag=True, help="Return once applied, without waiting for the watch verdict."
)
@STORE_OPTION
def apply_cmd(run, config, nproc, watch, no_wait, store_dir):
    """Apply CONFIG (PLUGIN.knob=value pairs, best_config.json or inline JSON) to the live RUN at its next step boundary."""
    rd = _find(run, store_dir)
    cfg = read_config(config)
    check_batch(cfg, rd.read_status())
    outcome = apply_to_run(rd, cfg, nproc=nproc, watch=watch, wait=not no_wait)
    console.print(outcome.message)
    if outcome.rolled_back:
        raise SystemExit(1)


@click.command("status")
@click.argument("run", default="latest")
@click.option("--json", "as_json", is_flag=True)
@STORE_OPTION
def status_cmd(run, as_json, store_dir):
    """Print what the live RUN is doing (default: the latest run)."""
    rd = _find(run, store_dir)
    try:
        st = client(rd, timeout_s=10).request("status")
    except (JobNotRunning, JobRelaunching):
        st = rd.read_status()  # not running: the last status it wrote
        if died_without_a_word(rd, st):
            said = (
                f"run {rd.run_id}: not running (last seen at step {st.get('step', 0)}, died without "
                f"a word); `tunekit run --resume {rd.run_id}` continues it from its newest checkpoint"
            )
            if as_json:
                click.echo(
                    json.dumps({**st, "status": "died", "said": said}, indent=2, default=str)
                )
            else:
                console.print(said)
            raise SystemExit(1) from None
    if as_json:
        click.echo(json.dumps(st, indent=2, default=str))
        return
    last = st.get("last") or {}
    console.print(
        f"run {rd.run_id}: {st.get('status')} at step {st.get('step')} on {st.get('world_size')} rank(s)"
        + (f", to {st['relaunching_to']} rank(s)" if st.get("relaunching_to") else "")
    )
    if st.get("error"):
        console.print(f"  error: {st['error']}")
    if last:
        console.print(f"  last step {last['step_s'] * 1e3:.1f} ms, loss {last['loss']:.4f}")
    rate = throughput(read_metrics_tail(rd.metrics_file), st.get("config_id"))
    if rate:
        console.print(f"  {rate}")
    console.print(f"  config: {TuningConfig.from_dict(st.get('config') or {}).describe()}")
    batch = st.get("batch") or {}
    if batch.get("size"):
        rng = batch.get("range")
        console.print(
            f"  batch {batch['size']} per rank"
            + (f" (allowed {rng[0]}–{rng[1]})" if rng else " (the workload sets no batch_range)")
        )
    if st.get("watch"):
        console.print(f"  watch: {st['watch']['state']} {st['watch'].get('reason', '')}")
    if st.get("paused"):
        console.print(
            f"  paused at step {st['paused']['step']}: {st['paused']['reason'] or 'no reason given'}"
        )


@click.command("trial", epilog=CONFIG_FORMS)
@click.argument("run")
@click.argument("config", nargs=-1, required=True)
@click.option(
    "--window", type=click.IntRange(min=2), default=10, show_default=True, help="Steps per window."
)
@STORE_OPTION
def trial_cmd(run, config, window, store_dir):
    """Try CONFIG inside the live RUN (candidate and current in alternating windows); keep the faster."""
    rd = _find(run, store_dir)
    cfg = read_config(config)
    check_batch(cfg, rd.read_status())
    r = client(rd).request("trial", config=cfg.to_dict(), window=window)
    console.print(
        f"candidate {r['candidate_samples_per_s']:,.0f} vs current {r['current_samples_per_s']:,.0f} "
        f"samples/s ({r['speedup']:.2f}x, 95% CI {r['ci'][0]:.2f}-{r['ci'][1]:.2f}): kept the {r['kept']}"
    )


@click.command("rollback")
@click.argument("run")
@STORE_OPTION
def rollback_cmd(run, store_dir):
    """Go back to the config RUN had before its last apply."""
    r = client(_find(run, store_dir)).request("rollback")
    if r.get("relaunching"):
        console.print(
            f"rolling back: relaunching with {r['nproc']} rank(s) from step {r.get('step')}"
        )
    else:
        console.print(f"rolled back at step {r.get('step')}")


@click.command("stop")
@click.argument("run")
@STORE_OPTION
def stop_cmd(run, store_dir):
    """Checkpoint RUN and stop it cleanly (resume later with tunekit run --resume RUN)."""
    console.print(stop_run(_find(run, store_dir)))


TREND_STEPS = 40
"""Steps of the current config the status trend covers."""


def read_metrics_tail(path: Path, max_bytes: int = 256 * 1024) -> list[dict]:
    """The last metric lines of ``metrics.jsonl`` (its last ``max_bytes``)."""
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, 2) - max_bytes)
            f.seek(start)
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    if start:
        lines = lines[1:]  # cut mid-line
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


SPARK = "▁▂▃▄▅▆▇█"


def throughput(metrics: list[dict], config_id: str | None, steps: int = TREND_STEPS) -> str:
    """``312.4 samples/s (median of the last 40 steps of this config), trend ▃▄▅▅▆ +4%``;
    empty when the current config has no steps yet."""
    mine: list[dict] = []
    for m in metrics:  # the trailing run of steps under the current config
        mine = [*mine, m] if m.get("config_id") == config_id else []
    rates = [m["samples_per_s"] for m in mine[-steps:] if m.get("samples_per_s")]
    if not rates:
        return ""
    median = statistics.median(rates)
    text = f"{median:,.1f} samples/s (median of the last {len(rates)} step(s) of this config)"
    if len(rates) < 10:
        return text
    chunks = [rates[i * len(rates) // 5 : (i + 1) * len(rates) // 5] for i in range(5)]
    meds = [statistics.median(c) for c in chunks]
    lo, hi = min(meds), max(meds)
    bars = "".join(
        SPARK[0 if hi == lo else round((v - lo) / (hi - lo) * (len(SPARK) - 1))] for v in meds
    )
    change = meds[-1] / meds[0] - 1
    return f"{text}, trend {bars} {change:+.0%}"


COMMANDS = (run_cmd, apply_cmd, status_cmd, trial_cmd, rollback_cmd, stop_cmd)
