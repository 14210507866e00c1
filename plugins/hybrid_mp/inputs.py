"""What hybrid_mp reads from the job: the traced model, DLPlacer's op graph and where
Δ(k) came from, E_N and SE_N, the M worth placing, B per replica, threads per rank,
transformer blocks, and T_1, the one-device step the paper's decision starts from."""

from __future__ import annotations

import torch

from tunekit.api import LayerProfile, Observation, Session, graph_units, trace_model
from tunekit.errors import ConfigError
from tunekit.plugins.hybrid_mp.convergence import (
    allreduce_model,
    estimate_noise_scale,
    measure_epochs,
    noise_scale_epochs,
)
from tunekit.plugins.hybrid_mp.model import (
    EpochTable,
    OpGraph,
    modelled_scaling_efficiency,
    op_graph_from_model,
    optimizer_state_factor,
    unit_scaling,
)
from tunekit.plugins.hybrid_mp.options import HybridOptions


def model_graph(obs: Observation, strict: bool = True):
    """The observation's traced graph at the per-rank batch, tracing the model if needed
    (``strict``: refusing any graph but a torch.fx one)."""
    b = obs.workload.batch_size
    graph = obs.graph
    if graph is None:
        x, _ = obs.workload.example_batch(min(b, 2))
        graph = trace_model(obs.workload.model(), x, batch_size=b)
    if strict and graph.method != "fx":
        raise ConfigError(
            f"hybrid_mp needs a torch.fx-traceable model to see its branches ({graph.notice})"
        )
    return graph


def session_graph(session: Session):
    """The session's model traced at its batch on a worker; only a torch.fx graph will do."""
    x, _ = session.workload.example_batch(min(session.batch_size, 2))
    graph = trace_model(session.model, x, batch_size=session.batch_size)
    if graph.method != "fx":
        raise ConfigError(f"hybrid_mp needs a torch.fx-traceable model ({graph.notice})")
    return graph


def op_graph(obs: Observation, opts: HybridOptions) -> tuple[OpGraph, str]:
    """DLPlacer's op graph of the job, and where Δ(k) came from (``measured``,
    ``measured (CPU time)`` or ``analytic``)."""
    graph = model_graph(obs)
    b = obs.workload.batch_size
    state = optimizer_state_factor(
        type(obs.workload.optimizer([torch.zeros(1, requires_grad=True)], 1.0)).__name__
    )
    prof = usable_profile(obs)
    if prof is not None:
        # measured at the profile's batch; op_graph_from_model scales from the graph's batch
        rescale = graph.batch_size / prof.batch_size
        measured = {
            name: (t.forward_s * rescale, t.backward_s * rescale) for name, t in prof.layers.items()
        }
        og = op_graph_from_model(
            graph, measured=measured, peak_flops=_peak(obs), batch_size=b, state_factor=state
        )
        return og, profile_source(prof)
    og = op_graph_from_model(
        graph,
        peak_flops=_peak(obs),
        efficiency=opts.compute_efficiency,
        batch_size=b,
        state_factor=state,
    )
    return og, "analytic"


def usable_profile(obs: Observation):
    """The observation's layer profile when it was measured on this machine, else None."""
    prof = obs.layer_profile
    if prof is None or prof.hardware_fingerprint not in (
        "",
        obs.hardware.fingerprint(),
    ):
        return None
    return prof


def profile_source(prof: LayerProfile) -> str:
    """Where Δ(k) came from: ``measured`` (wall clock) or ``measured (CPU time)``.

    The core times layers of CPU ranks on the thread's CPU clock where it can (the
    profile's ``clock``), so a shared machine's preemption does not skew them layer by
    layer; the calibration then scales that work to the measured compute.
    """
    return "measured" if prof.clock == "wall" else "measured (CPU time)"


def _peak(obs: Observation) -> float:
    return obs.hardware.devices[0].peak_flops


def epoch_table(obs: Observation, opts: HybridOptions, widths: list[int]) -> EpochTable | None:
    """E_N from the workload's table, the gradient noise scale, or short measured runs."""
    if opts.epochs_from == "table":
        return EpochTable(opts.epochs, source="user") if opts.epochs else None
    if opts.epochs_from == "noise_scale":
        noise = estimate_noise_scale(obs.workload)
        return noise_scale_epochs(noise.b_noise, step_batch(obs), widths)
    table, _ = measure_epochs(obs.workload, widths, opts.target_loss)
    return table


def scaling(obs: Observation, opts: HybridOptions, step_s: float, grad_bytes: float):
    se = opts.scaling_efficiency
    if se == "paper":
        return unit_scaling
    if se == "model":
        return modelled_scaling_efficiency(step_s, grad_bytes, allreduce_model(obs.hardware))
    table = {int(k): float(v) for k, v in se.items()}
    return lambda n: 1.0 if n <= 1 else table[n] if n in table else _missing_se(n, table)


def _missing_se(n: int, table: dict[int, float]) -> float:
    raise ConfigError(f"scaling_efficiency gives SE_N for N = {sorted(table)}, not N = {n}")


def mp_degrees(obs: Observation, opts: HybridOptions) -> list[int]:
    """The M worth placing: divisors of the budget the hardware has devices for."""
    g = obs.nproc
    cap = min(opts.max_mp, len(obs.hardware.devices), g)
    return [m for m in range(2, cap + 1) if g % m == 0]


def step_batch(obs: Observation) -> int:
    """Samples a data-parallel replica trains per optimizer step: the batch times the
    micro-batches accumulated (B in the paper's global batch N × B)."""
    return obs.workload.batch_size * obs.workload.accumulation


def threads_per_rank(obs: Observation) -> int:
    """Intra-op threads of each rank: as the layers were timed, else the host's share."""
    prof = obs.layer_profile
    if prof is not None and prof.torch_threads:
        return prof.torch_threads
    return max(1, obs.hardware.host.cores // max(obs.nproc, 1))


def op_units(og: OpGraph, graph) -> dict[str, str] | None:
    """Op -> the transformer block it lies in (its own name outside one), or None when the
    model has no transformer blocks (:func:`tunekit.observe.blocks.graph_units`)."""
    units = graph_units(graph)
    if units is None:
        return None
    return {op.name: units.get(op.members[0], op.name) for op in og.ops}


def paper_step_1(obs: Observation, opts: HybridOptions, og: OpGraph, grad_bytes: float) -> float:
    """T_1, one device's step as the paper's decision takes it: the measured G-rank baseline
    less its modelled gradient exchange (T_G = T_1 + all-reduce), or Σ Δ(k)."""
    if obs.baseline is None:
        return og.serial_time()
    step_1 = obs.baseline.median_s
    if opts.scaling_efficiency == "model":
        exchange = allreduce_model(obs.hardware)(grad_bytes, obs.nproc)
        step_1 = max(step_1 - exchange, 0.05 * step_1)
    return step_1
