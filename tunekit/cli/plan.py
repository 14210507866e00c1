"""``tunekit plan PLUGIN WORKLOAD``: a tuner's diagnosis and ranked candidates, no trials."""

from __future__ import annotations

import click
from rich.markdown import Markdown
from rich.table import Table

from tunekit.cli.common import STORE_OPTION, console, trials_table
from tunekit.config import TuningConfig
from tunekit.examples import DEFAULT_EXAMPLE
from tunekit.observe.observation import Measurement
from tunekit.orchestrator import AutoSettings, observe_static, observed_baseline, study_key
from tunekit.plugin_loading import load_all, select
from tunekit.report import report_data
from tunekit.store import Store
from tunekit.trials.launcher import LaunchOptions


@click.command("plan")
@click.argument("plugin")
@click.argument("workload", default=f"example:{DEFAULT_EXAMPLE}")
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True, help="Ranks (devices) to plan for.")
@click.option("--hardware", default=None, help="Plan for a hardware profile (name or TOML) instead of this machine.")
@click.option("--limit", type=click.IntRange(min=1), default=10, show_default=True, help="Candidates to show.")
@STORE_OPTION
def plan_cmd(plugin, workload, nproc, hardware, limit, store_dir):
    """Print PLUGIN's diagnosis and ranked candidates for WORKLOAD with predicted step times.

    Runs no trials. A baseline measured by an earlier `tunekit auto` with the
    same settings is used when the store has one.
    """
    records = load_all()
    tuner = select(records, [plugin])[plugin]
    store = Store.open_default(store_dir)
    try:
        static = observe_static(workload, nproc, "auto", hardware, store)
        study, base_row = _stored_baseline(store, static, nproc, hardware)
        baseline = Measurement(**base_row.result["measurement"]) if base_row else None
        obs = static.observation(nproc, baseline, store)
        if base_row is not None:
            obs.breakdown, obs.telemetry = observed_baseline(base_row)
        diag = tuner.diagnose(obs)
        candidates = tuner.plan(obs, limit) if diag.applies else []
        tried = []
        if study is not None:
            tuners = {r.name: r.tuner for r in records if r.ok}
            rows = report_data(store, study.id, tuners, LaunchOptions(nproc=nproc))["trials"]
            tried = [t for t in rows if t["plugin"] == tuner.name]
    finally:
        store.close()
    console.print(f"[bold]{tuner.name}[/] — {tuner.title} · {static.spec} on {nproc} × {static.hardware.name}")
    truth = obs.truth
    if truth is None:
        console.print("[dim]no measured baseline in the store for these settings (run `tunekit auto` first); "
                      "predictions use the model alone[/]")
    else:
        console.print(f"measured baseline (study {study.id}): {truth.describe()}")
    console.print(("[green]applies[/]: " if diag.applies else "[yellow]does not apply[/]: ") + diag.summary)
    if not candidates:
        return
    defaults = {tuner.name: tuner.defaults()}
    table = Table(title="candidates, best predicted first", title_justify="left")
    for col in ("#", "config", "predicted step", "why"):
        table.add_column(col)
    for i, c in enumerate(candidates, 1):
        cfg = TuningConfig({tuner.name: tuner.validate(c.knobs)})
        pred = "—" if c.predicted_step_s is None else f"{c.predicted_step_s * 1e3:.1f} ms"
        table.add_row(str(i), cfg.describe(defaults), pred, c.rationale)
    console.print(table)
    if tried:
        console.print(trials_table(tried, title=f"{tuner.name}'s trials in study {study.id}"))
    text = tuner.explain(candidates[0])
    if text:
        console.print(Markdown(f"**Best candidate in detail**\n\n{text}"))


def _stored_baseline(store: Store, static, nproc: int, hardware: str | None):
    """The newest study with the same model, hardware and settings, and its first successful
    baseline trial (None, None when there is none)."""
    settings = AutoSettings(workload=static.spec, nproc=nproc, hardware=hardware).study_settings()
    key = study_key(static.graph_hash, static.hardware.fingerprint(), settings)
    study = store.latest_study(key)
    if study is None:
        return None, None
    for t in store.trials(study.id):
        if t.role == "baseline" and t.status == "ok" and t.result and t.result.get("measurement"):
            return study, t
    return None, None
