"""cgdp: CPU-GPU data parallel training (Le et al., ICPE '18).

Gradients are reduced on the host, chunk by chunk of layers, while backward
runs on; the chunk size is searched inside the job (Algorithm 1). The
diagnosis runs the paper's cost model with this job's per-layer backward
times and gradient sizes, and the hardware's host links against its peer
links, to say whether the host path should beat DDP here. Measured rates
carry 95 % intervals; a verdict that the intervals could turn says so
("too close to call") and lets the trials decide, instead of flipping from
run to run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import product
from typing import Any

import torch

from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.errors import HardwareError
from tunekit.hardware import GB, Hardware
from tunekit.observe.observation import Observation
from tunekit.observe.timing import Estimate, bandwidth_estimate
from tunekit.plugins.cgdp.model import (
    HostRates,
    MiB,
    Prediction,
    host_sum_bandwidth,
    memory_estimates,
    predict,
)
from tunekit.plugins.cgdp.runtime import CgdpSync, search_in_job
from tunekit.plugins.cgdp.search import Algorithm1, NoiseAwareChunkSearch
from tunekit.runtime.session import Session

MEASURED_SOURCES = ("local", "probe")
"""Hardware sources that describe the machine tunekit runs on (times are measured here)."""
FLOP_EFFICIENCY = 0.4
"""Fraction of peak FLOP/s assumed when backward times are estimated for another machine."""
MIN_GAIN = 0.01
"""Predicted gains below this fraction of a step are within the model's noise."""


def _cached(obs: Observation, key: str, compute):
    """``compute()``, cached in the study store when the observation has one."""
    if obs.cache is not None:
        hit = obs.cache.get(key)
        if hit is not None:
            return hit
    value = compute()
    if obs.cache is not None:
        obs.cache.put(key, value)
    return value


def _profiled_backward(obs: Observation, model, device: torch.device):
    """``t_bp`` per layer from ``obs.layer_profile`` when it was taken at the job's batch and device."""
    from tunekit.plugins.cgdp.measure import backward_times_from_profile

    profile, graph = obs.layer_profile, obs.graph
    if profile is None or graph is None:
        return None
    if getattr(profile, "batch_size", None) != obs.workload.batch_size:
        return None
    if torch.device(getattr(profile, "device", "cpu")).type != device.type:
        return None
    return backward_times_from_profile(model, graph, profile)


def _layer_times(obs: Observation, device: torch.device, local: bool) -> dict[str, Any]:
    """Per-layer ``t_bp`` and gradient bytes, and the optimizer's state bytes (JSON-able).

    On this machine: the observation's layer profile if it fits, else measured
    from gradient readiness; for a hardware profile: estimated from FLOPs.
    """
    from tunekit.plugins.cgdp.measure import estimate_backward_times, time_layer_backward

    work, target = obs.workload, obs.hardware.devices[0]
    model = work.model().to(device)
    inputs, targets = work.example_batch(work.batch_size)
    inputs, targets = inputs.to(device), targets.to(device)
    profiled = _profiled_backward(obs, model, device) if local else None
    if profiled is not None:
        times, source = profiled, "the observation's layer profile"
    elif local:
        times = time_layer_backward(model, inputs, targets, work.loss, repeats=3)
        source = "measured from gradient readiness"
    else:
        times = estimate_backward_times(
            model, inputs, targets, work.loss, target.peak_flops, FLOP_EFFICIENCY
        )
        source = f"FLOPs at {FLOP_EFFICIENCY:.0%} of {target.model}'s peak"
    opt = work.optimizer(model.parameters(), work.lr)
    work.loss(model(inputs), targets).backward()
    opt.step()
    state = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {**times.to_dict(), "state_bytes": state, "source": source}


def _measure_host(device: torch.device, local: bool) -> dict[str, Any]:
    """What this machine measures for the host path, with intervals (JSON-able, cached).

    Host adds and the sync cost always; the host link only when the hardware
    is this machine (a profile's host link is read from the profile).
    """
    from tunekit.plugins.cgdp.measure import (
        copy_bandwidths,
        host_add_bandwidth,
        measure_sync_overhead,
    )

    out: dict[str, Any] = {
        "add_per_core": host_add_bandwidth(threads=1).to_dict(),
        "sync": measure_sync_overhead(device),
    }
    if local:
        d2h, h2d = copy_bandwidths(device)
        out.update(d2h=d2h.to_dict(), h2d=h2d.to_dict())
    return out


def _profile_host_link(hw: Hardware) -> dict[str, Any]:
    """A profile's host link: its D2H fit (with the fit's interval) or its host links."""
    fit = hw.fit("d2h", 1)
    if fit is not None:
        link = bandwidth_estimate(fit)
    else:
        link = Estimate.exact(hw.host_bandwidth(hw.devices[0].name))
    return {"d2h": link.to_dict(), "h2d": link.to_dict()}


def _rate(measured: dict[str, float], end: str | None) -> float:
    """A measured bandwidth at ``end``: the median (None), its interval's ``"slow"`` or ``"fast"`` end."""
    est = Estimate.from_dict(measured)
    return {None: est.value, "slow": est.low, "fast": est.high}[end]


def _host_rates(
    obs: Observation, measured: dict[str, Any], hw: Hardware, host_end: str | None = None
) -> HostRates:
    """Copy, reduction and synchronisation rates of the host path on ``hw``.

    ``host_end`` picks the end of the host rates' intervals; the reduction's
    fit comes from ``hw`` (pass ``hw.at_end(...)`` for the ends of its interval).
    """
    nproc = obs.nproc
    # The reduction across ranks: a measured gloo fit when the hardware has one; CPU ranks on
    # this machine reduce through gloo on loopback whichever sync is used; otherwise the
    # paper's host-side sum of G contributions.
    gloo = hw.fit("all_reduce", nproc, "gloo")
    if gloo is not None:
        latency, reduce_bw, source = gloo.latency, gloo.bandwidth, "gloo all-reduce fit"
    elif obs.device_type == "cpu" and hw.source in MEASURED_SOURCES:
        big = 64 * MiB
        latency = hw.allreduce_time(0, nproc, "gloo")
        reduce_bw = big / max(hw.allreduce_time(big, nproc, "gloo") - latency, 1e-12)
        source = "loopback model"
    else:
        # The paper sums on all host cores (OpenMP). Profiles carry no host memory
        # bandwidth: this machine's per-core add rate times the host's cores (optimistic).
        latency = 0.0
        add = _rate(measured["add_per_core"], host_end)
        reduce_bw = host_sum_bandwidth(add * hw.host.cores, nproc)
        source = f"host adds on {hw.host.cores} cores at this machine's per-core rate"
    return HostRates(
        _rate(measured["d2h"], host_end),
        _rate(measured["h2d"], host_end),
        reduce_bw,
        latency,
        measured["sync"],
        source=source,
    )


def _peer(hw: Hardware, nproc: int, backend: str) -> Callable[[float], float]:
    """Seconds of one all-reduce of ``n`` bytes over the devices' peer links (the DDP baseline)."""
    return lambda nbytes: hw.allreduce_time(nbytes, nproc, backend)


def _peer_bus(hw: Hardware, nproc: int, backend: str) -> float:
    """Bus bandwidth of a large peer all-reduce: bytes each rank sends and receives per second."""
    big = 256 * MiB
    return 2 * (nproc - 1) / nproc * big / hw.allreduce_time(big, nproc, backend)


def _interval_text(est: Estimate) -> str:
    """``3.1 GB/s (1.2–9.8)`` for bytes/s, or ``3.1 GB/s`` when the interval rounds to the value."""
    value, low, high = (f"{x / GB:.1f}" for x in (est.value, est.low, est.high))
    return f"{value} GB/s" if low == high else f"{value} GB/s ({low}–{high})"


class Cgdp(Tuner):
    name = "cgdp"
    title = "CPU-GPU data parallel, host-side chunked reduction (Le et al.)"
    aspect = Aspect.GRAD_SYNC

    def knobs(self) -> list[Knob]:
        return [
            Knob(
                "chunk_size", "int", 1, "layers per chunk sent to the host together (k)", 1, 100_000
            ),
            Knob(
                "offload_optimizer",
                "bool",
                False,
                "optimizer state and step on the host (ZeRO-Offload style); saves device memory",
            ),
            Knob(
                "search",
                "choice",
                "paper",
                "in-job chunk search: the paper's Algorithm 1 or noise-aware",
                choices=("paper", "noise_aware"),
            ),
            Knob("search_step", "int", 10, "Algorithm 1 step: +1 below it, then +step", 1, 10_000),
            Knob(
                "search_range", "int", 5, "Algorithm 1 range: stop at best + step*range", 1, 10_000
            ),
            Knob("search_interval", "int", 10, "iterations timed per candidate", 2, 10_000),
        ]

    # -- diagnose / plan ---------------------------------------------------------------------

    def _prediction(self, obs: Observation) -> tuple[Prediction, dict[str, Any]]:
        from tunekit.plugins.cgdp.measure import LayerTimes

        hw, nproc = obs.hardware, obs.nproc
        local = hw.source in MEASURED_SOURCES
        cuda = obs.device_type == "cuda" and torch.cuda.is_available()
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        target = hw.devices[0]
        backend = "nccl" if target.kind == "gpu" else obs.backend
        hw.allreduce_time(1.0, nproc, backend)  # fails fast if the hardware cannot hold the job
        key = f"cgdp:layers:{obs.workload_spec}:{device}:{local}:{target.model}"
        lt = _cached(obs, key, lambda: _layer_times(obs, device, local))
        times = LayerTimes.from_dict(lt)
        measured = _cached(
            obs,
            f"cgdp:rates:v2:{hw.fingerprint()}:{device}:{local}",
            lambda: _measure_host(device, local),
        )
        if not local:
            measured = {**measured, **_profile_host_link(hw)}

        def predict_at(host_end: str | None, peer_end: str | None) -> Prediction:
            """The model with the host rates and the peer fits at the given ends of their intervals."""
            peer_hw = hw if peer_end is None else hw.at_end(peer_end)
            rates = _host_rates(obs, measured, peer_hw, host_end)
            return predict(times.t_bp, times.nbytes, rates, _peer(peer_hw, nproc, backend))

        rates = _host_rates(obs, measured, hw)
        pred = predict_at(None, None)
        facts = {
            "layers": times.names,
            "t_bp_source": lt["source"],
            "host_bw_gbs": rates.d2h_bw / GB,
            "host_bw": Estimate.from_dict(measured["d2h"]),
            "peer_allreduce_bus_gbs": _peer_bus(hw, nproc, backend) / GB,
            "peer_bus": Estimate(
                _peer_bus(hw, nproc, backend),
                _peer_bus(hw.at_end("slow"), nproc, backend),
                _peer_bus(hw.at_end("fast"), nproc, backend),
            ),
            "reduce_source": rates.source,
            "sync_overhead_us": rates.sync_s * 1e6,
            "state_bytes": lt["state_bytes"],
            "rates": rates,
            "predict_at": predict_at,
        }
        return pred, facts

    def _gain_range(self, facts: dict[str, Any], step: float) -> tuple[float, float]:
        """Lowest and highest gain over DDP across the ends of the measured intervals.

        Every combination of the host rates' ends and the peer fits' ends; the
        ends of one interval move together (a slow host copies and adds slowly).
        """
        gains = []
        for host_end, peer_end in product((None, "slow", "fast"), repeat=2):
            p = facts["predict_at"](host_end, peer_end)
            gains.append((p.ddp_s - p.best_cgdp_s) / step)
        return min(gains), max(gains)

    def _step_s(self, obs: Observation, pred: Prediction) -> float:
        if obs.baseline is not None:
            return obs.baseline.median_s
        return pred.ddp_s + pred.backprop_s / 2  # forward ~ half of backward when unmeasured

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2:
            return Diagnosis(
                False,
                "one rank: no gradient reduction to move to the host "
                "(offload_optimizer still saves device memory)",
            )
        try:
            pred, facts = self._prediction(obs)
        except HardwareError as exc:
            return Diagnosis(False, f"cannot model this hardware: {exc}")
        step = self._step_s(obs, pred)
        gain = (pred.ddp_s - pred.best_cgdp_s) / step
        low, high = self._gain_range(facts, step)
        vs_typical = (pred.typical_s - pred.best_cgdp_s) / step
        mem = memory_estimates(pred.gradient_bytes, facts["state_bytes"])
        host, peer = facts["host_bw"], facts["peer_bus"]
        if Estimate(gain, low, high).straddles(MIN_GAIN):
            verdict = "too_close"
        else:
            verdict = "gain" if gain > MIN_GAIN else "no_gain"
        details = {
            **pred.to_dict(),
            **{
                k: v
                for k, v in facts.items()
                if k not in ("rates", "predict_at", "host_bw", "peer_bus")
            },
            "host_bw_interval_gbs": [host.low / GB, host.high / GB],
            "peer_allreduce_bus_interval_gbs": [peer.low / GB, peer.high / GB],
            "step_s": step,
            "gain_vs_ddp": gain,
            "gain_vs_ddp_interval": [low, high],
            "verdict": verdict,
            "gain_vs_typical_dp": vs_typical,
            "memory_bytes": {
                k: {"device": m.device_bytes, "host": m.host_bytes} for k, m in mem.items()
            },
        }
        links = (
            f"host link {_interval_text(host)} vs peer all-reduce {_interval_text(peer)}; "
            f"{pred.gradient_bytes / MiB:.1f} MiB of gradients over {pred.num_layers} layers, "
            f"{pred.backprop_s * 1e3:.1f} ms backward"
        )
        saved = (mem["ddp"].device_bytes - mem["cgdp"].device_bytes) / MiB
        if verdict == "too_close":
            # The measured intervals hold both verdicts: the model cannot decide on this
            # machine, a trial can. "Applies" here means "worth a trial", every run alike.
            summary = (
                f"{links}; too close to call here: within the measured intervals CGDP "
                f"(best chunk {pred.best_chunk}) gains {low:+.0%} to {high:+.0%} of the step over "
                f"DDP (it must gain more than {MIN_GAIN:.0%}), so CGDP is tried and its trials "
                f"decide; it would save {saved:.0f} MiB of device memory"
            )
        elif verdict == "gain":
            summary = (
                f"{links}; CGDP with chunks of {pred.best_chunk} should save ~{gain:.0%} of the step "
                f"over DDP ({vs_typical:.0%} over reduce-after-backward) and {saved:.0f} MiB of device memory"
            )
        elif gain >= -MIN_GAIN:
            summary = (
                f"{links}; CGDP (best chunk {pred.best_chunk}) would be on par with DDP "
                f"({vs_typical:.0%} of the step faster than reduce-after-backward); "
                f"it would save {saved:.0f} MiB of device memory"
            )
        else:
            versus = (
                f"would beat reduce-after-backward by {vs_typical:.0%} of the step"
                if vs_typical > 0
                else "would not even beat reduce-after-backward"
            )
            summary = (
                f"{links}; CGDP (best chunk {pred.best_chunk}) {versus} but would cost "
                f"{-gain:.0%} of the step more than DDP: the host path is slower than the "
                f"peer links here; it would still save {saved:.0f} MiB of device memory"
            )
        return Diagnosis(
            verdict != "no_gain", summary, expected_gain=max(gain, 0.0), details=details
        )

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2:
            return []
        try:
            pred, facts = self._prediction(obs)
        except HardwareError:
            return []
        step = self._step_s(obs, pred)
        base = step - pred.ddp_s  # forward, update and the rest, as DDP runs them
        rows = sorted(pred.cgdp_s.items(), key=lambda kv: (kv[1], kv[0]))
        out = [
            Candidate(
                knobs={"chunk_size": k},
                predicted_step_s=base + t,
                rationale=f"chunks of {k}: backward {t * 1e3:.1f} ms (DDP {pred.ddp_s * 1e3:.1f} ms)",
                details={
                    "backward_s": t,
                    "backward_paper_s": pred.cgdp_paper_s[k],
                    "overhead_s": pred.overhead_s[k],
                },
            )
            for k, t in rows
        ]
        # Offload: gradients stay on the host, the host runs the optimizer (memory-bound: about
        # five passes over the parameters for momentum SGD, at the host copy rate) and the
        # parameters are copied back after it, exposed. The gradient copy-back it saves was
        # mostly hidden behind backward and is not credited.
        rates: HostRates = facts["rates"]
        k = pred.best_chunk
        params = pred.gradient_bytes
        extra = 5 * params / rates.d2h_bw + params / rates.h2d_bw
        saved = memory_estimates(params, facts["state_bytes"])
        freed = (saved["cgdp"].device_bytes - saved["cgdp+offload"].device_bytes) / MiB
        out.append(
            Candidate(
                knobs={"chunk_size": k, "offload_optimizer": True},
                predicted_step_s=base + pred.cgdp_s[k] + extra,
                rationale=f"chunks of {k} with the optimizer on the host: ~{freed:.0f} MiB less device memory",
                details={"device_bytes_saved": freed * MiB},
            )
        )
        out.sort(key=lambda c: c.predicted_step_s)
        return out[:limit]

    # -- runtime -----------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        session.set_grad_sync(
            CgdpSync(chunk_size=knobs["chunk_size"], offload_optimizer=knobs["offload_optimizer"])
        )

    def search(self, session: Session, knobs: Mapping[str, Any], max_steps: int) -> SearchResult:
        """Algorithm 1 (or its noise-aware variant) over the chunk size, inside the job."""
        sync = session.grad_sync
        if not isinstance(sync, CgdpSync):
            self.apply(session, knobs)
            sync = session.grad_sync
        step, range_, interval = (
            knobs["search_step"],
            knobs["search_range"],
            knobs["search_interval"],
        )
        if knobs["search"] == "paper":
            searcher = Algorithm1(step, range_, interval)
        else:
            searcher = NoiseAwareChunkSearch(step, range_, interval, num_layers=sync.num_layers)
        found = search_in_job(session, sync, searcher, max_steps)
        found.knobs = {**knobs, **found.knobs}
        return found
