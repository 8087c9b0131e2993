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
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # baseline.py imports this module at run time.
    from layertap.server.drift.baseline import Baseline

__all__ = [
    "DRIFT_METRICS",
    "PSI_EPS",
    "DriftScore",
    "DriftThresholds",
    "SlidingWindow",
    "channel_drift_fraction",
    "js_distance",
    "mean_shift",
    "psi",
    "wasserstein1",
]

FloatArray = npt.NDArray[np.float64]

#: Order of the four scores everywhere (labels, dicts, LayerDrift fields).
DRIFT_METRICS: tuple[str, ...] = ("psi", "js", "wasserstein", "mean_shift")

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
class DriftThresholds:
    """Per-tap thresholds; a score strictly above its threshold counts as drift."""

    psi: float = 0.2
    js: float = 0.1
    wasserstein: float = 0.1
    mean_shift: float = 1.0

    def __post_init__(self) -> None:
        for name in DRIFT_METRICS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"drift threshold {name} must be a positive finite number, got {v!r}")

    @classmethod
    def from_fields(cls, psi: float = 0.0, js: float = 0.0, wasserstein: float = 0.0, mean_shift: float = 0.0) -> DriftThresholds:
        """Build from proto-style fields where 0 (or anything non-positive) means "default"."""
        d = cls()

        def pick(v: float, default: float) -> float:
            return float(v) if math.isfinite(v) and v > 0 else default

        return cls(pick(psi, d.psi), pick(js, d.js), pick(wasserstein, d.wasserstein), pick(mean_shift, d.mean_shift))

    @classmethod
    def from_message(cls, msg: Any) -> DriftThresholds:
        """From a ``layertap.v1.DriftThresholds`` (duck-typed; zero fields take defaults)."""
        return cls.from_fields(msg.psi, msg.js, msg.wasserstein, msg.mean_shift)

    def as_dict(self) -> dict[str, float]:
        """``{metric: threshold}`` in ``DRIFT_METRICS`` order."""
        return {m: float(getattr(self, m)) for m in DRIFT_METRICS}


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
        """True when any of the four scores is above its threshold."""
        return any(self.flags.values())


@dataclass
class _Pass:
    counts: npt.NDArray[np.int64] | None
    n: int
    s1: float  # n * (mean - ref)
    s2: float  # m2 + n * (mean - ref)^2, i.e. Σ (x - ref)^2
    chan: FloatArray | None  # per-channel means weighted by n


class SlidingWindow:
    """The last ``window`` passes of one layer, with O(1) add and evict.

    Running totals are kept for the histogram counts (int64, exact), the
    element count, and the first two moments *centred on a reference* (the
    baseline mean): centring keeps ``Σ(x-ref)^2 - n·mean^2`` from cancelling
    catastrophically when the mean is large compared with the std. Float
    totals that are added to and subtracted from accumulate rounding, so they
    are recomputed from the stored passes once every ``window`` evictions,
    which keeps add/evict amortised O(1) and the error bounded. Min and max
    use monotonic deques (amortised O(1)).
    """

    def __init__(self, window: int, bins: int, ref: float = 0.0, channels: int | None = None) -> None:
        """Create an empty window.

        Args:
            window: Passes kept (W >= 1).
            bins: Histogram counts per pass (``len(edges) + 1``).
            ref: Centre for the moment totals; use the baseline mean.
            channels: Per-channel means expected per pass, if tapped.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self.bins = int(bins)
        self.ref = float(ref)
        self.channels = channels
        self._passes: deque[_Pass] = deque()
        self._seq = 0  # index of the next pass
        self._mins: deque[tuple[int, float]] = deque()
        self._maxs: deque[tuple[int, float]] = deque()
        self._evictions = 0
        self._reset_totals()

    @classmethod
    def for_baseline(cls, baseline: Baseline, window: int | None = None) -> SlidingWindow:
        """A window shaped for ``baseline`` (its edges, mean and channel count)."""
        channels = None if baseline.channel_mean is None else int(baseline.channel_mean.shape[0])
        return cls(window or baseline.window, baseline.edges.shape[0] + 1, baseline.mean, channels)

    def _reset_totals(self) -> None:
        self._counts = np.zeros(self.bins, dtype=np.int64)
        self._hist_passes = 0
        self._n = 0
        self._s1 = 0.0
        self._s2 = 0.0
        self._chan = None if self.channels is None else np.zeros(self.channels, dtype=np.float64)
        self._chan_n = 0

    def add(
        self,
        counts: npt.ArrayLike | None,
        count: int,
        mean: float,
        std: float,
        min: float = math.nan,  # noqa: A002 - mirrors the reducer field names
        max: float = math.nan,  # noqa: A002
        channel_mean: npt.ArrayLike | None = None,
    ) -> None:
        """Add one pass and evict the oldest beyond ``window``.

        Args:
            counts: Histogram counts on the baseline's edges, or None when this
                pass ran no histogram.
            count: Elements the moments cover (0 when moments did not run).
            mean: Mean of the pass.
            std: Population std of the pass (ddof=0).
            min: Smallest value seen in the pass (NaN if unknown).
            max: Largest value seen in the pass (NaN if unknown).
            channel_mean: Per-channel means, if tapped.

        Raises:
            ValueError: On a histogram or channel vector of the wrong length.
        """
        c: npt.NDArray[np.int64] | None = None
        if counts is not None:
            c = np.asarray(counts, dtype=np.int64)
            if c.shape != (self.bins,):
                raise ValueError(f"expected {self.bins} histogram counts, got {c.shape}")
        n = int(count)
        s1 = s2 = 0.0
        if n > 0 and math.isfinite(mean) and math.isfinite(std):
            dm = float(mean) - self.ref
            s1 = n * dm
            s2 = n * (float(std) ** 2 + dm * dm)
        else:
            n = 0
        ch: FloatArray | None = None
        if channel_mean is not None and self.channels is not None and n > 0:
            cm = np.asarray(channel_mean, dtype=np.float64)
            if cm.shape != (self.channels,):
                raise ValueError(f"expected {self.channels} channel means, got {cm.shape}")
            ch = cm * n
        p = _Pass(c, n, s1, s2, ch)
        self._passes.append(p)
        self._apply(p, +1)
        seq = self._seq
        self._seq += 1
        if not math.isnan(min):
            while self._mins and self._mins[-1][1] >= min:
                self._mins.pop()
            self._mins.append((seq, float(min)))
        if not math.isnan(max):
            while self._maxs and self._maxs[-1][1] <= max:
                self._maxs.pop()
            self._maxs.append((seq, float(max)))
        if len(self._passes) > self.window:
            self._evict()

    def _apply(self, p: _Pass, sign: int) -> None:
        if p.counts is not None:
            self._counts += sign * p.counts
            self._hist_passes += sign
        self._n += sign * p.n
        self._s1 += sign * p.s1
        self._s2 += sign * p.s2
        if p.chan is not None and self._chan is not None:
            self._chan += sign * p.chan
            self._chan_n += sign * p.n

    def _evict(self) -> None:
        old = self._passes.popleft()
        first = self._seq - len(self._passes)  # seq of the oldest pass still kept
        while self._mins and self._mins[0][0] < first:
            self._mins.popleft()
        while self._maxs and self._maxs[0][0] < first:
            self._maxs.popleft()
        self._evictions += 1
        if self._evictions % self.window == 0:
            self._recompute()
        else:
            self._apply(old, -1)

    def _recompute(self) -> None:
        """Rebuild the float totals from the kept passes (bounds rounding drift)."""
        self._reset_totals()
        for p in self._passes:
            self._apply(p, +1)
        self._s1 = math.fsum(p.s1 for p in self._passes)
        self._s2 = math.fsum(p.s2 for p in self._passes)

    def __len__(self) -> int:
        return len(self._passes)

    @property
    def counts(self) -> npt.NDArray[np.int64]:
        """Summed histogram counts over the window (a copy)."""
        return self._counts.copy()

    @property
    def count(self) -> int:
        """Elements covered by the window's moments."""
        return self._n

    @property
    def mean(self) -> float:
        """Mean over the window (NaN when empty)."""
        return self.ref + self._s1 / self._n if self._n > 0 else math.nan

    @property
    def std(self) -> float:
        """Population std over the window (NaN when empty)."""
        if self._n <= 0:
            return math.nan
        d = self._s1 / self._n
        return math.sqrt(max(self._s2 / self._n - d * d, 0.0))

    @property
    def min(self) -> float:
        """Smallest value over the window (NaN when unknown)."""
        return self._mins[0][1] if self._mins else math.nan

    @property
    def max(self) -> float:
        """Largest value over the window (NaN when unknown)."""
        return self._maxs[0][1] if self._maxs else math.nan

    @property
    def channel_mean(self) -> FloatArray | None:
        """Per-channel means over the window, or None when not tapped."""
        if self._chan is None or self._chan_n <= 0:
            return None
        return self._chan / self._chan_n

    def score(self, baseline: Baseline, thresholds: DriftThresholds | None = None) -> DriftScore | None:
        """Score the window against ``baseline``.

        Args:
            baseline: A frozen baseline with the same edges as the counts fed.
            thresholds: Overrides ``baseline.thresholds``.

        Returns:
            The scores, or None while the window holds no pass. Histogram-based
            scores are NaN while no pass in the window carried a histogram.
        """
        if not self._passes:
            return None
        thr = thresholds or baseline.thresholds
        base_counts = baseline.counts
        if base_counts.shape[0] != self.bins:
            raise ValueError(f"baseline has {base_counts.shape[0]} bins, window {self.bins}")
        lo = np.nanmin([baseline.min, self.min]) if not (math.isnan(baseline.min) and math.isnan(self.min)) else None
        hi = np.nanmax([baseline.max, self.max]) if not (math.isnan(baseline.max) and math.isnan(self.max)) else None
        cur = self._counts
        cf: float | None = None
        cm = self.channel_mean
        if cm is not None and baseline.channel_mean is not None and baseline.channel_std is not None:
            cf = channel_drift_fraction(baseline.channel_mean, baseline.channel_std, cm, thr.mean_shift)
        return DriftScore(
            psi=psi(base_counts, cur),
            js=js_distance(base_counts, cur),
            wasserstein=wasserstein1(
                baseline.edges, base_counts, cur, baseline.std,
                None if lo is None else float(lo), None if hi is None else float(hi),
            ),
            mean_shift=mean_shift(baseline.mean, baseline.std, self.mean) if self._n > 0 else math.nan,
            thresholds=thr,
            window_passes=len(self._passes),
            baseline_passes=baseline.passes,
            channel_drift_fraction=cf,
        )
