"""Workload names (``path/file.py:fn``, ``package.module:fn``, ``example:NAME``), checked
without importing torch: a command given a missing file says so at once, not after the
seconds torch takes to load (:mod:`tunekit.workload` builds the workload itself)."""

from __future__ import annotations

from pathlib import Path

from tunekit.errors import WorkloadError
from tunekit.examples import check_example

__all__ = ["EXAMPLE_PREFIX", "resolve_spec"]

EXAMPLE_PREFIX = "example:"


def resolve_spec(spec: str) -> str:
    """Normalise a workload name so that it means the same in every process.

    File paths become absolute (workers may not share the caller's directory).
    """
    spec = spec.strip()
    if spec.startswith(EXAMPLE_PREFIX):
        check_example(spec[len(EXAMPLE_PREFIX) :])
        return spec
    target, fn = _split(spec)
    if _is_file(target):
        path = Path(target).expanduser()
        if not path.is_file():
            raise WorkloadError(f"workload file {target} not found")
        return f"{path.resolve()}:{fn}"
    return spec


def _split(spec: str) -> tuple[str, str]:
    target, sep, fn = spec.rpartition(":")
    if not sep or not target or not fn or not fn.isidentifier():
        raise WorkloadError(
            f"workload {spec!r} is not of the form path/file.py:fn, package.module:fn "
            "or example:NAME"
        )
    return target, fn


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target
