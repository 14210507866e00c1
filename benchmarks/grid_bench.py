"""What the benchmarks that set tunekit against an exhaustive grid share
(``tuner_vs_grid.py``, ``sharding_vs_grid.py``): trials recorded per sample, the grid run
interleaved with baselines, ``tunekit auto`` through the Python API, the side-by-side
rounds and the results written out. Imported by those scripts (run from the repository
root, ``benchmarks/`` is on their path)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tunekit.config import TuningConfig
from tunekit.events import Event
from tunekit.orchestrator import AutoSettings, run_auto
from tunekit.store import Store, TrialRow
from tunekit.trials.launcher import LaunchOptions, TrialSpec, run_trial_sync
from tunekit.trials.stats import compare_runs, ranks_global_batch
from tunekit.workload import resolve_spec

MiB = 2**20
BASELINE: dict = {"plugins": {}}


def describe(config: dict | None) -> str:
    """A config in words (``baseline`` for none)."""
    if not config or not config.get("plugins"):
        return "baseline"
    return TuningConfig.from_dict(config).describe()


def same_config(a: dict | None, b: dict | None) -> bool:
    """Whether two configs set the same knobs once each tuner's defaults are filled in (a
    study records every knob of a search's result; the grid names only those it moves)."""
    from tunekit.plugin_loading import load_all

    tuners = {r.name: r.tuner for r in load_all() if r.ok and r.tuner is not None}

    def full(config: dict | None) -> dict:
        plugins = TuningConfig.from_dict(config or BASELINE).plugins
        return {n: tuners[n].validate(k) if n in tuners else k for n, k in plugins.items()}

    return full(a) == full(b)


class Trials:
    """Trials of one job on 2 ranks, each recorded with its per-sample step times and its
    measured peak per rank; ``cap`` (bytes per rank) is enforced as in a study."""

    def __init__(
        self,
        spec: str,
        args,
        root: Path,
        cap: int | None = None,
        describe: Callable[[dict], str] = describe,
    ):
        self.spec, self.args, self.root, self.cap = resolve_spec(spec), args, root, cap
        self.describe = describe
        self.opts = LaunchOptions(nproc=2, timeout_s=args.timeout)
        self.count = 0
        self.baselines: list[list[float]] = []

    def run(self, config: dict) -> dict:
        self.count += 1
        out = run_trial_sync(
            TrialSpec(
                self.spec,
                config,
                warmup=self.args.warmup,
                steps=self.args.steps,
                memory_cap_bytes=self.cap,
            ),
            self.opts,
            self.root / f"trial{self.count:03d}",
        )
        peaks = [r.get("peak_bytes") for r in out.ranks if r.get("peak_bytes")]
        row = {
            "config": config,
            "status": out.status,
            "error": (out.error or "")[:200],
            "peak_bytes": max(peaks) if peaks else None,
        }
        if out.ok and out.measurement is not None:
            batch = ranks_global_batch(out.ranks)
            row["per_sample"] = [s / batch for s in out.measurement.step_s]
            row["median_s"] = out.measurement.median_s
        shown = f"{row['median_s'] * 1e3:.1f} ms/step" if "median_s" in row else out.status
        peak = f", peak {row['peak_bytes'] / MiB:.1f} MiB" if self.cap and row["peak_bytes"] else ""
        print(f"  {self.describe(config)[:90]}: {shown}{peak}", flush=True)
        return row

    def baseline(self) -> None:
        row = self.run(BASELINE)
        if "per_sample" in row:
            self.baselines.append(row["per_sample"])


def speedup(baselines: list[list[float]], runs: list[list[float]]) -> float:
    return compare_runs(baselines, runs, n_boot=500).speedup


def run_grid(trials: Trials, configs: list[dict]) -> list[dict]:
    """Every config once, shuffled (so a drift of the machine does not follow one knob),
    with a baseline run first, after every three and last; each row that ran gets its
    ``speedup`` per sample over the pooled baselines."""
    trials.baseline()
    configs = list(configs)
    random.Random(0).shuffle(configs)
    results = []
    for i, config in enumerate(configs, 1):
        results.append(trials.run(config))
        if i % 3 == 0:
            trials.baseline()
    trials.baseline()
    for r in results:
        if "per_sample" in r:
            r["speedup"] = speedup(trials.baselines, [r["per_sample"]])
    return results


def best_of(rows: list[dict]) -> dict | None:
    """The row of the largest speed-up (None: none ran)."""
    return max((r for r in rows if "speedup" in r), key=lambda r: r["speedup"], default=None)


def tunekit_auto(
    settings: AutoSettings, on_event: Callable[[Event], None] = lambda ev: None
) -> tuple[dict, list[TrialRow]]:
    """``tunekit auto`` through the Python API: the winning config and the study's trials."""

    async def drive() -> None:
        async for ev in run_auto(settings):
            on_event(ev)

    asyncio.run(drive())
    store = Store.open_default(settings.store_dir)
    try:
        study = store.latest_study()
        trials = store.trials(study.id)
        winner = (study.decision or {}).get("winner_config") or BASELINE
    finally:
        store.close()
    return winner, trials


def trials_run(trials: list[TrialRow]) -> list[TrialRow]:
    """The study's trials besides its baselines that ran (searches, candidates,
    confirmations, combinations)."""
    return [t for t in trials if t.role != "baseline" and t.status not in ("pending", "skipped")]


def side_by_side(
    trials: Trials, arms: Sequence[tuple[str, dict]], rounds: int
) -> dict[str, list[list[float]]]:
    """``rounds`` interleaved rounds of every arm (name, config): per arm, its runs' per-sample
    step times, so the arms meet on the same machine state."""
    final: dict[str, list[list[float]]] = {name: [] for name, _ in arms}
    for _ in range(rounds):
        for name, config in arms:
            row = trials.run(config)
            if "per_sample" in row:
                final[name].append(row["per_sample"])
    return final


def ratio_with_interval(
    against: list[list[float]], runs: list[list[float]]
) -> tuple[float | None, tuple[float, float] | None]:
    """``runs``' throughput over ``against``'s (> 1: ``runs`` is faster) with its 95%
    bootstrap interval; None where either has no run."""
    if not against or not runs:
        return None, None
    cmp = compare_runs(against, runs, n_boot=500)
    return cmp.speedup, (cmp.ci_low, cmp.ci_high)


def times(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def interval(v: Sequence[float] | None, dash: str = "–") -> str:
    return "" if not v else f" ({v[0]:.2f}{dash}{v[1]:.2f})"


def versus(final: dict[str, list[list[float]]], against: str, arm: str) -> float | None:
    """Arm ``arm``'s speed-up over arm ``against`` in the side-by-side rounds (None: either
    has no run)."""
    a, b = final.get(against), final.get(arm)
    return speedup(a, b) if a and b else None


def trial_arguments(ap: argparse.ArgumentParser, steps: int, warmup: int, timeout: float) -> None:
    """The options every grid benchmark takes: how each trial runs, and the final rounds."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--final-rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=timeout)


def chosen(text: str, known: Mapping[str, Any], what: str) -> list[str]:
    """The comma-separated names of ``text``, each one of ``known`` (else one line, exit)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def write_results(out: Path, name: str, results: dict[str, Any], text: str) -> None:
    """``NAME.json`` and ``NAME.md`` under ``out``; the table and the median ratio printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2, default=str))
    (out / f"{name}.md").write_text(text)
    print(text)
    ratios = [r["tunekit_vs_grid"] for r in results.values() if r["tunekit_vs_grid"]]
    if ratios:
        print("median tunekit/grid ratio:", statistics.median(ratios))
