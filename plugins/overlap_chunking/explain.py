"""What the tuner says: the diagnosis and each candidate's rationale.

The diagnosis starts from the measured truth (``obs.truth``): the exposed
communication and R the profiled baseline showed, quoted with
``truth.phrase``. The model's own figures follow, labelled "model", with the
calibration that makes them agree with the measurement; where the raw model
contradicted the measurement, the text says how far and how it was
reconciled. The expected recovery is bounded by what is there to recover:
the exposed communication (measured when profiled, else the model's). Where
the model predicts more (it also counts the CPU work that hidden
communication takes from compute on shared cores, which the measured
breakdown files under compute), the text says so and expects no more than
the exposed.

No model figure is written as "<part> N%": that form is kept for the measured
shares (``truth.phrase``), so a reader (and the report figures test) can
hold every such figure against the measured breakdown.
"""

from __future__ import annotations

from tunekit.api import compose_headline
from tunekit.plugins.overlap_chunking import calibrated as calibration
from tunekit.plugins.overlap_chunking.model import Prediction
from tunekit.plugins.overlap_chunking.search import Setting

NOISE_SHARE = calibration.NOISE_SHARE
"""A predicted gain within this share of the step of the bound is the bound."""
CONTRADICTS = 0.25
"""The raw model's exposed time contradicts the measured one when they differ by
more than this share of the measured figure (and by more than 1% of the step)."""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def step_of(fit: calibration.Fit) -> float:
    """The step the diagnosis speaks of: measured when the model is calibrated on it, else the model's."""
    if fit.truth is None or fit.method == calibration.UNCALIBRATED:
        return fit.baseline.step_s
    return fit.truth.step_s


def exposure_is_measured(fit: calibration.Fit) -> bool:
    return fit.truth is not None and fit.truth.profiled


def measured_exposed(fit: calibration.Fit) -> float:
    """Exposed communication of the baseline: measured when profiled, else the (calibrated) model's."""
    if exposure_is_measured(fit):
        return fit.truth.parts_s["comm_exposed"]
    return fit.baseline.blocked_s


def model_gain(fit: calibration.Fit, best: Prediction) -> float:
    """The share of the step the model predicts ``best`` saves (uncapped)."""
    step = step_of(fit)
    return (step - best.step_s) / step


def expected_gain(fit: calibration.Fit, best: Prediction) -> tuple[float, float]:
    """(expected gain, its bound) as shares of the step.

    Overlapping communication cannot recover more than the communication that
    is exposed: the bound is the measured exposed share (the model's when the
    baseline was not profiled).
    """
    bound = measured_exposed(fit) / step_of(fit)
    return min(max(model_gain(fit, best), 0.0), bound), bound


def _waits(pred: Prediction) -> str:
    """The communications the rank waits for, largest wait first."""
    waited = sorted((c for c in pred.comms if c.blocked_s > 0), key=lambda c: -c.blocked_s)
    if not waited:
        return "nothing"
    return ", ".join(
        f"{c.name} ({c.nbytes / 2**20:.2f} MiB, {_ms(c.blocked_s)})" for c in waited[:3]
    )


def _scales(fit: calibration.Fit) -> str:
    return (
        f"compute x{fit.compute_scale:.2f} the layer profile, collectives x{fit.comm_scale:.1f} "
        f"their probe time while the rank computes"
    )


def _reconciliation(fit: calibration.Fit) -> str:
    """How the model was brought to the measured exposed communication."""
    measured = measured_exposed(fit)
    raw = fit.raw.blocked_s
    contradicts = abs(raw - measured) > max(CONTRADICTS * measured, 0.01 * step_of(fit))
    if not contradicts:
        return f"The model agrees once calibrated on the measured baseline ({_scales(fit)})."
    text = (
        f"Uncalibrated, the model left {_ms(raw)} exposed against {_ms(measured)} measured; "
        f"calibrated to reproduce the measured step, exposed and hidden communication, it runs "
        f"{_scales(fit)}"
    )
    if fit.comm_scale > 1.5 and fit.costs.comm_cpu_share > 0:
        text += " (gloo's threads wait for a share of the cores compute keeps busy)"
    if fit.peer_delay_s > 0:
        text += (
            f", and the peer rank posts the step's last collective {_ms(fit.peer_delay_s)} later"
        )
    return text + "."


def _refinement(fit: calibration.Fit) -> str:
    """What the model adds to the measured figure: where the wait comes from, and hidden CPU work."""
    base = fit.baseline
    transfers = max(0.0, base.blocked_s - fit.peer_delay_s)
    text = f"Model: of the {_ms(base.blocked_s)} exposed, {_ms(transfers)} is transfers"
    if fit.peer_delay_s > 0:
        text += f" and {_ms(fit.peer_delay_s)} waiting for the peer rank (ranks drift apart)"
    text += f"; the rank waits for {_waits(base)}"
    if base.cpu_charge_s > 0.005 * step_of(fit):
        text += (
            f"; hidden communication takes a further {_ms(base.cpu_charge_s)} of CPU time from "
            "compute (counted as compute in the measured breakdown)"
        )
    return text + "."


def _gain_sentence(best: Setting, gain: float, bound: float, fit: calibration.Fit) -> str:
    source = "measured" if exposure_is_measured(fit) else "model's"
    text = f"{best.label} should recover ~{gain:.0%} of the step (at most the {source} {bound:.0%} exposed)"
    predicted = model_gain(fit, best.prediction)
    if predicted > bound + NOISE_SHARE:
        # The model's step also drops by the CPU work of hidden communication
        # it no longer charges to compute; the measured breakdown cannot
        # confirm that part, so it is not expected back.
        text += (
            f"; model: {predicted:.0%} shorter, the rest being CPU work of hidden communication "
            "that the measured breakdown counts as compute, so it is not counted on"
        )
    return text + "."


def diagnosis_text(
    fit: calibration.Fit, best: Setting, gain: float, bound: float, grad_mib: float
) -> str:
    """The diagnosis (see the module docstring)."""
    base = fit.baseline
    step = step_of(fit)
    r = f"R~{base.overlap_R:.0f}" if base.overlap_R is not None else "no communication"
    if fit.method == calibration.JOINT:
        truth = fit.truth
        r_measured = f", R {truth.overlap_R:.0f}" if truth.overlap_R is not None else ""
        head = (
            f"{truth.phrase('comm_exposed')}{r_measured} under DDP defaults "
            f"({grad_mib:.1f} MiB of gradients)."
        )
        body = [head, _reconciliation(fit), _refinement(fit)]
    else:
        head = f"{fit.truth.phrase('comm_exposed')}." if fit.truth is not None else ""
        model = (
            f"Model ({'; '.join(fit.notes)}): {_ms(base.blocked_s)} left exposed, "
            f"{base.blocked_s / step:.0%} of the step ({grad_mib:.1f} MiB of gradients, {r} under "
            "DDP defaults)."
        )
        body = [head, model] if head else [model]
    body.append(_gain_sentence(best, gain, bound, fit))
    if fit.method == calibration.JOINT and fit.notes:
        body.append("Calibration: " + "; ".join(fit.notes) + ".")
    return " ".join(body)


def headline(
    fit: calibration.Fit, best: Setting, gain: float, bound: float, spread_s: float | None
) -> str:
    """``applies · +4% (−2…+9%) · exposed communication 12% of the step``: the gain within
    the bound, its range from the best setting's predicted step range."""
    step = step_of(fit)
    gain_range = None
    if (rng := fit.predicted_range(best.prediction, spread_s)) is not None:
        low_s, high_s = rng
        low, high = (step - high_s) / step, min((step - low_s) / step, bound)
        gain_range = (min(low, gain), max(high, gain))
    figure = (
        fit.truth.phrase("comm_exposed", short=True)
        if exposure_is_measured(fit)
        else f"{_ms(measured_exposed(fit))} exposed (model)"
    )
    return compose_headline(True, gain, gain_range, figure)


def candidate_rationale(setting: Setting, fit: calibration.Fit) -> str:
    """One line per candidate: the model's exposure and R beside the measured baseline's."""
    pred = setting.prediction
    if pred.overlap_R is None:
        return setting.label
    text = (
        f"{setting.label}: model {_ms(pred.blocked_s)} exposed "
        f"(baseline {_ms(measured_exposed(fit))} "
        f"{'measured' if exposure_is_measured(fit) else 'by the model'}), "
        f"R~{pred.overlap_R:.0f}, {len(pred.comms)} communications per step"
    )
    if pred.cpu_charge_s > 0:
        text += f", {_ms(pred.cpu_charge_s)} CPU work of hidden communication"
    calibrated = {
        calibration.JOINT: "calibrated on the measured step and exposed communication",
        calibration.COMPUTE_ONLY: "one compute factor fitted to the measured step (not profiled)",
        calibration.UNCALIBRATED: "uncalibrated",
    }[fit.method]
    return f"{text}; {calibrated}"
