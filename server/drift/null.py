"""The no-change (null) model a calibrated drift alarm is set from.

What is modelled. Each live pass of a baselined layer gives a vector of
*components*: the per-feature means and population stds of the pass (the
``per_channel`` reducer's output, on the model's feature axis), then the
layer's pooled mean and std (the ``moments`` reducer). A layer without a
feature axis (a derived per-token entropy, a ``(batch,)`` output) has the
two pooled components only. Passes are independent draws of traffic, so
under no change the mean of a component over a window of ``W`` passes is
close to normal (central limit) with the pass-to-pass variance ``σ²/W``.

What is estimated at freeze, from the baseline's own passes
(:class:`NullAccumulator`, one running pass over them, O(components) memory):

* ``μ``, ``σ``: each component's mean and pass-to-pass std (Welford);
* the window-to-window spread: the baseline's passes cut into consecutive
  windows of ``W`` (held out from nothing: each window's mean is compared with
  the spread the pass-level ``σ`` predicts). The ratio ``φ`` (1 for
  independent passes) is averaged over components, and ``max(1, φ)`` inflates
  ``σ``: traffic whose passes are correlated (sessions, sorted batches) has a
  larger window-to-window spread than the pass spread predicts, and the
  threshold must widen with it.

Each component of a window is then a z-score,
``z = (mean_W - μ) / (σ √φ √(1/W + 1/N))`` (the ``1/N`` is the error of ``μ``
itself), and the layer's score is ``max |z|`` over its components. The null of
that maximum is bounded without any assumption on how the components
correlate (Bonferroni): ``P(max |z| > t) <= 2 K P(T > t)`` with ``T`` Student's
t on ``N - 1`` degrees of freedom. So the threshold for a per-window false
alarm rate ``α`` is the t quantile at ``1 - α / (2K)``. Why a model and not
the empirical quantile of held-out windows: a 1e-4 tail needs ~10^5 windows,
a baseline has ten.

Sequential test. Each component's per-pass z, clipped to ±3, feeds a two-sided
CUSUM with reference ``k = 0.5``; its decision limit ``h`` comes from Siegmund's
approximation of the in-control average run length (ARL0). Half of the
layer's rate goes to the window test, half to the CUSUMs, so the alarm's
combined rate stays at most ``α`` per window (ARL0 of the union at least
``2/α`` windows; 20,000 at the default 1e-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from layertap.server.drift.merge import chan_merge

__all__ = [
    "CUSUM_CLIP",
    "CUSUM_K",
    "MIN_WINDOWS",
    "NullAccumulator",
    "NullModel",
    "components",
    "cusum_arl0",
    "cusum_limit",
    "t_quantile",
]

FloatArray = npt.NDArray[np.float64]

#: Windows' worth of baseline passes needed to calibrate.
MIN_WINDOWS = 5
#: The CUSUM's reference value (in σ of one pass): tuned to shifts of about 1σ per pass.
CUSUM_K = 0.5
#: Each pass's z enters the CUSUM clipped to ±CUSUM_CLIP. One pass is not a mean over many
#: passes: a feature that is rarely active (a ReLU channel of a 2x2 map) has a per-pass std
#: with a long right tail, and one such pass at z = 20 would cross the limit alone. Clipped, it
#: takes several; a normal increment is clipped with probability 0.3%, which only lengthens the
#: run length Siegmund's formula gives (the window test is untouched).
CUSUM_CLIP = 3.0


def components(mean: float, std: float, feature_mean: npt.ArrayLike | None = None,
               feature_std: npt.ArrayLike | None = None) -> FloatArray:
    """One pass's components: per-feature means, per-feature stds, then the pooled mean and std.

    Features come only when both vectors are given and agree in length.
    """
    pooled = np.array([mean, std], dtype=np.float64)
    if feature_mean is None or feature_std is None:
        return pooled
    fm = np.asarray(feature_mean, dtype=np.float64).ravel()
    fs = np.asarray(feature_std, dtype=np.float64).ravel()
    if fm.shape != fs.shape or fm.size == 0:
        return pooled
    return np.concatenate((fm, fs, pooled))


def t_quantile(p: float, dof: float) -> float:
    """The upper ``p`` quantile of Student's t (``P(T > t) = p``), for ``dof >= 3``.

    The normal quantile with the Cornish-Fisher terms of order 1/ν and 1/ν²
    (Abramowitz & Stegun 26.7.5): within 0.1% of the exact value for ν >= 20
    in the tails used here.
    """
    z = -NormalDist().inv_cdf(p)
    v = float(dof)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / v + g2 / v**2 + g3 / v**3


def normal_tail(z: float) -> float:
    """``P(Z > z)`` for a standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def cusum_arl0(h: float, k: float = CUSUM_K) -> float:
    """Siegmund's approximation of a one-sided CUSUM's in-control ARL on N(0, 1) increments."""
    b = h + 1.166
    return (math.exp(2 * k * b) - 2 * k * b - 1) / (2 * k * k)


def cusum_limit(arl0: float, k: float = CUSUM_K) -> float:
    """The decision limit ``h`` whose in-control ARL (:func:`cusum_arl0`) is ``arl0`` passes."""
    lo, hi = 0.0, 1.0
    while cusum_arl0(hi, k) < arl0:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cusum_arl0(mid, k) < arl0 else (lo, mid)
    return hi


@dataclass(frozen=True, eq=False)
class NullModel:
    """A layer's null statistics, frozen with its baseline; ``reason`` non-empty when it cannot calibrate.

    Attributes:
        mean: Each component's mean over the baseline's passes (K).
        std: Each component's pass-to-pass std, ddof=1 (K).
        passes: Usable baseline passes (N).
        window: The window (W) the spread was measured at.
        windows: Complete windows of W in the baseline.
        dispersion: Window-to-window variance over what pass variance predicts (φ, before the floor at 1).
        features: Features among the components (0: the pooled pair only).
        reason: Why the layer is uncalibrated ("" when calibrated).
    """

    mean: FloatArray
    std: FloatArray
    passes: int
    window: int
    windows: int
    dispersion: float
    features: int = 0
    reason: str = ""

    @property
    def calibrated(self) -> bool:
        return not self.reason

    @property
    def live(self) -> npt.NDArray[np.bool_]:
        """Components that vary under no change; constant ones (σ = 0) are left out, counted."""
        return self.std > 0.0

    @property
    def constant(self) -> int:
        """Components left out because they never varied in the baseline."""
        return int(np.count_nonzero(~self.live))

    @property
    def tested(self) -> int:
        """Components tested (K)."""
        return int(np.count_nonzero(self.live))

    @property
    def scale(self) -> FloatArray:
        """``σ √max(1, φ)`` of each component (1 where constant, never used)."""
        s = self.std * math.sqrt(max(1.0, self.dispersion))
        return np.where(self.live, s, 1.0)

    def threshold(self, rate: float) -> float:
        """The ``max |z|`` threshold of a window for a per-window false-alarm rate ``rate`` (the window test's half)."""
        k = max(self.tested, 1)
        return t_quantile(rate / 2 / (2 * k), max(self.passes - 1, 3))

    def cusum_limit(self, rate: float) -> float:
        """The CUSUM limit ``h`` for the other half of ``rate``, split over 2K one-sided CUSUMs, per pass."""
        per_pass = rate / 2 / self.window / (2 * max(self.tested, 1))
        return cusum_limit(1.0 / per_pass)

    def zscores(self, window_mean: FloatArray, window_passes: int) -> FloatArray:
        """The window's z-scores of the live components."""
        spread = self.scale * math.sqrt(1.0 / window_passes + 1.0 / self.passes)
        return ((window_mean - self.mean) / spread)[self.live]

    def pass_z(self, x: FloatArray) -> FloatArray:
        """One pass's z-scores of the live components (for the CUSUM)."""
        return ((x - self.mean) / (self.scale * math.sqrt(1.0 + 1.0 / self.passes)))[self.live]

    def p_value(self, score: float) -> float:
        """The Bonferroni p-value of a window's ``max |z|`` (normal tails)."""
        if math.isnan(score):
            return math.nan
        return min(1.0, 2 * max(self.tested, 1) * normal_tail(score))

    def as_dict(self) -> dict[str, object]:
        return {"mean": [float(x) for x in self.mean], "std": [float(x) for x in self.std], "passes": self.passes,
                "window": self.window, "windows": self.windows, "dispersion": float(self.dispersion),
                "features": self.features, "reason": self.reason}

    @classmethod
    def uncalibrated(cls, reason: str, window: int = 1) -> NullModel:
        empty = np.empty(0, dtype=np.float64)
        return cls(empty, empty, 0, window, 0, 1.0, 0, reason)


class NullAccumulator:
    """Running null statistics of a baseline's passes (see the module docstring); not thread-safe."""

    def __init__(self, window: int) -> None:
        self.window = max(int(window), 1)
        self.passes = 0
        #: Passes left out: non-finite components, or a component count other than the first pass's.
        self.ignored = 0
        self._mean: FloatArray | None = None
        self._m2: FloatArray | None = None
        self._block = np.empty(0)
        self._block_n = 0
        self.windows = 0
        self._bsum = np.empty(0)
        self._bsq = np.empty(0)

    def add(self, x: npt.ArrayLike) -> bool:
        """Add one pass's components; False (and counted) when they cannot be used."""
        v = np.asarray(x, dtype=np.float64).ravel()
        if not np.all(np.isfinite(v)) or (self._mean is not None and v.shape != self._mean.shape):
            self.ignored += 1
            return False
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = v.copy(), np.zeros_like(v)
            self._block, self._bsum, self._bsq = np.zeros_like(v), np.zeros_like(v), np.zeros_like(v)
        self.passes += 1
        d = v - self._mean
        self._mean += d / self.passes
        self._m2 += d * (v - self._mean)
        self._block += v
        self._block_n += 1
        if self._block_n == self.window:
            b = self._block / self.window
            self._bsum += b
            self._bsq += b * b
            self.windows += 1
            self._block[:] = 0.0
            self._block_n = 0
        return True

    def merge(self, other: NullAccumulator) -> None:
        """Fold in another replica's passes (same window and components); partial windows are dropped."""
        if other._mean is None or other._m2 is None:
            return
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = other._mean.copy(), other._m2.copy()
            self._block, self._bsum, self._bsq = np.zeros_like(other._mean), other._bsum.copy(), other._bsq.copy()
            self.passes, self.windows = other.passes, other.windows
        elif self._mean.shape == other._mean.shape and self.window == other.window:
            n, m, m2 = chan_merge(self.passes, self._mean, self._m2, other.passes, other._mean, other._m2)
            self.passes, self._mean, self._m2 = int(n), np.asarray(m, dtype=np.float64), np.asarray(m2, dtype=np.float64)
            self._bsum, self._bsq = self._bsum + other._bsum, self._bsq + other._bsq
            self.windows += other.windows
        self.ignored += other.ignored

    def freeze(self) -> NullModel:
        """The null model of the passes seen; uncalibrated (with its reason) when they are too few."""
        w = self.window
        if self._mean is None or self._m2 is None or self.passes < 2:
            if not self.ignored:
                return NullModel.uncalibrated("no null statistics: builders merged from replicas carry none yet; "
                                              "set the baseline on one server to calibrate", w)
            return NullModel.uncalibrated(f"no usable passes to calibrate from ({self.ignored} left out)", w)
        features = (self._mean.shape[0] - 2) // 2
        std = np.sqrt(np.maximum(self._m2, 0.0) / (self.passes - 1))
        if self.windows < MIN_WINDOWS:
            return replace_reason(self._model(std, 1.0, features), (
                f"a baseline of {self.passes} passes holds {self.windows} window(s) of {w}; calibration needs "
                f"{MIN_WINDOWS} ({MIN_WINDOWS * w} passes): set the baseline again with passes >= {MIN_WINDOWS * w}"))
        live = std > 0.0
        if not live.any():
            return replace_reason(self._model(std, 1.0, features), "every feature is constant in the baseline")
        b = self.windows
        bvar = (self._bsq - self._bsum**2 / b) / (b - 1)
        ratio = np.maximum(bvar[live], 0.0) / (std[live] ** 2 / w)
        return self._model(std, float(np.mean(ratio)), features)

    def _model(self, std: FloatArray, dispersion: float, features: int) -> NullModel:
        assert self._mean is not None
        return NullModel(self._mean.copy(), std, self.passes, self.window, self.windows, dispersion, features)


def replace_reason(model: NullModel, reason: str) -> NullModel:
    """``model`` marked uncalibrated for ``reason`` (its statistics kept, so a document still shows them)."""
    return NullModel(model.mean, model.std, model.passes, model.window, model.windows, model.dispersion,
                     model.features, reason)
