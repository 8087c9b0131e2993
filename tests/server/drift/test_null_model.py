"""The no-change model's edges: false-alarm rate bounds, count weighting, an old v3 null, the exact t tail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from layertap.server.drift.alarm import WindowAlarm
from layertap.server.drift.null import NullAccumulator, t_quantile, t_sf
from layertap.server.drift.rates import MIN_FALSE_ALARM_RATE, check_rate
from layertap.server.drift.schema import BaselineFormatError, _null_from_dict
from layertap.server.errors import InvalidField

pytestmark = pytest.mark.unit


def test_rate_bounds_and_the_smallest_rate_gives_finite_thresholds() -> None:
    with pytest.raises(InvalidField, match="rate"):
        check_rate(1e-300)
    assert check_rate(MIN_FALSE_ALARM_RATE) == MIN_FALSE_ALARM_RATE
    acc = NullAccumulator(1000)
    rng = np.random.default_rng(0)
    for _ in range(5000):
        acc.add(rng.standard_normal(2 * 4096 + 2))
    a = WindowAlarm(acc.freeze(), MIN_FALSE_ALARM_RATE)
    assert math.isfinite(a.threshold) and math.isfinite(a.limit)


def test_weighted_passes_predict_the_spread_of_another_batch_size() -> None:
    rng = np.random.default_rng(1)
    acc = NullAccumulator(10)
    for _ in range(500):
        n = int(rng.integers(1, 9))
        acc.add(rng.standard_normal(4) / math.sqrt(n), weight=n)  # variance 1/n
    m = acc.freeze()
    z = np.array([m.pass_z(rng.standard_normal(4), 1.0) for _ in range(4000)])  # batch-1 passes
    assert 0.9 < float(z.std()) < 1.1


def test_t_tail_and_quantile_agree() -> None:
    for dof in (4, 9, 30, 500):
        for p in (1e-3, 1e-9):
            assert t_sf(t_quantile(p, dof), dof) == pytest.approx(p, rel=1e-9)


def test_an_unweighted_v3_null_loads_uncalibrated_and_huge_counts_are_refused() -> None:
    d = {"mean": [0.0] * 4, "std": [1.0] * 4, "passes": 100, "window": 10, "windows": 10, "dispersion": 1.0,
         "features": 1, "reason": ""}
    assert "set the baseline again" in _null_from_dict(d).reason
    assert _null_from_dict({**d, "unit": 8.0}).calibrated
    assert "constant" in _null_from_dict({**d, "unit": 8.0, "std": [0.0] * 4}).reason
    assert "window" in _null_from_dict({**d, "unit": 8.0, "windows": 0}).reason
    with pytest.raises(BaselineFormatError, match="passes"):
        _null_from_dict({**d, "unit": 8.0, "passes": 10**400})
