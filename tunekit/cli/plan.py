"""``tunekit plan PLUGIN WORKLOAD``: a tuner's diagnosis and ranked candidates, no trials."""

from __future__ import annotations

import click
from rich.markdown import Markdown
from rich.table import Table

from tunekit.cli.common import STORE_OPTION, console
from tunekit.config import TuningConfig
from tunekit.examples import DEFAULT_EXAMPLE
from tunekit.observe.observation import Measurement
from tunekit.orchestrator import AutoSettings, observe_static, study_key
from tunekit.plugin_loading import load_all, select
from tunekit.store import Store


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
    tuner = select(load_all(), [plugin])[plugin]
    store = Store.open_default(store_dir)
    try:
        static = observe_static(workload, nproc, "auto", hardware, store)
        baseline = _stored_baseline(store, static, nproc, hardware)
        obs = static.observation(nproc, baseline, store)
        diag = tuner.diagnose(obs)
        candidates = tuner.plan(obs, limit) if diag.applies else []
    finally:
        store.close()
    console.print(f"[bold]{tuner.name}[/] — {tuner.title} · {static.spec} on {nproc} × {static.hardware.name}")
    if baseline is None:
        console.print("[dim]no measured baseline in the store for these settings; predictions use the model alone[/]")
    else:
        console.print(f"measured baseline: {baseline.median_s * 1e3:.1f} ms per step")
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
    text = tuner.explain(candidates[0])
    if text:
        console.print(Markdown(f"**Best candidate in detail**\n\n{text}"))


def _stored_baseline(store: Store, static, nproc: int, hardware: str | None) -> Measurement | None:
    """The newest successful baseline of a study with the same model, hardware and settings."""
    settings = AutoSettings(workload=static.spec, nproc=nproc, hardware=hardware).study_settings()
    key = study_key(static.graph_hash, static.hardware.fingerprint(), settings)
    study = store.latest_study(key)
    if study is None:
        return None
    for t in store.trials(study.id):
        if t.role == "baseline" and t.status == "ok" and t.result and t.result.get("measurement"):
            return Measurement(**t.result["measurement"])
    return None
