"""Drift math against closed forms computed without the implementation's code path."""

from __future__ import annotations

import math
import warnings
from statistics import NormalDist

import numpy as np
import pytest

from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.scores import channel_drift_fraction, js_distance, mean_shift, psi, wasserstein1
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.drift.window import SlidingWindow

pytestmark = pytest.mark.unit


def normal_sample(mu: float, sigma: float, n: int) -> np.ndarray:
    """Stratified normal sample: the exact quantiles at (i + 0.5) / n, so no sampling noise."""
    inv = NormalDist(mu, sigma).inv_cdf
    return np.array([inv((i + 0.5) / n) for i in range(n)])


def bin_counts(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    # Independent of the implementation: a plain loop-free histogram with
    # [e_i, e_{i+1}) bins plus the open ends.
    inner = np.histogram(x, bins=np.concatenate(([-np.inf], edges, [np.inf])))[0]
    return inner.astype(np.int64)


@pytest.fixture(scope="module")
def base_sample() -> np.ndarray:
    return normal_sample(0.0, 1.0, 50_000)


@pytest.mark.parametrize("shift", [0.25, 1.0, 2.0])
def test_w1_of_shifted_normals_is_the_mean_difference(shift: float) -> None:
    sigma = 2.0
    a, b = normal_sample(0.0, sigma, 50_000), normal_sample(shift * sigma, sigma, 50_000)
    width = 0.01 * sigma
    edges = np.arange(-10 * sigma, 12 * sigma, width)
    lo, hi = min(a.min(), b.min()), max(a.max(), b.max())
    w = wasserstein1(edges, bin_counts(a, edges), bin_counts(b, edges), sigma, lo, hi)
    # W1(N(m1,s), N(m2,s)) = |m1 - m2|. Spreading mass uniformly inside a bin
    # moves any point by less than one bin width, so the histogram estimate is
    # within one width of the exact sample W1 (itself |m1-m2| exactly for two
    # stratified samples that differ by a shift). In baseline σ: width/σ.
    assert w == pytest.approx(shift, abs=width / sigma)


def test_identical_distributions_score_zero(base_sample: np.ndarray) -> None:
    b = BaselineBuilder("t", "l", seed=0)
    b.feed(base_sample, base_sample.size, base_sample.mean(), base_sample.std(), base_sample.min(), base_sample.max())
    base = b.freeze()
    assert psi(base.counts, base.counts) == 0.0
    assert js_distance(base.counts, base.counts) == 0.0
    assert wasserstein1(base.edges, base.counts, base.counts, base.std, base.min, base.max) == 0.0
    assert mean_shift(base.mean, base.std, base.mean) == 0.0
    # An independent draw of the same distribution stays far below every threshold.
    rng = np.random.default_rng(1)
    win = SlidingWindow.for_baseline(base, 10)
    for _ in range(10):
        x = rng.normal(size=5000)
        win.add(bin_counts(x, base.edges), x.size, x.mean(), x.std(), x.min(), x.max())
    score = win.score(base)
    assert score is not None
    assert score.psi < 0.01 and score.js < 0.03 and score.wasserstein < 0.03 and score.mean_shift < 0.03
    assert not score.drifted


def test_one_sigma_shift_crosses_all_thresholds(base_sample: np.ndarray) -> None:
    b = BaselineBuilder("t", "l", seed=0)
    for chunk in np.array_split(base_sample, 10):
        b.feed(chunk, chunk.size, chunk.mean(), chunk.std(), chunk.min(), chunk.max())
    base = b.freeze()
    win = SlidingWindow.for_baseline(base, 5)
    shifted = normal_sample(1.0, 1.0, 20_000)
    for chunk in np.array_split(shifted, 5):
        win.add(bin_counts(chunk, base.edges), chunk.size, chunk.mean(), chunk.std(), chunk.min(), chunk.max())
    score = win.score(base)
    assert score is not None
    t = DriftThresholds()
    assert score.psi > t.psi and score.js > t.js and score.wasserstein > t.wasserstein and score.mean_shift > t.mean_shift
    assert all(score.flags.values()) and score.drifted
    # On 20 quantile bins W1 reads somewhat above the true 1σ: the open end
    # bins are spread uniformly up to the observed extremes, which moves tail
    # mass outwards (documented in wasserstein1). It never under-reads here.
    assert 0.95 < score.wasserstein < 1.5


def test_empty_bins_are_stable() -> None:
    edges = np.array([-1.0, 0.0, 1.0])
    base = np.array([0, 10, 10, 0])
    cur = np.array([5, 0, 0, 15])  # mass only where the baseline has none, and vice versa
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no divide-by-zero or log(0) warnings
        vals = [psi(base, cur), js_distance(base, cur), wasserstein1(edges, base, cur, 1.0, -2.0, 2.0)]
        assert all(math.isfinite(v) for v in vals)
        assert js_distance(base, cur) == pytest.approx(1.0)  # disjoint supports
        # An all-zero current window: undefined, reported as NaN, never an error.
        zero = np.zeros(4, dtype=np.int64)
        assert math.isnan(psi(base, zero)) and math.isnan(js_distance(base, zero))
        assert math.isnan(wasserstein1(edges, base, zero, 1.0))


def test_window_without_data() -> None:
    b = BaselineBuilder("t", "l", seed=0)
    x = np.linspace(-1, 1, 101)
    b.feed(x, x.size, x.mean(), x.std(), -1, 1)
    base = b.freeze()
    win = SlidingWindow.for_baseline(base, 3)
    assert win.score(base) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        win.add(None, 0, math.nan, math.nan)  # a pass where only nonfinite ran
        s = win.score(base)
    assert s is not None and all(math.isnan(v) for v in s.as_dict().values()) and not s.drifted


def test_js_distance_bounds_and_symmetry() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, q = rng.integers(0, 5, 8), rng.integers(0, 5, 8)
        if p.sum() == 0 or q.sum() == 0:
            continue
        d = js_distance(p, q)
        assert 0.0 <= d <= 1.0
        assert d == pytest.approx(js_distance(q, p), abs=1e-15)
    # Closed form: p=(1,0), q=(1/2,1/2): JSD = 1.5 - 0.75*log2(3) bits... computed by hand:
    # m = (3/4, 1/4); KL(p||m) = log2(4/3); KL(q||m) = 0.5*log2(2/3) + 0.5*log2(2).
    jsd = 0.5 * math.log2(4 / 3) + 0.5 * (0.5 * math.log2(2 / 3) + 0.5 * math.log2(2))
    assert js_distance([1, 0], [1, 1]) == pytest.approx(math.sqrt(jsd), rel=1e-12)


def test_psi_hand_computed() -> None:
    eps = 1e-4
    expected, actual = [25, 25, 50], [50, 25, 25]
    # (0.5-0.25) ln((0.5+e)/(0.25+e)) + 0 + (0.25-0.5) ln((0.25+e)/(0.5+e)) = 0.5 ln((0.5+e)/(0.25+e))
    hand = 0.5 * math.log((0.5 + eps) / (0.25 + eps))
    assert psi(expected, actual, eps) == pytest.approx(hand, rel=1e-12)
    assert psi(expected, actual) == pytest.approx(0.3465, abs=1e-3)


def test_mean_shift_and_channel_fraction() -> None:
    assert mean_shift(1.0, 2.0, 4.0) == pytest.approx(1.5)
    assert mean_shift(0.0, 0.0, 0.0) == 0.0 and mean_shift(0.0, 0.0, 1.0) == math.inf
    frac = channel_drift_fraction([0, 0, 0, 0, 5], [1, 1, 1, 1, 0], [0.5, 2.0, -3.0, 0.0, 5.1], 1.0)
    assert frac == pytest.approx(3 / 5)


def test_thresholds_defaults_and_proto_zero_fields() -> None:
    t = DriftThresholds.from_fields(0.0, 0.3, 0.0, 0.0)
    assert t == DriftThresholds(psi=0.2, js=0.3, wasserstein=0.1, mean_shift=1.0)
    with pytest.raises(ValueError):
        DriftThresholds(psi=-1)


def test_sliding_window_eviction_matches_recomputation() -> None:
    rng = np.random.default_rng(3)
    edges = np.linspace(-2, 2, 9)
    w = 7
    win = SlidingWindow(w, edges.size + 1, ref=100.0, channels=3)
    passes = []
    for i in range(53):
        x = rng.normal(100.0 + 0.01 * i, 1.0 + 0.1 * (i % 5), size=int(rng.integers(50, 500)))
        ch = rng.normal(size=3)
        passes.append((x, ch))
        win.add(bin_counts(x - 100, edges), x.size, x.mean(), x.std(), x.min(), x.max(), ch)
        kept = passes[-w:]
        allx = np.concatenate([p[0] for p in kept])
        assert len(win) == len(kept)
        assert np.array_equal(win.counts, sum(bin_counts(p[0] - 100, edges) for p in kept))
        assert win.count == allx.size
        assert win.mean == pytest.approx(allx.mean(), rel=1e-12)
        assert win.std == pytest.approx(allx.std(), rel=1e-10)
        assert win.min == allx.min() and win.max == allx.max()
        want_ch = sum(p[1] * p[0].size for p in kept) / allx.size
        assert np.allclose(win.channel_mean, want_ch, rtol=1e-12, atol=1e-14)
