"""The sliding window of live passes that drift is scored on.

Scores are recomputed on every pass, so the window keeps running totals and
adds/evicts in O(1) instead of re-summing W passes each time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.scores import DriftScore, channel_drift_fraction, js_distance, mean_shift, psi, wasserstein1
from layertap.server.drift.thresholds import DriftThresholds

__all__ = ["SlidingWindow"]

FloatArray = npt.NDArray[np.float64]


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
