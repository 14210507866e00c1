"""``tunekit report``: re-print a past study from the store."""

from __future__ import annotations

import json
from pathlib import Path

import click

from tunekit.cli.auto import result_table
from tunekit.cli.common import STORE_OPTION, Table, console, styled, trials_table
from tunekit.plugin_loading import available_tuners
from tunekit.store import Store, load_study


@click.command("report")
@click.argument("study", required=False)
@STORE_OPTION
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Also rewrite the report files here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report data as JSON.")
@click.option("--list", "list_studies", is_flag=True, help="List the studies in the store.")
def report_cmd(study, store_dir, out_dir, as_json, list_studies):
    """Print STUDY (an id; default: the latest) from the study store."""
    db = store_dir / "tunekit.db"
    if not db.exists():
        raise click.UsageError(f"no study store at {db}; run `tunekit auto` first or pass --store")
    store = Store(db, readonly=True)  # a report never changes the store, damaged or not
    try:
        if list_studies:
            table = Table(title=f"studies in {db}", title_justify="left")
            for col in ("id", "workload", "ranks", "status", "winner"):
                table.add_column(col)
            for st in store.studies():
                table.add_row(
                    str(st.id),
                    st.workload,
                    str(st.nproc),
                    st.status,
                    (st.decision or {}).get("winner", "—"),
                )
            console.print(table)
            return
        row = load_study(store, study)
        # Only a study's report needs these (and torch): --list and errors start without them.
        from tunekit.report import report_data, write_report
        from tunekit.trials.launcher import LaunchOptions

        tuners = available_tuners()
        launch = LaunchOptions(nproc=row.nproc)
        data = report_data(store, row.id, tuners, launch)
        if out_dir is not None:
            write_report(store, row.id, out_dir, tuners, launch)
        if as_json:
            click.echo(json.dumps(data, indent=2, default=str))
            return
        st = data["study"]
        console.print(
            styled(
                "[bold]study {}[/] · {} · {} rank(s) · {}",
                st["id"],
                st["workload"],
                st["nproc"],
                st["status"],
            )
        )
        console.print(trials_table(data["trials"]))
        if data["decision"]:
            console.print(result_table(data["decision"]))
            console.print(f"decision: {data['decision'].get('reason', '')}")
        if out_dir is not None:
            console.print(f"report written to {out_dir}")
    finally:
        store.close()
