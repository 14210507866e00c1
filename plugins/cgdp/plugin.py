"""cgdp: CPU-GPU data parallel training (Le et al., ICPE '18).

Gradients are reduced on the host, chunk by chunk of layers, while backward
runs on; the chunk size is searched inside the job (Algorithm 1).

On this machine the diagnosis starts from the measured baseline
(``obs.truth``): CGDP can only hide the communication DDP leaves exposed, and
adds its own host work. The paper's cost model, calibrated so that it
reproduces the measured DDP step (``calibrated.py``), then predicts every
chunk size and the optimizer offload as a change to that step; a prediction
carries the range its inputs' spread gives (the per-layer backward times of
resamples of the timed passes, the quartiles of the trace's all-reduce times, the probe's
intervals), and a verdict that range could turn says so ("too close to call")
and lets the trials decide, instead of flipping from run to run. For a
hardware profile (a machine one does not have) the model runs uncalibrated,
with the profile's links and backward times from FLOPs.

One module, though past 600 lines: the tuner and the words of its two
diagnoses (this machine, calibrated; a profile, uncalibrated), which quote the
same rows; the models' inputs are in ``inputs.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from itertools import product
from typing import Any

import torch

from tunekit.api import (
    GB,
    Estimate,
    Hardware,
    Observation,
    Session,
    StepTruth,
    block_units,
    compose_headline,
)
from tunekit.contract import Aspect, Candidate, Diagnosis, Knob, SearchResult, Tuner
from tunekit.errors import HardwareError
from tunekit.plugins.cgdp.calibrated import CalibratedCgdp, HostWork, calibrate
from tunekit.plugins.cgdp.inputs import (
    CACHE_VERSION,
    MEASURED_SOURCES,
    MIN_GAIN,
    gpu_host_path,
    host_rates,
    layer_times,
    measure_host_rates,
    measure_offload,
    measured_keys,
    model_truth,
    peer,
    peer_bus,
    peer_cost,
    profile_host_link,
)
from tunekit.plugins.cgdp.model import (
    HostRates,
    MiB,
    Prediction,
    candidate_chunk_sizes,
    memory_estimates,
    predict,
)
from tunekit.plugins.cgdp.runtime import CHUNK_BY, CgdpSync, search_in_job
from tunekit.plugins.cgdp.search import (
    Algorithm1,
    NoiseAwareChunkSearch,
    chunk_layout,
    unit_layout,
)


def _interval_text(est: Estimate) -> str:
    """``3.1 GB/s (1.2–9.8)`` for bytes/s, or ``3.1 GB/s`` when the interval rounds to the value."""
    value, low, high = (f"{x / GB:.1f}" for x in (est.value, est.low, est.high))
    return f"{value} GB/s" if low == high else f"{value} GB/s ({low}–{high})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _truth_lead(truth: StepTruth | None) -> str:
    """What the diagnosis starts from: the measured exposed communication, all CGDP can hide."""
    if truth is None:
        return "no measured baseline: model figures only"
    if not truth.profiled:
        return (
            f"measured step {_ms(truth.step_s)}, not profiled: how much communication DDP "
            "leaves exposed is unknown"
        )
    return (
        f"{truth.phrase('comm_exposed')}: all that CGDP can hide, and its own host work "
        "comes on top"
    )


def _model_text(f: _Fit, best: _Row) -> str:
    """The model's figures for the diagnosis, labelled as the model's and consistent with the truth."""
    m, ddp, layout = f.model, f.model.ddp(), best.timeline
    if f.obs.truth is not None:
        how = (
            f"model, calibrated on the measured {_ms(f.truth.step_s)} step (backward "
            f"{_ms(m.inputs['backward_s'])}; the layers timed alone here: "
            f"{_ms(m.inputs['layers_backward_s'])})"
        )
    else:
        how = f"model, uncalibrated (backward {_ms(m.inputs['backward_s'])} as timed here)"
    text = f"{how}: DDP's {ddp.messages} bucket(s) leave {_ms(ddp.exposed_s)} exposed"
    if m.waiting_s > 0:
        text += f" and {_ms(m.waiting_s)} is one rank waiting for the other (no scheme hides that)"
    work = best.host_work_s
    text += (
        f"; {best.label} ({layout.messages} chunk(s)) would leave {_ms(layout.exposed_s)} and "
        f"{'add' if work >= 0 else 'save'} {_ms(abs(work))} of host work"
    )
    if f.device.type == "cpu":
        during = m.costs.during
        text += (
            "; on CPU ranks CGDP's host reduction is the same gloo all-reduce as DDP's "
            f"({_ms(during.latency)} + {during.bandwidth / GB:.2f} GB/s during backward, from "
            f"{m.inputs['during']['source']}), so CGDP can only move it, not speed it up"
        )
    return text


def layer_units(obs: Observation, backward_names: list[str]) -> list[str] | None:
    """The transformer block of each timed layer (forward order), or None without blocks.
    The layers' classes come from the observed model's summary."""
    kinds = {layer.name: layer.type for layer in obs.model.layers}
    return block_units([(name, kinds.get(name, "")) for name in reversed(backward_names)])


def _truth_figure(truth: StepTruth | None) -> str:
    """The measured figure CGDP's verdict rests on: the communication DDP leaves exposed."""
    if truth is None:
        return "no measured baseline"
    if not truth.profiled:
        return "exposed communication not measured"
    return truth.phrase("comm_exposed", short=True)


VERDICT_WORDS = {"gain": "applies", "too_close": "too close to call", "no_gain": "does not apply"}


def _headline(verdict: str, gain: float, gain_range: tuple[float, float], figure: str) -> str:
    """``too close to call · −1% (−12…+11%) · exposed communication 19% of the step``: the
    model's gain over DDP as it is, negative too, with its range."""
    return compose_headline(VERDICT_WORDS[verdict], gain, gain_range, figure)


def _verdict(gain: float, low: float, high: float) -> str:
    """``gain``, ``no_gain`` or ``too_close`` (the range holds the threshold: a trial decides)."""
    if Estimate(gain, low, high).straddles(MIN_GAIN):
        return "too_close"
    return "gain" if gain > MIN_GAIN else "no_gain"


class _Row:
    """One candidate as the calibrated model sees it."""

    def __init__(self, fit: _Fit, k: int, offload: bool):
        self.k, self.offload = k, offload
        units = fit.units
        self.chunk_by = "layers" if units is None else "blocks"
        what = "" if units is None else (" block" if k == 1 else " blocks")
        self.label = f"chunks of {k}{what}" + (" with the optimizer on the host" if offload else "")
        layout = k if units is None else unit_layout(units, k)
        model = fit.model
        self.timeline = model.cgdp(layout)
        self.parts = model.cgdp_parts(layout, offload)
        self.predicted = model.predict(layout, offload)
        ddp = model.ddp_parts()
        self.host_work_s = (self.parts["compute"] - ddp["compute"]) + (
            self.parts["optimizer"] - ddp["optimizer"]
        )
        variants = [m.predict(layout, offload) for m in fit.ends]
        passes = sorted(m.predict(layout, offload) for m in fit.resampled)
        if len(passes) >= 4:
            q = statistics.quantiles(passes, n=4)
            variants += [q[0], q[2]]
        else:
            variants += passes
        self.model_low = min([self.predicted, *variants])
        self.model_high = max([self.predicted, *variants])


class _Fit:
    """The calibrated model of one observation, with the variants that give its ranges."""

    def __init__(self, obs, truth, times, model, ends, resampled, measured, device):
        self.obs, self.truth, self.times = obs, truth, times
        self.model: CalibratedCgdp = model
        self.ends: list[CalibratedCgdp] = ends
        """Calibrated at the ends of the probe's intervals and the trace's quartiles."""
        self.resampled: list[CalibratedCgdp] = resampled
        """Calibrated on the layer times of resamples of the timed passes."""
        self.measured, self.device = measured, device
        self.units = layer_units(obs, times.names)
        """Each layer's transformer block (forward order) when the model has them: chunks
        then hold whole blocks (``chunk_by="blocks"``). None: chunks of layers."""

    def rows(self) -> list[_Row]:
        """Every distinct chunk layout, and offload at the best one; fastest first."""
        n = len(self.times.t_bp) if self.units is None else len(set(self.units))
        seen, rows = set(), []
        for k in candidate_chunk_sizes(n):
            layout = tuple(map(tuple, chunk_layout(n, k)))
            if layout not in seen:
                seen.add(layout)
                rows.append(_Row(self, k, False))
        best = min(rows, key=lambda r: (r.predicted, r.k))
        rows.append(_Row(self, best.k, True))
        return sorted(rows, key=lambda r: (r.predicted, r.offload, r.k))

    def predicted_range(self, row: _Row) -> tuple[float, float]:
        """A candidate's (low, high) step: the model's range widened by the baseline's spread."""
        spread = self.obs.baseline.spread_s if self.obs.baseline is not None else 0.0
        low = self.model.calibration.predicted_range(row.model_low, spread)[0]
        high = self.model.calibration.predicted_range(row.model_high, spread)[1]
        return low, high

    def details(self) -> dict[str, Any]:
        m, times = self.model, self.times
        ddp = m.ddp()
        return {
            "calibrated": self.obs.truth is not None,
            "truth": self.truth.describe(),
            "layers": times.names,
            "num_layers": len(times.names),
            "gradient_bytes": float(sum(times.nbytes)),
            "t_bp_source": self.measured["layers"]["source"],
            "t_bp_s": m.t_bp,
            "layers_backward_s": m.inputs["layers_backward_s"],
            "backward_s": m.inputs["backward_s"],
            "backward_source": m.inputs["backward_source"],
            "contention": m.contention,
            "allreduce_during": m.inputs["during"],
            "allreduce_after": {**m.inputs["after"], "source": m.inputs["after_source"]},
            "ddp_buckets": ddp.messages,
            "ddp_exposed_s": ddp.exposed_s,
            "reproduces_baseline_s": m.reproduces_baseline(),
            "calibration": {
                "scales": dict(m.calibration.scales),
                "notes": list(m.calibration.notes),
            },
            "post_s": m.host.post_s,
            "copy_gbs": 1.0 / m.host.copy_s_per_byte / GB,
            "optimizer_s": m.host.optimizer_s,
            "offload_optimizer_s": m.host.offload_optimizer_s,
            "state_bytes": self.measured["layers"]["state_bytes"],
            "predicted_s": {r.label: r.predicted for r in self.rows()},
        }


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
                "chunk_by",
                "choice",
                "layers",
                "what chunk_size counts: layers (the paper's k) or whole transformer blocks",
                choices=CHUNK_BY,
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

    def diagnose(self, obs: Observation) -> Diagnosis:
        if obs.nproc < 2:
            return Diagnosis(
                False,
                "one rank: no gradient reduction to move to the host "
                "(offload_optimizer still saves device memory)",
            )
        if "sharded" in obs.workload.features():
            from tunekit.plugins.cgdp.runtime import SHARDED_WHY

            return Diagnosis(False, SHARDED_WHY)
        try:
            if obs.hardware.source in MEASURED_SOURCES:
                return self._diagnose_here(obs)
            return self._diagnose_profile(obs)
        except HardwareError as exc:
            return Diagnosis(False, f"cannot model this hardware: {exc}")

    def plan(self, obs: Observation, limit: int) -> list[Candidate]:
        if obs.nproc < 2 or "sharded" in obs.workload.features():
            return []
        try:
            if obs.hardware.source in MEASURED_SOURCES:
                return self._plan_here(obs)[:limit]
            return self._plan_profile(obs, limit)
        except HardwareError:
            return []

    # -- this machine: the model calibrated on the measured baseline ---------------------------

    def _device(self, obs: Observation) -> torch.device:
        cuda = obs.device_type == "cuda" and torch.cuda.is_available()
        return torch.device("cuda", 0) if cuda else torch.device("cpu")

    def _measured_inputs(self, obs: Observation, device: torch.device) -> dict[str, Any]:
        """Layer times, host rates and the optimizer steps of this job here, measured once
        per study (``obs.cached``): every diagnosis and plan of the study reads the same."""
        keys = measured_keys(obs, device)
        return {
            "layers": obs.cached(keys["layers"], lambda: layer_times(obs, device, True)),
            "host": obs.cached(keys["host"], lambda: measure_host_rates(device, True)),
            "offload": obs.cached(keys["offload"], lambda: measure_offload(obs, device)),
        }

    def _fit(self, obs: Observation) -> _Fit:
        """The calibrated model, its variants for ranges, and the figures they came from."""
        from tunekit.plugins.cgdp.measure import LayerTimes, resampled_profiles

        hw, nproc = obs.hardware, obs.nproc
        device = self._device(obs)
        backend = "nccl" if device.type == "cuda" else "gloo"
        hw.allreduce_time(1.0, nproc, backend)  # fails fast if the hardware cannot hold the job
        measured = self._measured_inputs(obs, device)
        times = LayerTimes.from_dict(measured["layers"])
        host = measured["host"]
        copy = Estimate.from_dict(host["d2h"]).value
        work = HostWork(
            post_s=host["sync"],
            copy_s_per_byte=1.0 / copy,
            optimizer_s=measured["offload"]["device_s"],
            offload_optimizer_s=measured["offload"]["offload_s"],
            chunk_costs=None if device.type == "cpu" else gpu_host_path(obs, host, hw),
        )
        truth = obs.truth or model_truth(times, hw, nproc, backend, work)

        def fit(t_bp, peer_hw: Hardware = hw, during_end: str | None = None) -> CalibratedCgdp:
            return calibrate(
                truth, t_bp, times.nbytes, times.backward_share, peer_cost(peer_hw, nproc, backend),
                work, obs.breakdown, during_end,
            )  # fmt: skip

        base = fit(times.t_bp)
        ends = [fit(times.t_bp, hw.at_end(e)) for e in ("slow", "fast")]
        ends += [fit(times.t_bp, during_end=e) for e in ("slow", "fast")]
        resampled = [fit(row) for row in resampled_profiles(times.samples) if sum(row) > 0]
        return _Fit(obs, truth, times, base, ends, resampled, measured, device)

    def _diagnose_here(self, obs: Observation) -> Diagnosis:
        f = self._fit(obs)
        rows = f.rows()
        best = rows[0]
        step = f.truth.step_s
        gain = (step - best.predicted) / step
        # The gain's range is the best candidate's predicted range: the model's inputs' spread
        # and the baseline's own, which a trial's measurement of the gain carries too.
        fast, slow = f.predicted_range(best)
        low, high = (step - slow) / step, (step - fast) / step
        verdict = _verdict(gain, low, high)
        lead = _truth_lead(obs.truth)
        model_text = _model_text(f, best)
        if verdict == "too_close":
            verdict_text = (
                f"too close to call here: within the model's range {best.label} gains {low:+.0%} to "
                f"{high:+.0%} of the step over DDP (it must gain more than {MIN_GAIN:.0%}), so CGDP is "
                "tried and its trials decide"
            )
        elif verdict == "gain":
            verdict_text = (
                f"{best.label} should save ~{gain:.0%} of the step over DDP "
                f"(model range {low:+.0%} to {high:+.0%})"
            )
        elif gain >= -MIN_GAIN:
            verdict_text = (
                f"CGDP would be on par with DDP at best ({best.label}: {gain:+.0%} of the step)"
            )
        else:
            verdict_text = (
                f"CGDP is no faster than DDP here: its best layout ({best.label}) would cost "
                f"{-gain:.0%} of the step more (model range {-high:.0%} to {-low:.0%})"
            )
        mem = memory_estimates(float(sum(f.times.nbytes)), f.measured["layers"]["state_bytes"])
        saved = (mem["ddp"].device_bytes - mem["cgdp"].device_bytes) / MiB
        memory_text = (
            "" if f.device.type == "cpu" else f"; it would save {saved:.0f} MiB of device memory"
        )
        summary = f"{lead}; {model_text}; {verdict_text}{memory_text}"
        details = {
            **f.details(),
            "step_s": step,
            "gain_vs_ddp": gain,
            "gain_vs_ddp_interval": [low, high],
            "verdict": verdict,
            "best_chunk": best.k,
            "chunk_by": best.chunk_by,
            "best_offload": best.offload,
            "memory_bytes": {
                k: {"device": m.device_bytes, "host": m.host_bytes} for k, m in mem.items()
            },
        }
        return Diagnosis(
            verdict != "no_gain",
            summary,
            expected_gain=max(gain, 0.0),
            details=details,
            headline=_headline(verdict, gain, (low, high), _truth_figure(obs.truth)),
        )

    def _plan_here(self, obs: Observation) -> list[Candidate]:
        f = self._fit(obs)
        source = (
            f"calibrated on the measured {_ms(f.truth.step_s)} baseline"
            if obs.truth is not None
            else "uncalibrated: no measured baseline"
        )
        mem = memory_estimates(float(sum(f.times.nbytes)), f.measured["layers"]["state_bytes"])
        freed = mem["cgdp"].device_bytes - mem["cgdp+offload"].device_bytes
        out = []
        for row in f.rows():
            low, high = f.predicted_range(row)
            t = row.timeline
            out.append(
                Candidate(
                    knobs={
                        "chunk_size": row.k,
                        **({"chunk_by": "blocks"} if row.chunk_by == "blocks" else {}),
                        **({"offload_optimizer": True} if row.offload else {}),
                    },
                    predicted_step_s=row.predicted,
                    predicted_range_s=(low, high),
                    rationale=(
                        f"{row.label}: model {t.messages} chunk(s), {_ms(t.exposed_s)} exposed "
                        f"(DDP {_ms(f.model.ddp().exposed_s)}), {_ms(row.host_work_s)} of host work; "
                        f"{source}"
                    ),
                    details={
                        "parts_s": row.parts,
                        "exposed_s": t.exposed_s,
                        "chunks": t.messages,
                        "host_work_s": row.host_work_s,
                        "model_range_s": [row.model_low, row.model_high],
                        **({"device_bytes_saved": freed} if row.offload else {}),
                    },
                )
            )
        return out

    # -- a hardware profile: the paper's model, uncalibrated ------------------------------------

    def _prediction(self, obs: Observation) -> tuple[Prediction, dict[str, Any]]:
        from tunekit.plugins.cgdp.measure import LayerTimes

        hw, nproc = obs.hardware, obs.nproc
        device = self._device(obs)
        target = hw.devices[0]
        backend = "nccl" if target.kind == "gpu" else obs.backend
        hw.allreduce_time(1.0, nproc, backend)  # fails fast if the hardware cannot hold the job
        key = f"cgdp:layers:{obs.workload_spec}:{device}:False:{target.model}"
        lt = obs.cached(key, lambda: layer_times(obs, device, False))
        times = LayerTimes.from_dict(lt)
        measured = obs.cached(
            f"cgdp:rates:{CACHE_VERSION}:{hw.fingerprint()}:{device}:False",
            lambda: measure_host_rates(device, False),
        )
        measured = {**measured, **profile_host_link(hw)}

        def predict_at(host_end: str | None, peer_end: str | None) -> Prediction:
            """The model with the host rates and the peer fits at the given ends of their intervals."""
            peer_hw = hw if peer_end is None else hw.at_end(peer_end)
            rates = host_rates(obs, measured, peer_hw, host_end)
            return predict(times.t_bp, times.nbytes, rates, peer(peer_hw, nproc, backend))

        rates = host_rates(obs, measured, hw)
        pred = predict_at(None, None)
        facts = {
            "layers": times.names,
            "t_bp_source": lt["source"],
            "host_bw_gbs": rates.d2h_bw / GB,
            "host_bw": Estimate.from_dict(measured["d2h"]),
            "peer_allreduce_bus_gbs": peer_bus(hw, nproc, backend) / GB,
            "peer_bus": Estimate(
                peer_bus(hw, nproc, backend),
                peer_bus(hw.at_end("slow"), nproc, backend),
                peer_bus(hw.at_end("fast"), nproc, backend),
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

    def _profile_step_s(self, pred: Prediction) -> float:
        # The profile's step is unmeasured: forward ~ half of backward, plus DDP's backward.
        return pred.ddp_s + pred.backprop_s / 2

    def _diagnose_profile(self, obs: Observation) -> Diagnosis:
        pred, facts = self._prediction(obs)
        step = self._profile_step_s(pred)
        gain = (pred.ddp_s - pred.best_cgdp_s) / step
        low, high = self._gain_range(facts, step)
        vs_typical = (pred.typical_s - pred.best_cgdp_s) / step
        mem = memory_estimates(pred.gradient_bytes, facts["state_bytes"])
        host, peer = facts["host_bw"], facts["peer_bus"]
        verdict = _verdict(gain, low, high)
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
            "calibrated": False,
            "memory_bytes": {
                k: {"device": m.device_bytes, "host": m.host_bytes} for k, m in mem.items()
            },
        }
        links = (
            f"model (uncalibrated, {obs.hardware.name}): host link {_interval_text(host)} vs peer "
            f"all-reduce {_interval_text(peer)}; {pred.gradient_bytes / MiB:.1f} MiB of gradients "
            f"over {pred.num_layers} layers, {pred.backprop_s * 1e3:.1f} ms backward"
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
        if obs.truth is not None:
            summary = f"{_truth_lead(obs.truth)} on this machine, not the profile's; {summary}"
        # -- training features (issue 17) --
        from tunekit.plugins.cgdp.runtime import declines

        if why := declines({"offload_optimizer": True}, obs.workload.features()):
            summary += f"; offload_optimizer {why}"
        # --
        figure = (
            _truth_figure(obs.truth)
            if obs.truth is not None
            else f"host link {host.value / GB:.1f} vs peer all-reduce {peer.value / GB:.1f} GB/s (model)"
        )
        return Diagnosis(
            verdict != "no_gain",
            summary,
            expected_gain=max(gain, 0.0),
            details=details,
            headline=_headline(verdict, gain, (low, high), figure),
        )

    def _plan_profile(self, obs: Observation, limit: int) -> list[Candidate]:
        pred, facts = self._prediction(obs)
        step = self._profile_step_s(pred)
        base = step - pred.ddp_s  # forward, update and the rest, as DDP runs them
        rows = sorted(pred.cgdp_s.items(), key=lambda kv: (kv[1], kv[0]))
        out = [
            Candidate(
                knobs={"chunk_size": k},
                predicted_step_s=base + t,
                rationale=(
                    f"chunks of {k}: model (uncalibrated, {obs.hardware.name}) backward "
                    f"{t * 1e3:.1f} ms (DDP {pred.ddp_s * 1e3:.1f} ms)"
                ),
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
        # parameters are copied back after it, exposed. An assumption: the profile's host
        # cannot be timed from here.
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
        # -- training features (issue 17): no config that cannot honour them --
        from tunekit.plugins.cgdp.runtime import declines

        out = [c for c in out if not declines(c.knobs, obs.workload.features())]
        # --
        out.sort(key=lambda c: c.predicted_step_s)
        return out[:limit]

    # -- runtime -----------------------------------------------------------------------------

    def apply(self, session: Session, knobs: Mapping[str, Any]) -> None:
        session.set_grad_sync(
            CgdpSync(
                chunk_size=knobs["chunk_size"],
                offload_optimizer=knobs["offload_optimizer"],
                chunk_by=knobs["chunk_by"],
            )
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
