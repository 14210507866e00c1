"""Finding the plan: elimination over the cost tables, restricted spaces, the plan table.

Four plans are compared, as in the paper's Figure 7 and Tables 2-3:

* ``best``  -- the optimum of Eq. 1 over the full config space (DeePa);
* ``image_search`` -- the optimum when every op may only split samples (fewer workers allowed);
* ``image`` -- image parallelism: every op split over samples on all devices (DDP);
* ``owt`` -- Krizhevsky's "one weird trick": convolutions and pools image-parallel on all
  devices, fully-connected layers channel-parallel on all devices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tunekit.api import CostGraph, EliminationStats, solve_elimination
from tunekit.errors import ConfigError
from tunekit.plugins.layer_split.model import SplitConfig, Tables

SPACES = ("best", "image_search", "image", "owt")
SPACE_TITLES = {
    "best": "DeePa (full space)",
    "image_search": "image-only search",
    "image": "image parallelism",
    "owt": "OWT",
    "calibrated": "calibrated optimum (this executor)",
}


@dataclass
class PlanRow:
    layer: str
    kind: str
    config: SplitConfig
    compute_s: float
    xfer_s: float
    """Transfers INTO this layer (sum over its input edges)."""
    update_s: float
    xfer_bytes: float
    update_bytes: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.xfer_s + self.update_s


@dataclass
class Plan:
    """One config per layer, with its Eq. 1 breakdown."""

    space: str
    configs: dict[str, SplitConfig]
    rows: list[PlanRow]
    stats: EliminationStats | None = field(default=None, repr=False)

    @property
    def cost_s(self) -> float:
        return sum(r.total_s for r in self.rows)

    def totals(self) -> dict[str, float]:
        return {
            "compute_s": sum(r.compute_s for r in self.rows),
            "xfer_s": sum(r.xfer_s for r in self.rows),
            "update_s": sum(r.update_s for r in self.rows),
            "total_s": self.cost_s,
            "xfer_bytes": sum(r.xfer_bytes for r in self.rows),
            "update_bytes": sum(r.update_bytes for r in self.rows),
        }

    def encode(self) -> str:
        """The plan as the ``plan`` knob's value (JSON: layer -> config label)."""
        return encode_plan(self.configs, skip={r.layer for r in self.rows if r.kind == "input"})


def encode_plan(configs: Mapping[str, SplitConfig], skip: set[str] = frozenset()) -> str:
    """JSON ``{layer: label}``; ``skip`` leaves out layers every rank holds whole (the input)."""
    return json.dumps(
        {k: c.label() for k, c in configs.items() if k not in skip}, separators=(",", ":")
    )


def decode_plan(text: str) -> dict[str, SplitConfig]:
    """Inverse of :func:`encode_plan`; one clear line on a malformed value."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"layer_split.plan: not a plan name or JSON object ({exc})") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise ConfigError('layer_split.plan: expected {"layer": "n2", ...}')
    try:
        return {k: SplitConfig.parse(v) for k, v in data.items()}
    except Exception as exc:
        raise ConfigError(f"layer_split.plan: {exc}") from None


# -- restricted spaces -----------------------------------------------------------------


def _largest(space: list[SplitConfig], key) -> int:
    """Index of the config with the most workers along ``key`` (ties: fewest other splits)."""
    return max(range(len(space)), key=lambda i: (key(space[i]), -space[i].workers))


def allowed_indices(kind: str, configs: list[SplitConfig], space: str) -> list[int]:
    """Indices of the configs a layer of ``kind`` may take in ``space``."""
    if space == "best":
        return list(range(len(configs)))
    if space == "image_search":
        return [i for i, c in enumerate(configs) if c.c == c.h == c.w == 1]
    if space == "image" or (space == "owt" and kind != "linear"):
        return [_largest(configs, lambda c: (c.c == c.h == c.w == 1, c.n))]
    if space == "owt":
        return [_largest(configs, lambda c: (c.n == c.h == c.w == 1, c.c))]
    raise ConfigError(f"layer_split: unknown plan space {space!r}; one of {', '.join(SPACES)}")


def allowed(tables: Tables, space: str) -> dict[str, list[int]]:
    """Indices of the configs each layer may take in ``space``."""
    return {v: allowed_indices(tables.specs[v].kind, cs, space) for v, cs in tables.spaces.items()}


def named_configs(
    specs, spaces: Mapping[str, list[SplitConfig]], name: str
) -> dict[str, SplitConfig]:
    """The fixed plans ``image`` and ``owt`` for a model (no search needed)."""
    return {v: cs[allowed_indices(specs[v].kind, cs, name)[0]] for v, cs in spaces.items()}


def cost_graph(tables: Tables, space: str = "best") -> tuple[CostGraph, dict[str, list[int]]]:
    """The elimination problem of ``space``: node cost = compute + update, edges = xfer."""
    idx = allowed(tables, space)
    g = CostGraph()
    for v in tables.specs:
        g.add_node(v, (tables.compute[v] + tables.update[v])[idx[v]])
    for u, v, t in tables.xfer:
        g.add_edge(u, v, t[np.ix_(idx[u], idx[v])])
    return g, idx


def search(tables: Tables, space: str = "best") -> Plan:
    """The optimum of Eq. 1 in ``space``, found exactly by elimination."""
    g, idx = cost_graph(tables, space)
    sol = solve_elimination(g)
    configs = {v: tables.spaces[v][idx[v][k]] for v, k in sol.assignment.items()}
    plan = evaluate(tables, configs, space)
    plan.stats = sol.stats
    return plan


def evaluate(tables: Tables, configs: Mapping[str, SplitConfig], space: str = "given") -> Plan:
    """Eq. 1 of a given plan, layer by layer."""
    pos = {}
    configs = {**{v: SplitConfig() for v, s in tables.specs.items() if s.replicated}, **configs}
    for v, space_v in tables.spaces.items():
        if v not in configs:
            raise ConfigError(f"layer_split: the plan has no config for layer {v!r}")
        try:
            pos[v] = space_v.index(configs[v])
        except ValueError:
            raise ConfigError(
                f"layer_split: {configs[v].label()} is not a valid config of layer {v!r} on "
                f"{tables.ndev} devices"
            ) from None
    xin = {v: 0.0 for v in tables.specs}
    xin_bytes = {v: 0.0 for v in tables.specs}
    for (u, v, t), (_, _, b) in zip(tables.xfer, tables.xfer_bytes, strict=True):
        xin[v] += float(t[pos[u], pos[v]])
        xin_bytes[v] += float(b[pos[u], pos[v]])
    rows = [
        PlanRow(
            layer=v,
            kind=tables.specs[v].kind,
            config=tables.spaces[v][pos[v]],
            compute_s=float(tables.compute[v][pos[v]]),
            xfer_s=xin[v],
            update_s=float(tables.update[v][pos[v]]),
            xfer_bytes=xin_bytes[v],
            update_bytes=float(tables.update_bytes[v][pos[v]]),
        )
        for v in tables.specs
    ]
    return Plan(space, dict(configs), rows)


def compare(tables: Tables) -> dict[str, Plan]:
    """The best plan and the three baselines it is measured against."""
    return {space: search(tables, space) for space in SPACES}


# -- output ------------------------------------------------------------------------------


def plan_details(plans: Mapping[str, Plan], tables: Tables, focus: str = "best") -> dict[str, Any]:
    """JSON-able: the ``focus`` plan's per-layer table and every plan's totals (Candidate.details)."""
    shown = plans[focus]
    totals = {name: p.totals() for name, p in plans.items()}
    ref = totals["best"]["total_s"]
    for t in totals.values():
        t["speedup_of_best"] = t["total_s"] / ref if ref > 0 else None
    return {
        "plan": focus,
        "devices": tables.ndev,
        "batch": tables.specs[next(iter(tables.specs))].shape[0],
        "rate": tables.rate.source,
        "compute": tables.compute_source,
        "xfer_model": tables.options.xfer,
        "update_model": tables.options.update,
        "rows": [
            {
                "layer": r.layer,
                "kind": r.kind,
                "config": r.config.label(),
                "workers": r.config.workers,
                "compute_s": r.compute_s,
                "xfer_s": r.xfer_s,
                "update_s": r.update_s,
                "total_s": r.total_s,
                "baseline": {
                    name: plans[name].configs[r.layer].label() for name in plans if name != focus
                },
            }
            for r in shown.rows
        ],
        "totals": totals,
        "search": shown.stats.to_dict() if shown.stats else None,
    }


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def table_rows(details: Mapping[str, Any]) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """Header, per-layer rows and totals rows of the plan table (times in ms)."""
    header = [
        "layer",
        "kind",
        "config",
        "workers",
        "compute ms",
        "xfer ms",
        "update ms",
        "total ms",
        "image",
        "owt",
    ]
    rows = [
        [
            r["layer"],
            r["kind"],
            r["config"],
            str(r["workers"]),
            _ms(r["compute_s"]),
            _ms(r["xfer_s"]),
            _ms(r["update_s"]),
            _ms(r["total_s"]),
            r["baseline"].get("image", ""),
            r["baseline"].get("owt", ""),
        ]
        for r in details["rows"]
    ]
    totals = [
        [
            SPACE_TITLES.get(name, name),
            "",
            "",
            "",
            _ms(t["compute_s"]),
            _ms(t["xfer_s"]),
            _ms(t["update_s"]),
            _ms(t["total_s"]),
            f"{t['speedup_of_best']:.2f}x" if t.get("speedup_of_best") else "",
            "",
        ]
        for name, t in details["totals"].items()
    ]
    return header, rows, totals


def render_markdown(details: Mapping[str, Any]) -> str:
    """The plan table as Markdown (for reports)."""
    header, rows, totals = table_rows(details)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("| " + " | ".join(["**totals**"] + [""] * (len(header) - 1)) + " |")
    lines += ["| " + " | ".join(r) + " |" for r in totals]
    lines.append("")
    lines.append(
        f"Rows: the {SPACE_TITLES.get(details.get('plan', 'best'), 'best')} plan. "
        f"{details['devices']} devices, global batch {details['batch']}; transfers at "
        f"{details['rate']} ({details['xfer_model']} convention); compute {details['compute']}. "
        "The last column of the totals is each plan's time over the best plan's."
    )
    return "\n".join(lines)


def render_rich(details: Mapping[str, Any]):
    """The plan table as a ``rich.table.Table`` (for ``tunekit plan layer_split``)."""
    from rich.table import Table

    header, rows, totals = table_rows(details)
    table = Table(
        title=f"layer_split plan on {details['devices']} devices "
        f"(batch {details['batch']}, {details['xfer_model']} transfers)"
    )
    for i, h in enumerate(header):
        # Wrap, never cut: a label or a number a user reads is never "…" (issue 19).
        table.add_column(h, justify="right" if 3 <= i <= 7 else "left", overflow="fold")
    for r in rows:
        table.add_row(*r)
    table.add_section()
    for r in totals:
        table.add_row(*r, style="bold" if r[0] == SPACE_TITLES["best"] else None)
    return table
