"""``tunekit new-plugin``: a new tuner plugin package, ready to install and run.

The generated package registers its tuner under the ``tunekit.plugins``
entry-point group (exactly as the built-in tuners do), ships one working knob
— prefetching the next batches in a background thread, a real and harmless
data-pipeline strategy — with its cost model, runtime hook and tests written
against :mod:`tunekit.testing`, so that it installs with ``pip install -e``,
shows up in ``tunekit plugins`` and runs in ``tunekit auto`` without edits.
The author then replaces the example knob with their strategy.

The generated files live in ``scaffold_template/`` beside this module, as they
will be written but named ``*.tmpl`` (so that setuptools, ruff and pytest never
take them for modules or configuration). They are plain :class:`string.Template`
text (``$name`` placeholders, ``$$`` for a literal dollar); no template engine.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from string import Template

from tunekit import API_VERSION, __version__
from tunekit.errors import PluginError, TunekitError

NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")

TEMPLATE_DIR = files("tunekit") / "scaffold_template"
"""The generated package's files (installed as package data, see pyproject.toml)."""


@dataclass(frozen=True)
class PluginNames:
    """Every name the package uses, derived from the tuner's name."""

    name: str
    """Tuner name, entry-point name and config key (``my_tuner``)."""

    @property
    def package(self) -> str:
        """Import package (``tunekit_my_tuner``)."""
        return f"tunekit_{self.name}"

    @property
    def dist(self) -> str:
        """Distribution name on an index (``tunekit-my-tuner``)."""
        return "tunekit-" + self.name.replace("_", "-")

    @property
    def class_name(self) -> str:
        """Tuner class (``MyTuner``)."""
        return "".join(part.capitalize() for part in self.name.split("_") if part) or "Tuner"

    @property
    def title(self) -> str:
        return self.name.replace("_", " ").capitalize() + " (prefetch example)"

    def substitutions(self) -> dict[str, str]:
        return {
            "name": self.name,
            "package": self.package,
            "dist": self.dist,
            "class_name": self.class_name,
            "title": self.title,
            "api_major": str(API_VERSION[0]),
            "tunekit_version": __version__,
        }


def builtin_names() -> dict[str, str]:
    """Installed tuner names -> the package that registers each (``tunekit 0.1.0`` for built-ins)."""
    from tunekit.plugin_loading import _package, discover

    return {ep.name: _package(ep) for ep in discover()}


def check_name(name: str) -> PluginNames:
    """The names for ``name``; raise :class:`PluginError` if it cannot be a tuner name."""
    if not NAME_RE.match(name) or keyword.iskeyword(name):
        raise PluginError(
            f"plugin name {name!r} must be a lower-case Python identifier (letters, digits, "
            "underscores; e.g. my_tuner): it is the config key and part of the package name"
        )
    taken = builtin_names()
    if name in taken:
        owner = taken[name]
        what = (
            "a built-in tuner"
            if owner.split()[0] == "tunekit"
            else f"already registered by {owner}"
        )
        raise PluginError(f"plugin name {name!r} is {what}; choose another name")
    return PluginNames(name)


def default_dir(name: str) -> Path:
    return Path.cwd() / PluginNames(name).dist


def scaffold(name: str, directory: Path | None = None) -> list[Path]:
    """Write the package for tuner ``name`` into ``directory``; return the files written.

    ``directory`` (default ``./tunekit-<name>``) is created; if it exists it
    must be an empty folder, so nothing is ever overwritten.
    """
    names = check_name(name)
    root = Path(directory) if directory is not None else default_dir(name)
    if root.exists() and not root.is_dir():
        raise TunekitError(f"{root} exists and is not a folder; choose another --dir")
    if root.is_dir() and any(root.iterdir()):
        raise TunekitError(f"{root} exists and is not empty; choose another --dir")
    subs = names.substitutions()
    written = []
    for rel, template in _files(names).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (TEMPLATE_DIR / template).read_text(encoding="utf-8")
        path.write_text(Template(text).substitute(subs))
        written.append(path)
    return written


def _files(names: PluginNames) -> dict[str, str]:
    """Generated file -> its template in :data:`TEMPLATE_DIR`, in the order they are written."""
    pkg = names.package
    return {
        "pyproject.toml": "pyproject.toml.tmpl",
        "README.md": "README.md.tmpl",
        f"{pkg}/__init__.py": "package/__init__.py.tmpl",
        f"{pkg}/plugin.py": "package/plugin.py.tmpl",
        f"{pkg}/model.py": "package/model.py.tmpl",
        f"{pkg}/runtime.py": "package/runtime.py.tmpl",
        f"tests/test_{names.name}.py": "tests/test_name.py.tmpl",
    }
