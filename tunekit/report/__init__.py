"""Study reports: Markdown, JSON, the best config, a plot and a ready-to-use snippet.

Everything is rebuilt from the study store, so ``tunekit report`` re-prints a
past study exactly as ``tunekit auto`` wrote it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunekit.contract import Tuner
from tunekit.report.data import report_data
from tunekit.report.markdown import render_markdown
from tunekit.report.plot import plot_trials
from tunekit.store import Store
from tunekit.trials.launcher import LaunchOptions

__all__ = ["report_data", "write_report"]


def write_report(
    store: Store,
    study_id: int,
    out_dir: Path,
    tuners: Mapping[str, Tuner],
    launch: LaunchOptions | None = None,
) -> dict[str, Path]:
    """Write report.md, report.json, best_config.json, trials.png and best_config.md into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "report_md": out_dir / "report.md",
        "report_json": out_dir / "report.json",
        "best_config": out_dir / "best_config.json",
        "snippet": out_dir / "best_config.md",
        "plot": out_dir / "trials.png",
    }
    data = report_data(
        store,
        study_id,
        tuners,
        launch or LaunchOptions(nproc=store.study(study_id).nproc),
        config_path=from_here(paths["best_config"]),
    )
    plot_trials(data, paths["plot"])
    paths["report_md"].write_text(render_markdown(data, plot_name=paths["plot"].name))
    paths["report_json"].write_text(json.dumps(data, indent=2, default=_json_default))
    paths["best_config"].write_text(json.dumps(data["best_config"], indent=2))
    paths["snippet"].write_text(data["snippet"])
    return paths


def from_here(path: Path) -> str:
    """``path`` as the user should type it where tunekit runs: relative to the working
    directory when it lies below it, absolute otherwise."""
    absolute = path.resolve()
    try:
        return str(absolute.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(absolute)


def _json_default(obj: Any) -> Any:
    return str(obj)
