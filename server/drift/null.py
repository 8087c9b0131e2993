"""The no-change (null) model a calibrated drift alarm is set from.

What is modelled. Each live pass of a baselined layer gives a vector of
*components*: the per-feature means and spreads of the pass (the
``per_channel`` reducer's output, on the model's feature axis), then the
layer's pooled mean and spread (the ``moments`` reducer); the live path
(``layer.pass_components``) reads each spread as the mean of squares
``std² + mean²``, whose expectation does not depend on the batch size. A
layer without a feature axis (a derived per-token entropy, a ``(batch,)``
output) has the two pooled components only. Each pass carries a weight, its
element count ``n``: a pass's component has variance ``s²/n``, so the model
is set by count-weighted statistics, ``σ`` is the spread of a pass of the
mean count ``unit``, and a window's count-weighted mean has variance
``σ² unit / Σn`` (``σ²/W`` with equal weights). Passes are independent draws
of traffic, so under no change a window's mean is close to normal (central limit).

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

import dataclasses
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from layertap.server.drift.merge import chan_merge

__all__ = [
    "CUSUM_CLIP",
    "CUSUM_K",
    "MAX_PASSES",
    "MIN_WINDOWS",
    "NullAccumulator",
    "NullModel",
    "components",
    "cusum_arl0",
    "cusum_limit",
    "t_quantile",
]

FloatArray = npt.NDArray[np.float64]

#: Most passes of a baseline (SetBaseline's ``passes`` and ``window``), and of a saved null's counts.
MAX_PASSES = 100_000
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


def _t_quantile_cf(p: float, dof: float) -> float:
    """Cornish-Fisher approximation of :func:`t_quantile` (A&S 26.7.5): within 0.1% for ν >= 20."""
    z = -NormalDist().inv_cdf(p)
    v = float(dof)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / v + g2 / v**2 + g3 / v**3


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 5000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def t_sf(t: float, dof: float) -> float:
    """``P(T > t)`` for Student's t on ``dof`` degrees of freedom, ``t >= 0`` (regularized incomplete beta)."""
    v = float(dof)
    x = v / (v + t * t)
    a, b = v / 2, 0.5
    if x >= 1.0:
        return 0.5
    if x > (a + 1) / (a + b + 2):  # the tail near the centre (t below ~1.7): the symmetric form converges
        front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
        return 0.5 * (1.0 - front * _betacf(b, a, 1.0 - x) / b)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    return 0.5 * front * _betacf(a, b, x) / a


def t_quantile(p: float, dof: float) -> float:
    """The upper ``p`` quantile of Student's t (``P(T > t) = p``), ``0 < p < 0.5``, ``dof >= 1``.

    Exact (to ~1e-12 relative) for ν < 1000: the tail :func:`t_sf` inverted by bisection on ``log t``.
    For ν >= 1000 the Cornish-Fisher expansion of order 1/ν³ is used (within 1e-9 there). The
    expansion alone is far too small at the shortest baselines that calibrate (ν = 4: 55 against
    105 at p = 1e-8).
    """
    v = float(dof)
    if v >= 1000:
        return _t_quantile_cf(p, v)
    lo = max(-NormalDist().inv_cdf(p), 1e-6)  # the normal quantile is below t's
    hi = lo * 2
    while t_sf(hi, v) > p:
        lo, hi = hi, hi * 2
        if hi > 1e300:
            return math.inf
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if t_sf(mid, v) > p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return hi


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
    #: The mean weight (elements) of a baseline pass: ``std`` is the pass-to-pass spread of a pass of
    #: this weight, and a pass (or window) of weight ``w`` has variance ``std² · unit / w``.
    unit: float = 1.0

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

    def zscores(self, window_mean: FloatArray, window_weight: float) -> FloatArray:
        """The window's z-scores of the live components; ``window_mean`` weighted, ``window_weight`` its total weight.

        Unweighted passes (weight 1, ``unit`` 1) give ``window_weight`` = the window's passes.
        """
        spread = self.scale * math.sqrt(self.unit / window_weight + 1.0 / self.passes)
        return ((window_mean - self.mean) / spread)[self.live]

    def pass_z(self, x: FloatArray, weight: float = 1.0) -> FloatArray:
        """One pass's z-scores of the live components (for the CUSUM), for a pass of ``weight`` elements."""
        return ((x - self.mean) / (self.scale * math.sqrt(self.unit / weight + 1.0 / self.passes)))[self.live]

    def moved_constants(self, x: FloatArray) -> bool:
        """Whether a dead component woke up: exactly 0 in every baseline pass (a dead unit), not 0 now.

        A sum of zeros is exactly zero at any batch size, so no rounding moves a dead unit; the
        tolerance (1e-6 of the layer's pooled RMS, the last component's square root) only ignores
        denormal noise. A component constant at another value is left out of the test, as before.
        """
        dead = (self.std == 0.0) & (self.mean == 0.0)
        if not dead.any():
            return False
        tol = 1e-6 * math.sqrt(max(float(self.mean[-1]), 0.0)) + 1e-30
        return bool(np.any(np.abs(x[dead]) > tol))

    def p_value(self, score: float) -> float:
        """The Bonferroni p-value of a window's ``max |z|`` (normal tails)."""
        if math.isnan(score):
            return math.nan
        return min(1.0, 2 * max(self.tested, 1) * normal_tail(score))

    def as_dict(self) -> dict[str, object]:
        return {"mean": [float(x) for x in self.mean], "std": [float(x) for x in self.std], "passes": self.passes,
                "window": self.window, "windows": self.windows, "dispersion": float(self.dispersion),
                "features": self.features, "reason": self.reason, "unit": float(self.unit)}

    def rewindowed(self, window: int) -> NullModel:
        """The same null for a tumbling window of ``window`` passes (μ, σ are per pass; φ is kept)."""
        return dataclasses.replace(self, window=max(int(window), 1))

    @classmethod
    def uncalibrated(cls, reason: str, window: int = 1) -> NullModel:
        empty = np.empty(0, dtype=np.float64)
        return cls(empty, empty, 0, window, 0, 1.0, 0, reason)


class NullAccumulator:
    """Running null statistics of a baseline's passes (see the module docstring); not thread-safe."""

    def __init__(self, window: int) -> None:
        self.window = max(int(window), 1)
        self.passes = 0
        #: Total weight (elements) of the passes added, and of the open block.
        self.weight = 0.0
        self._block_w = 0.0
        self._bw = 0.0
        #: Passes left out: non-finite components, or a component count other than the first pass's.
        self.ignored = 0
        self._mean: FloatArray | None = None
        self._m2: FloatArray | None = None
        self._block = np.empty(0)
        self._block_n = 0
        self.windows = 0
        self._bsum = np.empty(0)
        self._bsq = np.empty(0)

    def add(self, x: npt.ArrayLike, weight: float = 1.0) -> bool:
        """Add one pass's components; False (and counted) when they cannot be used.

        ``weight``: the pass's elements (its moments' count). A pass of ``n`` elements has variance
        ~1/n, so passes are weighted by it: a baseline of batch-8 passes predicts the spread of
        batch-1 passes, and a baseline of mixed batch sizes that of a run of one size.
        """
        v = np.asarray(x, dtype=np.float64).ravel()
        w = float(weight)
        if (not np.all(np.isfinite(v)) or not (math.isfinite(w) and w > 0)
                or (self._mean is not None and v.shape != self._mean.shape)):
            self.ignored += 1
            return False
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = v.copy(), np.zeros_like(v)
            self._block, self._bsum, self._bsq = np.zeros_like(v), np.zeros_like(v), np.zeros_like(v)
        self.passes += 1
        self.weight += w
        d = v - self._mean
        self._mean += d * (w / self.weight)
        self._m2 += w * d * (v - self._mean)
        self._block += w * v
        self._block_w += w
        self._block_n += 1
        if self._block_n == self.window:
            b = self._block / self._block_w
            self._bsum += self._block_w * b
            self._bsq += self._block_w * b * b
            self._bw += self._block_w
            self.windows += 1
            self._block[:] = 0.0
            self._block_n = 0
            self._block_w = 0.0
        return True

    def merge(self, other: NullAccumulator) -> None:
        """Fold in another replica's passes (same window and components); partial windows are dropped."""
        if other._mean is None or other._m2 is None:
            return
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = other._mean.copy(), other._m2.copy()
            self._block, self._bsum, self._bsq = np.zeros_like(other._mean), other._bsum.copy(), other._bsq.copy()
            self.passes, self.windows = other.passes, other.windows
            self.weight, self._bw = other.weight, other._bw
        elif self._mean.shape == other._mean.shape and self.window == other.window:
            _, m, m2 = chan_merge(self.weight, self._mean, self._m2, other.weight, other._mean, other._m2)
            self._mean, self._m2 = np.asarray(m, dtype=np.float64), np.asarray(m2, dtype=np.float64)
            self.passes += other.passes
            self.weight += other.weight
            self._bsum, self._bsq = self._bsum + other._bsum, self._bsq + other._bsq
            self._bw += other._bw
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
        unit = self.weight / self.passes
        # Σ w (x - μ)² / (N - 1) estimates the variance of a pass of weight 1; ``std`` is that of a
        # pass of the mean weight ``unit`` (the plain pass-to-pass std when every weight is equal).
        s2 = np.maximum(self._m2, 0.0) / (self.passes - 1)
        std = np.sqrt(s2 / unit)
        if self.windows < MIN_WINDOWS:
            return replace_reason(self._model(std, 1.0, features), (
                f"a baseline of {self.passes} passes holds {self.windows} window(s) of {w}; calibration needs "
                f"{MIN_WINDOWS} ({MIN_WINDOWS * w} passes): set the baseline again with passes >= {MIN_WINDOWS * w}"))
        live = std > 0.0
        if not live.any():
            return replace_reason(self._model(std, 1.0, features), "every feature is constant in the baseline")
        b = self.windows
        # The weighted spread of the windows' means: s² φ (the pass model predicts s²).
        bvar = (self._bsq - self._bsum**2 / self._bw) / (b - 1)
        ratio = np.maximum(bvar[live], 0.0) / s2[live]
        return self._model(std, float(np.mean(ratio)), features)

    def _model(self, std: FloatArray, dispersion: float, features: int) -> NullModel:
        assert self._mean is not None
        return NullModel(self._mean.copy(), std, self.passes, self.window, self.windows, dispersion, features,
                         unit=self.weight / self.passes)


def replace_reason(model: NullModel, reason: str) -> NullModel:
    """``model`` marked uncalibrated for ``reason`` (its statistics kept, so a document still shows them)."""
    return dataclasses.replace(model, reason=reason)
