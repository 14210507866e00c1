"""The project's shape: one-way dependencies, the package list, the lint."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_never_imports_the_tui_or_a_plugin():
    offenders = []
    for path in (ROOT / "tunekit").rglob("*.py"):
        for name in _imports(path):
            if name.startswith(("tunekit.tui", "tunekit.plugins", "tui", "plugins")):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def test_the_tui_calls_the_core_not_the_cli():
    """What the CLI and the TUI share lives in the core (docs/architecture.md); only the TUI's own
    command, tui/cli.py, uses the CLI's shared options."""
    offenders = []
    for path in (ROOT / "tui").rglob("*.py"):
        if path == ROOT / "tui" / "cli.py":
            continue
        for name in _imports(path):
            if name.startswith("tunekit.cli"):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def test_plugins_never_import_each_other_or_the_tui():
    offenders = []
    for plugin in (p for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists()):
        for path in plugin.rglob("*.py"):
            for name in _imports(path):
                other = name.startswith("tunekit.plugins.") and not name.startswith(
                    f"tunekit.plugins.{plugin.name}"
                )
                if other or name.startswith("tunekit.tui"):
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


PLUGIN_SURFACE = ("tunekit.api", "tunekit.contract", "tunekit.errors")
"""The core modules plugin code may import (tests may import anything)."""


def _plugin_code() -> list[tuple[Path, str]]:
    """(file, the plugin's own package) for the built-in plugins and the example plugin."""
    out = []
    for plugin in (p for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists()):
        out += [(f, f"tunekit.plugins.{plugin.name}") for f in plugin.rglob("*.py")]
    example = ROOT / "examples" / "tunekit-dataloader" / "tunekit_dataloader"
    out += [(f, "tunekit_dataloader") for f in example.rglob("*.py")]
    return [(f, own) for f, own in out if "tests" not in f.parts]


def test_plugin_code_imports_only_the_plugin_api():
    offenders = []
    for path, own in _plugin_code():
        for name in _imports(path):
            core = name == "tunekit" or name.startswith("tunekit.")
            allowed = name == own or name.startswith(f"{own}.") or name in PLUGIN_SURFACE
            if core and not allowed:
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert _plugin_code(), "no plugin code found"
    assert not offenders, offenders


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    mapping = {"tunekit": "tunekit", "tui": "tunekit.tui", "plugins": "tunekit.plugins"}
    found = set()
    for top, dotted in mapping.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            if "tests" in rel or "__pycache__" in rel:
                continue
            found.add(".".join((dotted, *rel)))
    assert found == listed, f"missing: {sorted(found - listed)}; stale: {sorted(listed - found)}"


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff not installed",
)
def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    res = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff not installed",
)
def test_ruff_format_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    res = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]


@pytest.mark.slow
def test_the_core_and_the_plugin_api_type_check():
    """mypy over tunekit/ (configured in pyproject.toml), the plugin API included."""
    pytest.importorskip("mypy")
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
