"""trials.png: every trial's step times, predicted beside measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {
    "baseline": "#7f7f7f",
    "candidate": "#1f77b4",
    "combined": "#9467bd",
    "search": "#2ca02c",
}


def plot_trials(data: dict[str, Any], path: Path) -> None:
    import matplotlib  # here: a quarter second every command would pay otherwise

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    trials = [t for t in data["trials"] if t["step_s"]]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(data["trials"]) + 2), 4), dpi=110)
    for t in trials:
        ms = [s * 1e3 for s in t["step_s"]]
        ax.boxplot(
            [ms],
            positions=[t["seq"]],
            widths=0.5,
            patch_artist=True,
            showfliers=False,
            boxprops={"facecolor": COLOURS.get(t["role"], "#1f77b4"), "alpha": 0.6},
            medianprops={"color": "black"},
        )
    pred = [(t["seq"], t["predicted_s"] * 1e3) for t in data["trials"] if t.get("predicted_s")]
    if pred:
        ax.scatter(
            *zip(*pred, strict=True), marker="x", color="#d62728", zorder=3, label="predicted"
        )
    for t in data["trials"]:
        if t["status"] not in ("ok", "pending", "running"):
            ax.annotate(
                t["status"],
                (t["seq"], 0),
                xycoords=("data", "axes fraction"),
                ha="center",
                va="bottom",
                color="#d62728",
                fontsize=8,
            )
    base = data["headline"].get("baseline_median_s")
    if base:
        ax.axhline(
            base * 1e3,
            color=COLOURS["baseline"],
            linestyle="--",
            linewidth=1,
            label="baseline median",
        )
    ax.set_xticks([t["seq"] for t in data["trials"]])
    ax.set_xticklabels([f"{t['seq']}\n{t['role'][:4]}" for t in data["trials"]], fontsize=8)
    ax.set_ylabel("step time (ms), slowest rank")
    ax.set_title(f"study {data['study']['id']}: {data['study']['workload']}")
    if pred or base:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
