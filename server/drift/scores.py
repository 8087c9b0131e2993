"""Drift scores between a frozen baseline and a sliding window of live passes.

Everything here is pure numpy over histograms that share one set of inner bin
edges ``e_0 < ... < e_{n-1}``; counts have ``n + 1`` entries, the first and
last being the open bins ``(-inf, e_0)`` and ``[e_{n-1}, +inf)`` (the layout of
``layertap.v1.Histogram``).

Scores (the metric names are the ``metric`` label of
``layertap_activation_drift``):

``psi``
    Population stability index with one shared ε added to both proportion
    vectors. Usual reading: < 0.1 no significant shift, 0.1-0.25 moderate,
    > 0.25 significant. Default threshold 0.2.
``js``
    Jensen-Shannon *distance* (square root of the divergence), base 2, so it
    lies in [0, 1]. Default threshold 0.1.
``wasserstein``
    Wasserstein-1 between the histogram CDFs, divided by the baseline std, so
    it reads "the distributions moved this many baseline σ". Default 0.1.
``mean_shift``
    ``|mean_now - mean_base| / std_base``. Default threshold 1.0.

Empty inputs (a histogram whose counts sum to zero) score NaN rather than
raising: a NaN never crosses a threshold, and Prometheus carries it as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from layertap.server.drift.alarm import AlarmReading
from layertap.server.drift.thresholds import DRIFT_METRICS, DriftThresholds

__all__ = [
    "PSI_EPS",
    "DriftScore",
    "channel_drift_fraction",
    "js_distance",
    "mean_shift",
    "psi",
    "wasserstein1",
]

FloatArray = npt.NDArray[np.float64]

#: The shared ε added to every proportion before PSI's log ratio. Small enough
#: not to move PSI for bins with >= 1% mass, large enough that an empty bin on
#: one side contributes a bounded ~p*ln(p/ε) instead of infinity.
PSI_EPS = 1e-4


def _proportions(counts: npt.ArrayLike) -> FloatArray | None:
    """Counts → proportions in float64, or None when the total is zero."""
    c = np.asarray(counts, dtype=np.float64)
    total = float(c.sum())
    if not total > 0.0:
        return None
    return c / total


def psi(expected_counts: npt.ArrayLike, actual_counts: npt.ArrayLike, eps: float = PSI_EPS) -> float:
    """Population stability index, natural log, one shared ε.

    ``PSI = Σ (a_i - e_i) ln(a_i / e_i)`` with ``a_i, e_i`` the proportions plus
    ``eps``. The same ε on both sides keeps ``Σ (a_i - e_i) = 0`` and makes empty
    bins finite. Bands: < 0.1 stable, 0.1-0.25 moderate, > 0.25 significant.

    Args:
        expected_counts: Baseline bin counts.
        actual_counts: Current bin counts, same length.
        eps: The shared ε (> 0).

    Returns:
        PSI >= 0, or NaN when either histogram is empty.
    """
    e, a = _proportions(expected_counts), _proportions(actual_counts)
    if e is None or a is None:
        return math.nan
    if e.shape != a.shape:
        raise ValueError(f"histograms differ in length: {e.shape[0]} vs {a.shape[0]}")
    e = e + eps
    a = a + eps
    return float(np.sum((a - e) * np.log(a / e)))


def js_distance(p: npt.ArrayLike, q: npt.ArrayLike) -> float:
    """Jensen-Shannon distance, base 2: ``sqrt(JSD(p, q))`` in [0, 1].

    ``p`` and ``q`` may be counts or proportions; both are normalised. Empty
    bins need no ε because ``0 · log 0 = 0`` and ``m = (p+q)/2 > 0`` wherever
    either side has mass.

    Returns:
        The distance, or NaN when either input is empty.
    """
    pp, qq = _proportions(p), _proportions(q)
    if pp is None or qq is None:
        return math.nan
    if pp.shape != qq.shape:
        raise ValueError(f"histograms differ in length: {pp.shape[0]} vs {qq.shape[0]}")
    m = 0.5 * (pp + qq)

    def kl(x: FloatArray) -> float:
        nz = x > 0
        return float(np.sum(x[nz] * np.log2(x[nz] / m[nz])))

    jsd = 0.5 * kl(pp) + 0.5 * kl(qq)
    # Rounding can leave a tiny negative or a hair above 1.
    return math.sqrt(min(max(jsd, 0.0), 1.0))


def _scaled(distance: float, scale: float) -> float:
    """``distance / scale`` that treats a zero scale (a constant layer) sanely."""
    if math.isnan(distance) or math.isnan(scale):
        return math.nan
    if scale > 0.0:
        return distance / scale
    return 0.0 if distance == 0.0 else math.inf


def wasserstein1(
    edges: npt.ArrayLike,
    counts_a: npt.ArrayLike,
    counts_b: npt.ArrayLike,
    baseline_std: float,
    lo: float | None = None,
    hi: float | None = None,
) -> float:
    """Wasserstein-1 between two histograms on shared edges, in baseline σ.

    Mass is spread uniformly inside each bin, so both CDFs are piecewise
    linear on the grid ``[lo, e_0, ..., e_{n-1}, hi]`` and ``∫|F_a - F_b| dx`` is
    computed exactly per bin (a trapezoid, or two triangles when the CDF
    difference changes sign inside the bin).

    The open end bins are clamped to ``[lo, e_0)`` and ``[e_{n-1}, hi]``: pass
    the lowest and highest values observed on either side (the baseline stores
    its min/max, the window tracks its own). ``None`` gives the end bins zero
    width, i.e. their mass sits on the outer edge, which under-estimates W1
    for mass far in the tails.

    Args:
        edges: Inner edges, strictly increasing.
        counts_a: Counts, ``len(edges) + 1`` entries.
        counts_b: Counts, same layout.
        baseline_std: Divisor; 0 gives 0 for identical inputs and inf otherwise.
        lo: Left end of the open low bin.
        hi: Right end of the open high bin.

    Returns:
        W1 / baseline_std, or NaN when either histogram is empty.
    """
    e = np.asarray(edges, dtype=np.float64)
    a, b = _proportions(counts_a), _proportions(counts_b)
    if a is None or b is None:
        return math.nan
    if a.shape != b.shape or a.shape[0] != e.shape[0] + 1:
        raise ValueError(f"need {e.shape[0] + 1} counts for {e.shape[0]} edges, got {a.shape[0]} and {b.shape[0]}")
    left = e[0] if lo is None or not math.isfinite(lo) else min(float(lo), float(e[0]))
    right = e[-1] if hi is None or not math.isfinite(hi) else max(float(hi), float(e[-1]))
    widths = np.diff(np.concatenate(([left], e, [right])))
    # CDF difference at every grid point: 0 at lo, the cumulative sums after.
    d = np.concatenate(([0.0], np.cumsum(a - b)))
    d0, d1 = d[:-1], d[1:]
    ad0, ad1 = np.abs(d0), np.abs(d1)
    denom = np.where(ad0 + ad1 > 0.0, ad0 + ad1, 1.0)
    area = np.where(
        d0 * d1 >= 0.0,
        widths * (ad0 + ad1) * 0.5,  # no sign change: trapezoid
        widths * (d0 * d0 + d1 * d1) / (2.0 * denom),  # crosses zero: two triangles
    )
    return _scaled(float(area.sum()), float(baseline_std))


def mean_shift(base_mean: float, base_std: float, cur_mean: float) -> float:
    """``|cur_mean - base_mean| / base_std`` (absolute, so one threshold fits both ways)."""
    return _scaled(abs(float(cur_mean) - float(base_mean)), float(base_std))


def channel_drift_fraction(
    base_means: npt.ArrayLike,
    base_stds: npt.ArrayLike,
    cur_means: npt.ArrayLike,
    threshold: float = 1.0,
) -> float:
    """Fraction of channels whose mean moved more than ``threshold`` baseline σ.

    Raises:
        ValueError: When the channel counts differ.
    """
    bm = np.asarray(base_means, dtype=np.float64)
    bs = np.asarray(base_stds, dtype=np.float64)
    cm = np.asarray(cur_means, dtype=np.float64)
    if not (bm.shape == bs.shape == cm.shape) or bm.ndim != 1:
        raise ValueError(f"channel shapes differ: {bm.shape}, {bs.shape}, {cm.shape}")
    if bm.size == 0:
        return math.nan
    diff = np.abs(cm - bm)
    with np.errstate(divide="ignore", invalid="ignore"):
        # A constant channel (σ=0) drifts as soon as its mean moves at all.
        shifted = np.where(bs > 0.0, diff / np.where(bs > 0.0, bs, 1.0) > threshold, diff > 0.0)
    return float(np.count_nonzero(shifted)) / bm.size


@dataclass(frozen=True)
class DriftScore:
    """The four scores of one layer against its baseline."""

    psi: float
    js: float
    wasserstein: float
    mean_shift: float
    thresholds: DriftThresholds = field(default_factory=DriftThresholds)
    #: Passes in the current window, and in the baseline.
    window_passes: int = 0
    baseline_passes: int = 0
    #: Fraction of channels past the mean-shift threshold; None when not tapped.
    channel_drift_fraction: float | None = None
    #: The calibrated alarm (None: scores computed without one, e.g. in a unit test of the four scores).
    alarm: AlarmReading | None = None

    def as_dict(self) -> dict[str, float]:
        """``{metric: score}`` in ``DRIFT_METRICS`` order."""
        return {m: float(getattr(self, m)) for m in DRIFT_METRICS}

    @property
    def flags(self) -> dict[str, bool]:
        """``{metric: score > threshold}``; NaN never counts as drift."""
        t = self.thresholds.as_dict()
        return {m: bool(v > t[m]) for m, v in self.as_dict().items()}

    @property
    def drifted(self) -> bool:
        """The alarm: calibrated, or (fixed thresholds, or no alarm attached) any of the four scores over its threshold."""
        if self.alarm is not None:
            return self.alarm.alarm
        return any(self.flags.values())
