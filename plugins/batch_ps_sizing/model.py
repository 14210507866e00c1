"""Cost models of Zou et al., "Distributed Training Large-Scale Deep Architectures" (2017).

Pure arithmetic, no torch: the memory model of a CNN (Eqs. 1-5), its general
measured form for any model, Lemma 3.1 (efficiency of G GPUs), Lemma 3.2
(number of parameter servers) with explicit units, and, beyond the paper, the
gradient noise scale of McCandlish et al. (2018).

Memory terms of Eqs. 2-5 are in BITS, as in the paper (fp32 = 32 bits);
everything else in tunekit is in bytes, so the helpers say which they return.

One module, though long: it is the paper's arithmetic, pure (no torch, no
processes), laid out in the paper's order so that each equation is found next
to the erratum and the worked numbers its tests reproduce.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunekit.errors import ConfigError

FP32_BITS = 32
PARAM_COPIES = 3
"""Eqs. 3 and 4 count each parameter three times: the value and, as the paper
assumes, gradients twice its size (per-sample and aggregated)."""

# -- Eq. 1: feature-map shapes --------------------------------------------------------


@dataclass(frozen=True)
class FeatureLayer:
    """One layer of the feature-extraction part: a convolution or a pooling."""

    kind: str
    """``"conv"`` or ``"pool"``."""
    F: int
    """Spatial extent (filter size)."""
    S: int = 1
    """Stride."""
    P: int = 0
    """Zero padding."""
    K: int = 0
    """Number of filters; 0 for a pooling layer (the paper's convention)."""
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("conv", "pool"):
            raise ConfigError(
                f"feature layer {self.name!r}: kind must be conv or pool, not {self.kind!r}"
            )
        if self.kind == "conv" and self.K < 1:
            raise ConfigError(f"conv layer {self.name!r} needs K >= 1 filters")
        if self.kind == "pool" and self.K != 0:
            raise ConfigError(f"pooling layer {self.name!r} has K = 0 by definition")
        if self.F < 1 or self.S < 1 or self.P < 0:
            raise ConfigError(f"layer {self.name!r}: need F >= 1, S >= 1, P >= 0")


@dataclass(frozen=True)
class CnnSpec:
    """A CNN as the paper models it: n conv/pool layers, then m fully-connected widths."""

    input_shape: tuple[int, int, int]
    """(B_0, H_0, D_0): width, height, depth of one input sample (224, 224, 3)."""
    features: tuple[FeatureLayer, ...]
    fc_widths: tuple[int, ...] = ()
    """L_1 .. L_m: neurons of each fully-connected layer, L_1 being the flattened features."""


def next_extent(size: int, F: int, S: int, P: int) -> int:
    """Eq. 1: B_{i+1} = (B_i - F + 2P)/S + 1, floored as every framework floors it."""
    out = (size - F + 2 * P) // S + 1
    if out < 1:
        raise ConfigError(
            f"a {F}x{F} window with stride {S}, padding {P} does not fit a {size}-wide map"
        )
    return out


def feature_shapes(spec: CnnSpec) -> list[tuple[int, int, int]]:
    """Eq. 1: (B_i, H_i, D_i) for i = 0..n, the input first."""
    shapes = [spec.input_shape]
    for layer in spec.features:
        b, h, d = shapes[-1]
        depth = layer.K if layer.kind == "conv" else d
        shapes.append(
            (
                next_extent(b, layer.F, layer.S, layer.P),
                next_extent(h, layer.F, layer.S, layer.P),
                depth,
            )
        )
    return shapes


# -- Eqs. 2-5: memory ----------------------------------------------------------------


def feature_map_bits(spec: CnnSpec, batch: int) -> int:
    """Eq. 2: M_FM = sum_{i=0..n} B_i H_i D_i X_mini 32 (the input and every feature map)."""
    return sum(b * h * d for b, h, d in feature_shapes(spec)) * batch * FP32_BITS


def input_bits(spec: CnnSpec, batch: int) -> int:
    """The i = 0 term of Eq. 2: the input batch itself."""
    b, h, d = spec.input_shape
    return b * h * d * batch * FP32_BITS


def conv_parameter_bits(spec: CnnSpec) -> int:
    """Eq. 3: M_MP = sum_i (F_i^2 D_{i-1} K_i + K_i) * 3 * 32.

    Erratum (NOTES.md section 5): the paper prints D_i, the layer's OUTPUT
    depth (its own Eq. 1 makes D_i = K_i for a conv), which over-counts the
    weights; a filter spans the input depth D_{i-1}. Pooling layers have
    K_i = 0 and add nothing.
    """
    shapes = feature_shapes(spec)
    total = 0
    for i, layer in enumerate(spec.features, start=1):
        depth_in = shapes[i - 1][2]
        total += layer.F * layer.F * depth_in * layer.K + layer.K
    return total * PARAM_COPIES * FP32_BITS


def classifier_bits(spec: CnnSpec, batch: int) -> int:
    """Eq. 4: M_C for the m fully-connected layers (outputs, weights, biases).

    Two corrections to the printed equation, both needed to count what a
    framework allocates: the outputs are per sample, so they scale with
    X_mini (the paper writes sum_j L_j * 32); and layer j -> j+1 has L_{j+1}
    biases, not one (the paper writes (m-1) * 3 * 32). The outputs sum keeps
    the paper's j = 1..m, so L_1 (the flattened last feature map) is counted
    here as well as in Eq. 2.
    """
    L = spec.fc_widths
    outputs = sum(L) * batch * FP32_BITS
    weights = sum(L[j] * L[j + 1] for j in range(len(L) - 1)) * PARAM_COPIES * FP32_BITS
    biases = sum(L[1:]) * PARAM_COPIES * FP32_BITS
    return outputs + weights + biases


def memory_bound_bits(device_bits: float, spec: CnnSpec, batch: int) -> float:
    """Eq. 5: M_bound = M_GPU - M_FM - M_MP - M_C, the memory left for algorithm workspaces."""
    return (
        device_bits
        - feature_map_bits(spec, batch)
        - conv_parameter_bits(spec)
        - classifier_bits(spec, batch)
    )


def largest_batch_eq5(spec: CnnSpec, device_bytes: float, margin: float = 0.1) -> int:
    """Largest X_mini whose Eq. 5 bound stays >= ``margin`` of the device (0 if none fits)."""
    _check_margin(margin)
    usable = device_bytes * 8 * (1 - margin)
    fixed = conv_parameter_bits(spec) + classifier_bits(spec, 0)
    per_sample = feature_map_bits(spec, 1) + classifier_bits(spec, 1) - classifier_bits(spec, 0)
    return max(0, math.floor((usable - fixed) / per_sample))


def parameter_count(spec: CnnSpec) -> int:
    """Weights and biases of the whole CNN (Eqs. 3 and 4 divided by 3 x 32)."""
    return (conv_parameter_bits(spec) + classifier_bits(spec, 0)) // (PARAM_COPIES * FP32_BITS)


def cnn_spec_from_graph(graph: Any) -> CnnSpec | None:
    """The paper's CNN view of a traced :class:`~tunekit.observe.graph.ModelGraph`.

    Returns None unless the model is the shape Eqs. 1-4 describe: one input,
    a chain of square conv/pool layers, then a chain of linear layers (norms,
    activations and dropout are folded into layers by the graph). An adaptive
    pooling that keeps its input size is the identity and is skipped; one that
    changes it has no fixed window and makes the model unfit.
    """
    features: list[FeatureLayer] = []
    fc: list[int] = []
    input_shape = None
    for layer in graph.layers.values():
        if layer.kind == "input":
            if input_shape is not None or not layer.output_shape or len(layer.output_shape) != 4:
                return None
            _, d, h, b = layer.output_shape
            input_shape = (b, h, d)
        elif layer.kind in ("conv", "pool"):
            if fc or input_shape is None:
                return None
            anchor = graph.nodes[layer.nodes[0]]
            a = anchor.attrs
            if "output_size" in a:
                if list(anchor.output_shape[2:]) != list(
                    graph.nodes[anchor.inputs[0]].output_shape[2:]
                ):
                    return None
                continue
            F, S, P = (_square(a.get(k)) for k in ("kernel_size", "stride", "padding"))
            if None in (F, S, P) or a.get("groups", 1) != 1 or a.get("ceil_mode", False):
                return None
            if _square(a.get("dilation", 1)) != 1:
                return None
            if layer.kind == "conv":
                features.append(FeatureLayer("conv", F, S, P, int(a["out_channels"]), layer.name))
            else:
                features.append(FeatureLayer("pool", F, S, P, 0, layer.name))
        elif layer.kind == "linear":
            a = graph.nodes[layer.nodes[0]].attrs
            if not fc:
                fc.append(int(a["in_features"]))
            elif fc[-1] != int(a["in_features"]):
                return None
            fc.append(int(a["out_features"]))
        elif layer.kind == "output":
            continue
        else:
            return None
    if input_shape is None or not features:
        return None
    return CnnSpec(input_shape, tuple(features), tuple(fc))


def _square(v) -> int | None:
    if v is None:
        return None
    if isinstance(v, int):
        return v
    vals = list(v)
    return int(vals[0]) if vals and all(x == vals[0] for x in vals) else None


# -- the general, measured form -------------------------------------------------------


@dataclass(frozen=True)
class MemoryProfile:
    """Peak memory of one training step as a line in the per-rank batch: fixed + per_sample * b.

    Measured, for any model: ``static_bytes`` are parameters, gradients and
    optimizer state (alive across steps); the step's peak on top of them is
    fitted through measurements at two batch sizes, so activations, their
    gradients and batch-proportional workspaces fall into ``per_sample_bytes``
    and batch-independent temporaries into ``transient_bytes``.
    """

    static_bytes: float
    """Parameters + gradients + optimizer state."""
    transient_bytes: float
    """Intercept of the step's extra peak (batch-independent temporaries)."""
    per_sample_bytes: float
    """Slope of the step's extra peak: activation memory per sample."""
    method: str = ""
    """How the peaks were measured (``cuda-allocator``, ``cpu-profiler``)."""

    def peak_bytes(self, batch: int) -> float:
        return self.static_bytes + self.transient_bytes + self.per_sample_bytes * batch

    def largest_batch(self, device_bytes: float, margin: float = 0.1) -> int:
        """Largest batch whose peak stays within ``(1 - margin)`` of ``device_bytes`` (0: none)."""
        _check_margin(margin)
        room = device_bytes * (1 - margin) - self.static_bytes - self.transient_bytes
        if self.per_sample_bytes <= 0:
            raise ConfigError(
                "memory profile has no per-sample memory; measure it at two batch sizes"
            )
        return max(0, math.floor(room / self.per_sample_bytes))

    @classmethod
    def fit(
        cls,
        static_bytes: float,
        peaks: dict[int, float],
        method: str = "",
        min_per_sample: float = 0.0,
    ) -> MemoryProfile:
        """Least-squares line through ``{batch: extra peak bytes above static}`` (two or more batches).

        With ``min_per_sample`` (a slope known to be a lower bound, such as the
        saved activations'), a flatter fit is replaced by that slope through the
        largest batch measured: the line that extrapolates upwards safely.
        """
        if len(set(peaks)) < 2:
            raise ConfigError("a memory profile needs peaks at two or more batch sizes")
        xs, ys = list(peaks), [float(peaks[b]) for b in peaks]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        intercept = my - slope * mx
        if slope < min_per_sample:
            top = max(xs)
            slope, intercept = min_per_sample, peaks[top] - min_per_sample * top
        return cls(float(static_bytes), max(0.0, intercept), max(slope, 0.0), method)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _check_margin(margin: float) -> None:
    if not 0 <= margin < 1:
        raise ConfigError(f"memory margin must be in [0, 1), not {margin}")


# -- beyond the paper: step time against the batch, measured -----------------------------

LINE_TOLERANCE = 0.03
"""A straight line is kept when its rms relative residual is within this, or within
twice the measurement noise of the medians, whichever is larger."""
MIN_SLOPE_FRACTION = 0.05
"""Floor of the per-sample cost, as a fraction of the average cost per sample at the
largest measured batch: every sample costs something, so a bigger batch is never
predicted to take the same time (a flatter fit is measurement noise)."""


@dataclass(frozen=True)
class StepTimeFit:
    """Seconds of a batch-proportional part of a training step against the per-rank batch.

    ``t(b) = fixed_s + per_sample_s * b + sum_k extra_per_sample_s[k] * max(0, b - knots[k])``

    The empirical form of the paper's Figure 2 (throughput against batch): a
    fixed cost per step (kernel launches, Python) plus a cost per sample. On a
    CPU the per-sample cost can rise past a batch whose activations leave the
    caches; when a line misses the medians by more than their noise, the fit
    adds one kink, at the measured batch that fits best, with a non-negative
    extra slope above it (a convex, increasing curve; more kinks would fit noise). Fitted by least squares on
    relative residuals (times span decades), with ``fixed_s >= 0``,
    ``per_sample_s >= floor > 0`` and extras ``>= 0``; the straight line is
    used whenever it fits within the measurement noise.
    """

    fixed_s: float
    per_sample_s: float
    knots: tuple[int, ...]
    extra_per_sample_s: tuple[float, ...]
    measured: tuple[tuple[int, float], ...]
    """(batch, median seconds) of every measured batch, ascending."""
    noise: float
    """Relative standard error of a median, from the spread of the repeats (0: one sample)."""
    line_residual: float
    """Rms relative residual of the best straight line (the check of the linear form)."""
    residual: float
    """Rms relative residual of this fit."""
    form: str
    """``line`` or ``convex`` (kinks were needed)."""

    @classmethod
    def fit(
        cls, samples: Mapping[int, Sequence[float]], min_per_sample_s: float | None = None
    ) -> StepTimeFit:
        """Fit ``{batch: [seconds of each timed repeat]}`` (two or more batches)."""
        rows = sorted((int(b), list(ts)) for b, ts in samples.items() if ts)
        if len(rows) < 2:
            raise ConfigError("a step-time fit needs times at two or more batch sizes")
        if any(b < 1 or min(ts) <= 0 for b, ts in rows):
            raise ConfigError("step times need positive batches and positive seconds")
        batches = [b for b, _ in rows]
        medians = [_median(ts) for _, ts in rows]
        noise = _median([_relative_standard_error(ts) for _, ts in rows])
        floor = (
            MIN_SLOPE_FRACTION * medians[-1] / batches[-1]
            if min_per_sample_s is None
            else min_per_sample_s
        )
        line = _least_squares(batches, medians, (), floor)
        line_res = _rms_relative(batches, medians, line, ())
        form, knots, params, res = "line", (), line, line_res
        if len(batches) >= 3 and line_res > max(LINE_TOLERANCE, 2 * noise):
            # One kink, at the measured batch that fits best: a line below it, a
            # steeper one above (more flexibility would fit the noise).
            hinges = [(k,) for k in batches[1:-1]]
            fits = [(h, _least_squares(batches, medians, h, floor)) for h in hinges]
            scored = [(_rms_relative(batches, medians, p, h), h, p) for h, p in fits]
            best_res, best_knots, best = min(scored)
            if best[2] > 0 and best_res < line_res:
                form, knots, params, res = "convex", best_knots, best, best_res
        return cls(
            fixed_s=float(params[0]),
            per_sample_s=float(params[1]),
            knots=knots,
            extra_per_sample_s=tuple(float(e) for e in params[2:]),
            measured=tuple(zip(batches, medians, strict=True)),
            noise=noise,
            line_residual=line_res,
            residual=res,
            form=form,
        )

    def seconds(self, batch: float) -> float:
        return _evaluate(
            (self.fixed_s, self.per_sample_s, *self.extra_per_sample_s), self.knots, batch
        )

    def marginal_s(self, batch: float) -> float:
        """Seconds one more sample adds at ``batch`` (the slope there)."""
        return self.per_sample_s + sum(
            e for k, e in zip(self.knots, self.extra_per_sample_s, strict=True) if batch > k
        )

    @property
    def measured_range(self) -> tuple[int, int]:
        return self.measured[0][0], self.measured[-1][0]

    def extrapolation(self, batch: int) -> float:
        """How far ``batch`` lies beyond the largest measured batch (1.0: within the range)."""
        return max(1.0, batch / self.measured_range[1])

    def describe(self) -> str:
        lo, hi = self.measured_range
        text = f"{self.fixed_s * 1e3:.1f} ms + {self.per_sample_s * 1e3:.3g} ms/sample"
        timed = f"{len(self.measured)} batches {lo}-{hi} timed"
        if self.form == "convex":
            kinks = ", ".join(
                f"+{e * 1e3:.3g} ms/sample past {k}"
                for k, e in zip(self.knots, self.extra_per_sample_s, strict=True)
            )
            return (
                f"{text}, {kinks} ({timed}; a line missed them by {self.line_residual:.0%}, "
                f"this fit by {self.residual:.0%})"
            )
        return f"{text} ({timed}; a line within {self.residual:.0%})"

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["measured"] = [list(m) for m in self.measured]
        out["knots"], out["extra_per_sample_s"] = list(self.knots), list(self.extra_per_sample_s)
        return out


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _relative_standard_error(ts: Sequence[float]) -> float:
    """Standard error of a median relative to it, from the median absolute deviation."""
    if len(ts) < 2:
        return 0.0
    med = _median(ts)
    mad = _median([abs(t - med) for t in ts])
    # 1.4826 MAD estimates a standard deviation; a median's error is ~1.25 sd/sqrt(n).
    return 1.25 * 1.4826 * mad / math.sqrt(len(ts)) / med


def _evaluate(params: Sequence[float], knots: Sequence[int], batch: float) -> float:
    fixed, slope, *extras = params
    return (
        fixed
        + slope * batch
        + sum(e * max(0.0, batch - k) for k, e in zip(knots, extras, strict=True))
    )


def _least_squares(
    batches: Sequence[int], times: Sequence[float], knots: Sequence[int], floor: float
) -> tuple[float, ...]:
    """Bounded least squares on relative residuals: fixed >= 0, slope >= floor, extras >= 0."""
    import numpy as np
    from scipy.optimize import lsq_linear  # only when fitting

    rows = [[1.0, float(b), *(max(0.0, b - k) for k in knots)] for b in batches]
    weights = np.array([1.0 / t for t in times])
    a = np.array(rows) * weights[:, None]
    y = np.array(times) * weights
    lower = [0.0, floor, *([0.0] * len(knots))]
    res = lsq_linear(a, y, bounds=(lower, [np.inf] * len(lower)))
    return tuple(float(v) for v in res.x)


def _rms_relative(
    batches: Sequence[int], times: Sequence[float], params: Sequence[float], knots: Sequence[int]
) -> float:
    errs = [(_evaluate(params, knots, b) - t) / t for b, t in zip(batches, times, strict=True)]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


# -- Lemma 3.1: how many GPUs -----------------------------------------------------------


def efficiency(gpus: int, overhead_ratio: float) -> float:
    """Lemma 3.1: alpha = (1 + R_O) / (1 + G R_O), with R_O = T_O / T_C."""
    _check_lemma31(gpus, overhead_ratio)
    return (1 + overhead_ratio) / (1 + gpus * overhead_ratio)


def speedup(gpus: int, overhead_ratio: float) -> float:
    """alpha * G: the speed-up of G GPUs over one."""
    return efficiency(gpus, overhead_ratio) * gpus


def speedup_asymptote(overhead_ratio: float) -> float:
    """The limit of alpha * G as G grows: (1 + R_O) / R_O (infinite without overhead)."""
    _check_lemma31(1, overhead_ratio)
    return math.inf if overhead_ratio == 0 else (1 + overhead_ratio) / overhead_ratio


def max_overhead_ratio(target_efficiency: float, gpus: int) -> float:
    """Eq. 12: the largest R_O that keeps efficiency ``alpha`` on G GPUs, (1 - alpha)/(alpha G - 1)."""
    if not 0 < target_efficiency <= 1:
        raise ConfigError(f"target efficiency must be in (0, 1], not {target_efficiency}")
    if gpus < 1 or target_efficiency * gpus <= 1:
        return math.inf  # one GPU, or a target any overhead meets
    return (1 - target_efficiency) / (target_efficiency * gpus - 1)


def gpus_for_speedup(target: float, overhead_ratio: float, max_gpus: int = 4096) -> int | None:
    """The fewest GPUs whose speed-up reaches ``target``; None past the asymptote or ``max_gpus``."""
    if target <= 1:
        return 1
    if target >= speedup_asymptote(overhead_ratio):
        return None
    for g in range(1, max_gpus + 1):
        if speedup(g, overhead_ratio) >= target:
            return g
    return None


def gpus_for_efficiency(target_efficiency: float, overhead_ratio: float) -> int | None:
    """The most GPUs that keep efficiency >= ``target_efficiency``; None when unbounded (R_O = 0)."""
    if not 0 < target_efficiency <= 1:
        raise ConfigError(f"target efficiency must be in (0, 1], not {target_efficiency}")
    _check_lemma31(1, overhead_ratio)
    if overhead_ratio == 0:
        return None
    # alpha >= a  <=>  G <= ((1 + R_O)/a - 1) / R_O ; the small slack absorbs rounding.
    return max(
        1, math.floor(((1 + overhead_ratio) / target_efficiency - 1) / overhead_ratio + 1e-9)
    )


def speedup_curve(overhead_ratio: float, gpus: Sequence[int]) -> list[dict[str, float]]:
    """Rows of (G, alpha, speed-up) for reports and plots."""
    return [
        {
            "gpus": g,
            "efficiency": efficiency(g, overhead_ratio),
            "speedup": speedup(g, overhead_ratio),
        }
        for g in gpus
    ]


def _check_lemma31(gpus: int, overhead_ratio: float) -> None:
    if gpus < 1:
        raise ConfigError(f"number of GPUs must be >= 1, not {gpus}")
    if not (overhead_ratio >= 0 and math.isfinite(overhead_ratio)):
        raise ConfigError(f"overhead ratio R_O must be a finite number >= 0, not {overhead_ratio}")


# -- Lemma 3.2: how many parameter servers, with units ---------------------------------


@dataclass(frozen=True)
class DataSize:
    """An amount of data, stored in bits so that bits and bytes cannot be confused."""

    bits: float

    @classmethod
    def of_bytes(cls, n: float) -> DataSize:
        return cls(n * 8)

    @classmethod
    def megabytes(cls, n: float) -> DataSize:
        """Decimal megabytes (10^6 bytes), as network and paper figures quote them."""
        return cls(n * 8e6)

    @classmethod
    def mebibytes(cls, n: float) -> DataSize:
        """Binary MiB (2^20 bytes), as memory tools quote them."""
        return cls(n * 8 * 2**20)

    @property
    def bytes(self) -> float:
        return self.bits / 8


@dataclass(frozen=True)
class Bandwidth:
    """A data rate, stored in bits per second."""

    bits_per_s: float

    @classmethod
    def gbps(cls, n: float) -> Bandwidth:
        """Gigabits per second (10^9 bit/s): how links are sold (1 GbE, 10 GbE)."""
        return cls(n * 1e9)

    @classmethod
    def of_bytes_per_s(cls, n: float) -> Bandwidth:
        """Bytes per second: the unit of tunekit's hardware model."""
        return cls(n * 8)

    @property
    def bytes_per_s(self) -> float:
        return self.bits_per_s / 8


def parameter_servers(
    params: DataSize, workers: int, bandwidth: Bandwidth, compute_s: float
) -> int:
    """Lemma 3.2: N_ps = ceil(2 S_p N_w / (B_ps T_C)), a lower bound.

    Each worker pulls and pushes the parameters once per compute round; with
    the load spread evenly over N_ps servers, that traffic must fit inside
    T_C. Raise the result if the balance or asynchrony assumptions fail.
    """
    if workers < 1:
        raise ConfigError(f"number of workers must be >= 1, not {workers}")
    if bandwidth.bits_per_s <= 0 or compute_s <= 0:
        raise ConfigError("bandwidth and compute time must be positive")
    need = 2 * params.bits * workers / (bandwidth.bits_per_s * compute_s)
    return max(1, math.ceil(need - 1e-9))  # slack: 3.0000000001 from float division is 3


# -- beyond the paper: the gradient noise scale -----------------------------------------


@dataclass(frozen=True)
class NoiseScale:
    """McCandlish et al. (2018), "An Empirical Model of Large-Batch Training", App. A.1."""

    grad_sq: float
    """Unbiased estimate of |G|^2, the squared norm of the true gradient."""
    trace_cov: float
    """Unbiased estimate of tr(Sigma), the per-sample gradient variance summed over parameters."""
    samples: int
    """How many (small, big) gradient pairs went into the estimate."""

    @property
    def b_simple(self) -> float:
        """B_simple = tr(Sigma) / |G|^2: past this batch, doubling it buys less than 2x progress per step."""
        return math.inf if self.grad_sq <= 0 else self.trace_cov / self.grad_sq

    def to_dict(self) -> dict[str, Any]:
        b = self.b_simple  # JSON has no infinity: None means "no limit"
        return {
            "grad_sq": self.grad_sq,
            "trace_cov": self.trace_cov,
            "samples": self.samples,
            "b_simple": None if math.isinf(b) else b,
        }


def noise_scale_from_norms(
    b_small: float, sq_small: float, b_big: float, sq_big: float, samples: int = 1
) -> NoiseScale:
    """The two-batch estimator: from |G_B|^2 measured at a small and a big batch.

    E|G_B|^2 = |G|^2 + tr(Sigma)/B, so two batch sizes give both unknowns:
    |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small) and
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big).
    Each is unbiased; average them over steps before taking the ratio.
    """
    if not 0 < b_small < b_big:
        raise ConfigError(f"need 0 < small batch < big batch, got {b_small} and {b_big}")
    grad_sq = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace_cov = (sq_small - sq_big) / (1 / b_small - 1 / b_big)
    return NoiseScale(grad_sq, trace_cov, samples)


def noise_scale_batch_limit(
    noise: NoiseScale, world_size: int, batch_range: tuple[int, int]
) -> int:
    """The largest per-rank batch whose global batch stays within B_simple, clipped to the range."""
    lo, hi = batch_range
    if not math.isfinite(noise.b_simple):
        return hi
    return int(min(hi, max(lo, math.floor(noise.b_simple / world_size))))
