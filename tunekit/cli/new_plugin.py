"""``tunekit new-plugin``: scaffold a tuner plugin package."""

from __future__ import annotations

from pathlib import Path

import click

from tunekit.cli.common import console
from tunekit.scaffold import PluginNames, default_dir, scaffold


@click.command("new-plugin")
@click.argument("name")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path),
    default=None,
    help="Folder to create the package in (must be new or empty) [default: ./tunekit-NAME].",
)
def new_plugin_cmd(name: str, directory: Path | None) -> None:
    """Create a tuner plugin package called NAME (a lower-case identifier, e.g. my_tuner).

    The package registers its tuner under the tunekit.plugins entry point and
    ships one working example knob with its cost model, runtime hook and
    tests (tunekit.testing), so it installs, lists and runs as it is.
    """
    written = scaffold(name, directory)
    root = Path(directory) if directory is not None else default_dir(name)
    names = PluginNames(name)
    console.print(f"created {names.dist} in {root}:")
    for path in written:
        console.print(f"  {path.relative_to(root)}")
    console.print(
        "next:\n"
        f"  pip install -e {root}\n"
        "  tunekit plugins\n"
        f"  tunekit auto example:cnn --plugins {name}\n"
        f"  pytest {root / 'tests'}"
    )
