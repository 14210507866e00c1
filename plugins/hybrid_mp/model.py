"""The cost model: DLPlacer's inputs and the time-to-converge algebra of Pal et al.

Two halves:

* **The op graph** DLPlacer places (:class:`OpGraph`): ops with their
  execution time Δ(k) and memory M(k), edges with the bytes D(e) they carry.
  :func:`op_graph_from_model` builds it from a traced
  :class:`~tunekit.observe.graph.ModelGraph`, with Δ(k) measured (a per-layer
  profile) or analytic (FLOPs / peak, as the paper did for Inception-V3).
* **The hybrid decision**: time to converge C = T × S × E (Eq. 1), the DP
  speed-up SU_N = SE_N × N × E_1/E_N (Eq. 3), the hybrid's
  SU_N^M = SU^M × SE_N × N × E_1/E_N (Eq. 5) and the threshold of Eq. 6,
  scored over every factorisation G = N × M of a device budget and against
  the best DP-only scale at or below G.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tunekit.api import ComputeRate
from tunekit.errors import ConfigError

# -- the op graph -----------------------------------------------------------------------


@dataclass
class Op:
    """A vertex k of DLPlacer's compute graph: one layer, or a chain of them after coarsening."""

    name: str
    forward_s: float
    """Δ(k): execution time of the forward pass, seconds."""
    backward_s: float = 0.0
    """Execution time of the op's backward pass; 0 in a forward-only graph."""
    memory_bytes: float = 0.0
    """M(k): bytes the op keeps on its device (weights, gradients, optimizer
    state, activations saved for backward)."""
    members: list[str] = field(default_factory=list)
    """Layer names this op stands for (itself when empty)."""
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [self.name]
        if self.forward_s < 0 or self.backward_s < 0 or self.memory_bytes < 0:
            raise ConfigError(f"op {self.name}: times and memory must be non-negative")


@dataclass
class Edge:
    """A dependency e = (src, dst) carrying D(e) bytes (an activation; its gradient goes back)."""

    src: str
    dst: str
    nbytes: float


@dataclass
class OpGraph:
    """DLPlacer's compute DFG: ops in topological order and the edges between them."""

    ops: list[Op]
    edges: list[Edge]
    training: bool = False
    """Schedule a training step: every op's backward task follows, gradients flow back
    along the edges. False schedules the forward graph alone (the paper's small cases)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        pos = {op.name: i for i, op in enumerate(self.ops)}
        if len(pos) != len(self.ops):
            raise ConfigError("op graph: op names must be unique")
        for e in self.edges:
            if e.src not in pos or e.dst not in pos:
                raise ConfigError(f"op graph: edge {e.src}->{e.dst} names an unknown op")
            if pos[e.src] >= pos[e.dst]:
                raise ConfigError(
                    f"op graph: edge {e.src}->{e.dst} goes against the op order "
                    "(ops must be listed in topological order)"
                )
            if e.nbytes < 0:
                raise ConfigError(f"op graph: edge {e.src}->{e.dst} has negative bytes")

    def index(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}

    def op(self, name: str) -> Op:
        return self.ops[self.index()[name]]

    def serial_time(self) -> float:
        """Σ_k Δ(k): the step on one device, the numerator of SU^M."""
        return sum(op.forward_s + (op.backward_s if self.training else 0.0) for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ops": [asdict(o) for o in self.ops],
            "edges": [asdict(e) for e in self.edges],
            "training": self.training,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpGraph:
        return cls(
            [Op(**o) for o in d["ops"]], [Edge(**e) for e in d["edges"]], bool(d.get("training"))
        )


# -- Δ(k), M(k), D(e) from a traced model ------------------------------------------------


def optimizer_state_factor(optimizer_name: str) -> int:
    """Tensors of optimizer state per parameter: SGD with momentum 1, Adam 2, plain SGD 0."""
    name = optimizer_name.lower()
    if "adam" in name or "lamb" in name:
        return 2
    if "sgd" in name or "rmsprop" in name or "adagrad" in name:
        return 1
    return 2  # unknown: assume the larger common case


def op_graph_from_model(
    graph,
    *,
    peak_flops: float | None = None,
    efficiency: float = 1.0,
    measured: Mapping[str, tuple[float, float]] | None = None,
    batch_size: int | None = None,
    training: bool = True,
    state_factor: int = 1,
) -> OpGraph:
    """DLPlacer's op graph of a :class:`~tunekit.observe.graph.ModelGraph`, one op per layer.

    Δ(k) is ``measured[layer] = (forward_s, backward_s)`` where given, else
    analytic: FLOPs / (``peak_flops`` × ``efficiency``) forward and
    :data:`tunekit.costmodel.BACKWARD_FLOPS_RATIO` times that backward (the paper used FLOPs /
    advertised peak for Inception-V3). M(k) = parameters × (weights + gradients
    + ``state_factor`` optimizer tensors) + the layer's output, kept for
    backward. D(e) = the producer layer's output bytes. Shapes, bytes and FLOPs
    scale linearly from the trace batch to ``batch_size``. The graph's input and
    output layers are left out: every device can read the input batch, and the
    loss is computed where the last layer runs.
    """
    if measured is None and not peak_flops:
        raise ConfigError("op graph: give measured layer times or the device's peak FLOP/s")
    if efficiency <= 0 or efficiency > 1:
        raise ConfigError(f"op graph: efficiency must be in (0, 1], not {efficiency}")
    scale = 1.0 if batch_size is None else batch_size / graph.batch_size
    skip = {name for name, lay in graph.layers.items() if lay.kind in ("input", "output")}
    ops: list[Op] = []
    for name, lay in graph.layers.items():
        if name in skip:
            continue
        if measured is not None and name in measured:
            fwd, bwd = measured[name]
            fwd, bwd = fwd * scale, bwd * scale
        elif peak_flops:
            fwd, bwd = ComputeRate.assumed(peak_flops, efficiency).forward_backward_s(
                lay.flops * scale
            )
        else:
            raise ConfigError(f"op graph: no measured time for layer {name} and no peak FLOP/s")
        memory = lay.param_bytes * (2 + state_factor) + lay.activation_bytes * scale
        ops.append(
            Op(
                name=name,
                forward_s=fwd,
                backward_s=bwd if training else 0.0,
                memory_bytes=memory,
                members=[name],
                kind=lay.kind,
            )
        )
    edges = [
        Edge(src, dst, graph.layers[src].activation_bytes * scale)
        for src, dst in graph.layer_edges()
        if src not in skip and dst not in skip
    ]
    return OpGraph(ops, edges, training=training)


# -- the hybrid decision (Section 3) --------------------------------------------------------


@dataclass
class EpochTable:
    """E_N: epochs to converge at global batch N × B, by data-parallel width N.

    Between measured widths E is interpolated linearly in log(N) – log(E)
    (the paper's Figure 4 is plotted on log axes); outside them it is not
    extrapolated. ``source`` says where the numbers came from (``user``,
    ``measured``, ``noise-scale``).
    """

    epochs: dict[int, float]
    source: str = "user"

    def __post_init__(self) -> None:
        if not self.epochs:
            raise ConfigError("epoch table: needs at least one (N, epochs) entry")
        clean: dict[int, float] = {}
        for n, e in self.epochs.items():
            n_int = int(n)
            if n_int < 1 or float(n) != n_int:
                raise ConfigError(f"epoch table: width {n!r} must be a positive integer")
            if not (e > 0 and math.isfinite(e)):
                raise ConfigError(f"epoch table: epochs at N={n_int} must be positive, not {e!r}")
            clean[n_int] = float(e)
        self.epochs = dict(sorted(clean.items()))

    @property
    def widths(self) -> list[int]:
        return list(self.epochs)

    def covers(self, n: int) -> bool:
        return self.widths[0] <= n <= self.widths[-1] or n in self.epochs

    def __call__(self, n: int) -> float:
        if n in self.epochs:
            return self.epochs[n]
        ws = self.widths
        if not ws[0] <= n <= ws[-1]:
            raise ConfigError(
                f"epoch table ({self.source}) covers N = {ws[0]}..{ws[-1]}, not N = {n}: "
                "measure or give E_N there"
            )
        hi = next(w for w in ws if w > n)
        lo = max(w for w in ws if w < n)
        t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return math.exp((1 - t) * math.log(self.epochs[lo]) + t * math.log(self.epochs[hi]))

    @property
    def e1(self) -> float:
        """E_1; when the table starts above N = 1, its first entry stands in for it (ratios
        between configurations, which decide, do not depend on it)."""
        return self.epochs.get(1, self.epochs[self.widths[0]])

    def to_dict(self) -> dict[str, Any]:
        return {"epochs": {str(k): v for k, v in self.epochs.items()}, "source": self.source}


ScalingEfficiency = Callable[[int], float]
"""SE_N = T_1 / T_N for N-way data parallelism."""


def unit_scaling(_n: int) -> float:
    """The paper's conservative SE_N = 1 (Section 4.3)."""
    return 1.0


def dp_speedup(n: int, epochs: EpochTable, se: ScalingEfficiency = unit_scaling) -> float:
    """Eq. 3: SU_N = SE_N × N × E_1 / E_N."""
    return se(n) * n * epochs.e1 / epochs(n)


def hybrid_speedup(
    n: int, m: int, su_m: float, epochs: EpochTable, se: ScalingEfficiency = unit_scaling
) -> float:
    """Eq. 5: SU_N^M = SU^M × SE_N × N × E_1 / E_N (the global batch stays N × B)."""
    if m == 1:
        return dp_speedup(n, epochs, se)
    return su_m * dp_speedup(n, epochs, se)


def eq6_threshold(
    n: int, m: int, epochs: EpochTable, se: ScalingEfficiency = unit_scaling
) -> float:
    """Eq. 6: hybrid (N-way DP of M-way MP) beats M×N-way DP iff SU^M > M × SE_MN/SE_N × E_N/E_MN."""
    return m * se(m * n) / se(n) * epochs(n) / epochs(m * n)


def implied_epoch_ratio(su_m: float, m: int, gain: float) -> float:
    """E_MN / E_N at which N×M hybrid beats M×N DP by ``gain`` (SE = 1): (1 + gain) × M / SU^M.

    GNMT: SU² = 1.15 and an 8 % gain need E_256 / E_128 = 1.08 × 2 / 1.15 = 1.878.
    """
    return (1.0 + gain) * m / su_m


@dataclass
class DecisionRow:
    """One way of using (up to) G devices."""

    devices: int
    """Devices used: N × M."""
    dp: int
    """N: data-parallel width (global batch N × B)."""
    mp: int
    """M: devices per model-parallel worker (1 = DP only)."""
    su_m: float
    """SU^M, the per-step speed-up of one M-device worker (1 for DP)."""
    speedup: float
    """Time-to-converge speed-up over one device (Eq. 3 or 5)."""
    threshold: float | None
    """Eq. 6's right-hand side against M×N-way DP (None for DP rows or when E_MN is unknown)."""
    note: str = ""


@dataclass
class Decision:
    """The scored factorisations of a device budget and the winner."""

    budget: int
    rows: list[DecisionRow]
    best: DecisionRow
    best_dp: DecisionRow
    """The best DP-only scale at or below the budget."""

    @property
    def gain_over_dp(self) -> float:
        """Speed-up of the best configuration over the best DP-only scale (1.22 for BigLSTM)."""
        return self.best.speedup / self.best_dp.speedup

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "rows": [asdict(r) for r in self.rows],
            "best": asdict(self.best),
            "best_dp": asdict(self.best_dp),
            "gain_over_dp": self.gain_over_dp,
        }


def decide(
    budget: int,
    su: Mapping[int, float],
    epochs: EpochTable,
    se: ScalingEfficiency = unit_scaling,
) -> Decision:
    """Score every factorisation ``budget = N × M`` with ``M`` in ``su`` and every DP width ≤ budget.

    ``su`` maps M to SU^M (measured, or DLPlacer's prediction); M = 1 is DP.
    DP widths are the epoch table's widths at or below the budget plus the
    budget itself when the table covers it (BigLSTM's best DP scale is 16 on a
    32-GPU budget). Ties go to the configuration with fewer model-parallel devices.
    """
    if budget < 1:
        raise ConfigError(f"device budget must be at least 1, not {budget}")
    rows: list[DecisionRow] = []
    dp_widths = sorted(
        {w for w in epochs.widths if w <= budget} | ({budget} if epochs.covers(budget) else set())
    )
    if not dp_widths:
        raise ConfigError(
            f"epoch table starts at N = {epochs.widths[0]}, above the budget {budget}"
        )
    for n in dp_widths:
        rows.append(DecisionRow(n, n, 1, 1.0, dp_speedup(n, epochs, se), None, "DP only"))
    for m in sorted(su):
        if m <= 1 or budget % m:
            continue
        n = budget // m
        if not epochs.covers(n):
            continue
        thr = eq6_threshold(n, m, epochs, se) if epochs.covers(m * n) else None
        verdict = ""
        if thr is not None:
            verdict = "hybrid wins (Eq. 6)" if su[m] > thr else "DP wins (Eq. 6)"
        rows.append(
            DecisionRow(
                budget, n, m, float(su[m]), hybrid_speedup(n, m, su[m], epochs, se), thr, verdict
            )
        )
    best_dp = max((r for r in rows if r.mp == 1), key=lambda r: (r.speedup, -r.devices))
    best = max(rows, key=lambda r: (round(r.speedup, 12), -r.mp, -r.devices))
    return Decision(budget=budget, rows=rows, best=best, best_dp=best_dp)


def modelled_scaling_efficiency(
    step_s: float, grad_bytes: float, allreduce: Callable[[float, int], float]
) -> ScalingEfficiency:
    """SE_N = T_1 / (T_1 + all-reduce time of the gradients at N), no overlap assumed.

    A pessimistic model (gradient reduction fully exposed); the paper's
    default is SE_N = 1 (:func:`unit_scaling`), the optimistic end.
    """

    def se(n: int) -> float:
        if n <= 1:
            return 1.0
        return step_s / (step_s + allreduce(grad_bytes, n))

    return se
