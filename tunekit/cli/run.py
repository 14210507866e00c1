"""Live jobs: ``tunekit run``, ``apply``, ``status``, ``trial``, ``rollback``, ``stop``."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tunekit.cli.common import STORE_OPTION, Interrupted, console, ensure_writable
from tunekit.config import TuningConfig
from tunekit.runtime.control import JobNotRunning
from tunekit.runtime.rundir import RunDir
from tunekit.runtime.supervisor import (
    client,
    create_run,
    prepare_resume,
    supervise,
    supervising,
    wait_for,
)


def read_config(text: str) -> TuningConfig:
    """A config from a file (best_config.json) or inline JSON."""
    if text.lstrip().startswith("{"):
        return TuningConfig.from_json(text, where="inline config")
    return TuningConfig.load(text)


@click.command("run")
@click.argument("workload", required=False)
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--config", "config_path", default=None, help="Start with this config (file or inline JSON).")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Stop after this many steps [default: run until stopped].")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=50, show_default=True)
@click.option("--watch-window", type=click.IntRange(min=2), default=10, show_default=True, help="Steps compared before and after an apply.")
@click.option("--min-effect", type=click.FloatRange(0, 1), default=0.02, show_default=True, help="Slowdown beyond noise that rolls back.")
@click.option("--resume", "resume", default=None, metavar="RUN", help="Continue RUN from its last checkpoint.")
@click.option("--name", default=None, help="Run id (default: a timestamp).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@STORE_OPTION
def run_cmd(workload, nproc, config_path, steps, checkpoint_every, watch_window, min_effect, resume, name, device, store_dir):
    """Train WORKLOAD under torchrun until done or stopped; control it with apply/trial/rollback/stop."""
    if resume:
        if workload:
            raise click.UsageError("give WORKLOAD or --resume RUN, not both")
        rd = RunDir.find(resume, store_dir)
    else:
        if not workload:
            raise click.UsageError("missing WORKLOAD (or --resume RUN)")
        config = read_config(config_path) if config_path else None
        ensure_writable(store_dir, "the study store folder (--store)")
        rd = create_run(store_dir, workload, nproc=nproc, config=config, steps=steps,
                        checkpoint_every=checkpoint_every, watch_window=watch_window, min_effect=min_effect,
                        device=device, name=name)
    with supervising(rd):  # one supervisor and one job per run, or a one-line refusal
        if resume:
            ckpt = prepare_resume(rd)
            console.print(f"resuming run [bold]{rd.run_id}[/] from {ckpt.name}")
        else:
            console.print(f"run [bold]{rd.run_id}[/] in {rd.path}")
        code = _supervise_with_progress(rd)
    st = rd.read_status()
    console.print(f"run {rd.run_id} {st.get('status')} at step {st.get('step')}"
                  + (f": {st['error']}" if st.get("error") else ""))
    raise SystemExit(code)


def _supervise_with_progress(rd: RunDir) -> int:
    total = rd.read_run().get("steps")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
    task = progress.add_task("training", total=total, info="starting")
    seen_events = [0]

    def tick(rd: RunDir) -> None:
        st = rd.read_status()
        last = st.get("last") or {}
        if last:
            info = (f"loss {last['loss']:.4f} · {last['step_s'] * 1e3:.1f} ms/step · "
                    f"{st.get('world_size')} rank(s) · config {st.get('config_id', '?')}")
            progress.update(task, completed=st.get("step", 0), info=info)
        events = rd.read_events()
        for ev in events[seen_events[0]:]:
            if ev["kind"] not in ("started",):
                progress.console.print(f"  {ev['kind']}: " + ", ".join(
                    f"{k}={v}" for k, v in ev.items() if k in ("step", "nproc", "reason", "error")))
        seen_events[0] = len(events)

    try:
        with progress:
            return supervise(rd, on_tick=tick)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; the run checkpointed and stopped: continue it with "
                          f"`tunekit run --resume {rd.run_id}`") from None


def _find(run: str, store_dir: Path) -> RunDir:
    return RunDir.find(run, store_dir)


@click.command("apply")
@click.argument("run")
@click.argument("config")
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Relaunch with this many ranks.")
@click.option("--watch", type=click.IntRange(min=2), default=None, help="Steps to watch before keeping it.")
@click.option("--no-wait", is_flag=True, help="Return once applied, without waiting for the watch verdict.")
@STORE_OPTION
def apply_cmd(run, config, nproc, watch, no_wait, store_dir):
    """Apply CONFIG (best_config.json or inline JSON) to the live RUN at its next step boundary."""
    rd = _find(run, store_dir)
    result = apply_to_run(rd, read_config(config), nproc=nproc, watch=watch, wait=not no_wait)
    console.print(result["message"])
    if result.get("rolled_back"):
        raise SystemExit(1)


def apply_to_run(rd: RunDir, config: TuningConfig, nproc: int | None = None, watch: int | None = None,
                 wait: bool = True) -> dict:
    """Apply and (by default) wait for the outcome: kept, rolled back, or relaunched."""
    body = {"config": config.to_dict()}
    if nproc is not None:
        body["nproc"] = nproc
    if watch is not None:
        body["watch"] = watch
    reply = client(rd).request("apply", **body)
    if reply.get("relaunching"):
        msg = f"relaunching with {reply['nproc']} rank(s) from step {reply['step']}"
    else:
        msg = f"applied at step {reply['step']}"
    if not wait:
        return {"message": msg + "; watching", **reply}

    def verdict(s: dict) -> bool:  # this apply's watch, not an earlier one still in status.json
        w = s.get("watch") or {}
        mine = w.get("applied_at") == reply["step"]
        return (mine and w.get("state") != "watching") or s.get("status") in ("finished", "stopped")

    # A relaunch is watched in the relaunched job; a crash under the change is rolled back by
    # the supervisor, which leaves its verdict in status.json: either way the verdict comes.
    st = wait_for(rd, verdict)
    w = st.get("watch") or {}
    rolled = w.get("state") in ("rolled_back", "rolling_back")
    return {"message": f"{msg}; {'rolled back' if rolled else 'kept'}: {w.get('reason', '')}", "rolled_back": rolled, **reply}


@click.command("status")
@click.argument("run", default="latest")
@click.option("--json", "as_json", is_flag=True)
@STORE_OPTION
def status_cmd(run, as_json, store_dir):
    """Print what the live RUN is doing (default: the latest run)."""
    rd = _find(run, store_dir)
    try:
        st = client(rd, timeout_s=10).request("status")
    except JobNotRunning:
        st = rd.read_status()  # not running: the last status it wrote
    if as_json:
        click.echo(json.dumps(st, indent=2, default=str))
        return
    last = st.get("last") or {}
    console.print(f"run {rd.run_id}: {st.get('status')} at step {st.get('step')} on {st.get('world_size')} rank(s)")
    if last:
        console.print(f"  last step {last['step_s'] * 1e3:.1f} ms, loss {last['loss']:.4f}")
    console.print(f"  config: {TuningConfig.from_dict(st.get('config') or {}).describe()}")
    if st.get("watch"):
        console.print(f"  watch: {st['watch']['state']} {st['watch'].get('reason', '')}")
    if st.get("paused"):
        console.print(f"  paused at step {st['paused']['step']}: {st['paused']['reason'] or 'no reason given'}")


@click.command("trial")
@click.argument("run")
@click.argument("config")
@click.option("--window", type=click.IntRange(min=2), default=10, show_default=True, help="Steps per window.")
@STORE_OPTION
def trial_cmd(run, config, window, store_dir):
    """Try CONFIG inside the live RUN (candidate and current in alternating windows); keep the faster."""
    rd = _find(run, store_dir)
    r = client(rd).request("trial", config=read_config(config).to_dict(), window=window)
    console.print(f"candidate {r['candidate_samples_per_s']:,.0f} vs current {r['current_samples_per_s']:,.0f} "
                  f"samples/s ({r['speedup']:.2f}x, 95% CI {r['ci'][0]:.2f}-{r['ci'][1]:.2f}): kept the {r['kept']}")


@click.command("rollback")
@click.argument("run")
@STORE_OPTION
def rollback_cmd(run, store_dir):
    """Go back to the config RUN had before its last apply."""
    r = client(_find(run, store_dir)).request("rollback")
    if r.get("relaunching"):
        console.print(f"rolling back: relaunching with {r['nproc']} rank(s) from step {r.get('step')}")
    else:
        console.print(f"rolled back at step {r.get('step')}")


@click.command("stop")
@click.argument("run")
@STORE_OPTION
def stop_cmd(run, store_dir):
    """Checkpoint RUN and stop it cleanly (resume later with tunekit run --resume RUN)."""
    r = client(_find(run, store_dir)).request("stop")
    console.print(f"stopped at step {r['stopped_at']}")


COMMANDS = (run_cmd, apply_cmd, status_cmd, trial_cmd, rollback_cmd, stop_cmd)
