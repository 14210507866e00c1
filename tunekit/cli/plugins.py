"""``tunekit plugins``: every installed tuner and its state."""

from __future__ import annotations

import click

from tunekit.cli.common import Table, console, styled
from tunekit.plugin_loading import load_all, slow_imports


@click.command("plugins")
@click.option("--knobs", is_flag=True, help="Also list each tuner's knobs.")
def plugins_cmd(knobs: bool) -> None:
    """List installed tuner plugins: name, aspect, title, package, status."""
    records = load_all()
    table = Table(title="tuner plugins", title_justify="left")
    for col in ("name", "aspect", "title", "package", "status"):
        table.add_column(col, no_wrap=col in ("name", "aspect"))
    for r in records:
        status = styled("[green]ok[/]") if r.ok else styled("[red]{}[/]: {}", r.status, r.error)
        table.add_row(r.name, r.aspect or "—", r.title or "—", r.package, status)
    console.print(table)
    for line in slow_imports(records):
        console.print(styled("[yellow]slow:[/] {}", line))
    if knobs:
        for r in records:
            if not r.ok or r.tuner is None:
                continue
            kt = Table(title=f"{r.name} knobs", title_justify="left")
            for col in ("knob", "type / range", "default", "live", "help"):
                kt.add_column(col)
            for k in r.tuner.knobs():
                flags = k.live + (", changes math" if k.changes_math else "")
                kt.add_row(k.name, k.describe(), str(k.default), flags, k.help)
            console.print(kt)
    if not records:
        console.print("no tuner plugins are installed")
