"""Quantiles over many distributions against a float64 numpy reference.

Three properties, each over normal, heavy-tailed, tied, bimodal and
adversarial data in every supported dtype:

* sampled: every value is within the reported rank error of p in the
  population's ECDF, and the reported error is the DKW bound of today's
  16,384-element sample (no larger);
* sampled, exactly: the values are ``np.quantile`` of the very sample drawn
  (bit for bit), so the sample sort and the host interpolation add no
  error of their own;
* unsampled (tensors smaller than the sample): ``np.quantile`` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from support.tensors import drawn_sample, gen, plant_nonfinite

from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.spec import DEFAULT_SAMPLE_SIZE, QUANTILE_DELTA
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

PS = [0.0, 0.001, 0.01, 0.05, 0.25, 1 / 3, 0.5, 0.75, 0.95, 0.99, 0.999, 1.0]
EDGES = [-1e30, -3.0, -0.1, 0.0, 1 / 3, 1.0, 2.5, 7.0, 1e4]
N = 60_000  # sampled: well above the default sample of 16,384


def _shuffle(x: torch.Tensor, seed: int = 5) -> torch.Tensor:
    return x[torch.randperm(x.numel(), generator=gen(seed))]


def _normal(n: int) -> torch.Tensor:
    return torch.randn(n, generator=gen(1), dtype=torch.float64)


# Each returns float64 values; the test casts them to the dtype under test.
DISTRIBUTIONS: dict[str, Callable[[int], torch.Tensor]] = {
    "normal": _normal,
    "offset_narrow": lambda n: 1000.0 + 0.01 * _normal(n),
    "lognormal_heavy": lambda n: torch.exp(3.0 * _normal(n)),
    "cauchy": lambda n: torch.tan(math.pi * (torch.rand(n, generator=gen(2), dtype=torch.float64) - 0.5)),
    "pareto_both_signs": lambda n: torch.sign(_normal(n)) * torch.rand(n, generator=gen(3), dtype=torch.float64) ** -2,
    "point_masses": lambda n: torch.randint(-2, 3, (n,), generator=gen(4)).double(),
    "relu_half_zero": lambda n: torch.relu(_normal(n)),
    "constant": lambda n: torch.full((n,), 7.25, dtype=torch.float64),
    "bimodal": lambda n: _shuffle(torch.cat([_normal(n // 2) * 0.1 - 5.0, _normal(n - n // 2) * 2.0 + 5.0])),
    "signed_zeros": lambda n: _shuffle(torch.cat([torch.zeros(n // 3), -torch.zeros(n // 3),
                                                   _normal(n - 2 * (n // 3))]).double()),
    "huge": lambda n: 1e30 * _normal(n),
    "sorted_input": lambda n: torch.sort(_normal(n)).values,  # memory order is not random
}
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return values.to(dtype)  # float16 overflows huge values to +-inf: fine, still data
    if dtype == torch.bool:
        return values > 0
    info = torch.iinfo(dtype)
    return values.round().clamp(info.min, info.max).to(dtype)


def _cases() -> list[tuple[str, torch.dtype]]:
    cases = [(d, t) for d in DISTRIBUTIONS for t in FLOAT_DTYPES]
    ints = ["normal", "point_masses", "pareto_both_signs", "sorted_input"]
    cases += [(d, t) for d in ints for t in (torch.int64, torch.int32, torch.uint8)]
    return cases + [("normal", torch.bool), ("point_masses", torch.bool)]


def _quantiles(x: torch.Tensor, sample_size: int = 0) -> tuple[pb.Quantiles, pb.Histogram]:
    specs = [
        pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES,
                       quantiles=pb.QuantileParams(probabilities=PS, sample_size=sample_size)),
        pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM,
                       histogram=pb.HistogramParams(edges=EDGES, sample_size=sample_size)),
    ]
    plan = ReducerPlan(build_reducers(specs), seed=0)
    q, h = plan.decode(plan.run(x).numpy(), x.shape)
    return q.quantiles, h.histogram


def _dkw(n: int) -> float:
    return math.sqrt(math.log(2 / QUANTILE_DELTA) / (2 * n)) + 1 / n


@pytest.mark.parametrize("dist, dtype", _cases(), ids=lambda v: str(v).removeprefix("torch."))
def test_sampled_quantiles_within_reported_rank_error(dist: str, dtype: torch.dtype) -> None:
    x = _cast(DISTRIBUTIONS[dist](N), dtype).reshape(60, -1)
    a = x.to(torch.float64).reshape(-1).numpy()
    v = np.sort(a[~np.isnan(a)])
    q, _ = _quantiles(x)
    assert q.population == N and q.sample_size == DEFAULT_SAMPLE_SIZE  # no NaN here
    # Today's bound, not a looser one: DKW (delta = 0.01) plus 1/n at n = 16,384.
    assert q.rank_error == pytest.approx(_dkw(DEFAULT_SAMPLE_SIZE)) and q.rank_error < 0.0128
    for p, val in zip(PS, q.values):
        below = np.searchsorted(v, val, "left") / v.size  # F(val-)
        at = np.searchsorted(v, val, "right") / v.size  # F(val)
        assert below - q.rank_error <= p <= at + q.rank_error, (p, val, below, at)
    assert v[0] <= q.values[0] and q.values[-1] <= v[-1]


@pytest.mark.parametrize("dist", ["normal", "lognormal_heavy", "point_masses", "bimodal", "signed_zeros",
                                  "sorted_input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64], ids=str)
@pytest.mark.parametrize("sample_size", [2048, DEFAULT_SAMPLE_SIZE, 40_000])
def test_sampled_quantiles_are_exact_for_the_drawn_sample(dist: str, dtype: torch.dtype, sample_size: int) -> None:
    # Every sample size must give numpy's answer on the sample itself, and
    # the histogram the sample's exact counts.
    x = _cast(DISTRIBUTIONS[dist](100_000), dtype)
    x.view(-1)[::13] = math.nan if dtype.is_floating_point else x.view(-1)[::13]
    sample = np.sort(drawn_sample(x, sample_size).numpy(), kind="stable")  # the plan's first draw, replayed
    q, h = _quantiles(x, sample_size)
    assert q.sample_size == sample.size == h.sample_size
    assert q.rank_error == pytest.approx(_dkw(sample.size))
    np.testing.assert_array_equal(q.values, np.quantile(sample, PS))
    ref = np.bincount(np.searchsorted(EDGES, sample, side="right"), minlength=len(EDGES) + 1)
    assert list(h.counts) == ref.tolist()


@pytest.mark.parametrize("size", [1, 2, 3, 10, 257, 4097, 10_000, DEFAULT_SAMPLE_SIZE])
@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_tensors_smaller_than_the_sample_are_exact(dist: str, size: int) -> None:
    for dtype in (torch.float32, torch.float16, torch.float64, torch.int32):
        x = _cast(DISTRIBUTIONS[dist](size), dtype)
        a = x.to(torch.float64).numpy()
        q, h = _quantiles(x)
        assert q.rank_error == 0.0 and q.sample_size == size
        v = a[np.isfinite(a)]
        if v.size == a.size:  # no +-inf (float16 overflows "huge"): numpy's lerp is defined
            np.testing.assert_array_equal(q.values, np.quantile(a, PS))
        ref = np.bincount(np.searchsorted(EDGES, a, side="right"), minlength=len(EDGES) + 1)
        assert list(h.counts) == ref.tolist()


@pytest.mark.parametrize("size", [20, 3000, 10_000, N])
def test_nan_and_inf_follow_the_contract(size: int) -> None:
    # NaN is excluded (sample_size counts the rest); +-inf are ordinary extremes.
    x = plant_nonfinite(_normal(size).float())
    a = x.double().numpy()
    v = np.sort(a[~np.isnan(a)])
    q, h = _quantiles(x)
    assert q.values[0] == -math.inf and q.values[-1] == math.inf
    if size <= DEFAULT_SAMPLE_SIZE:
        assert q.sample_size == v.size and q.rank_error == 0.0
    else:
        assert 0.8 * DEFAULT_SAMPLE_SIZE < q.sample_size < DEFAULT_SAMPLE_SIZE
        assert q.rank_error == pytest.approx(_dkw(q.sample_size))
    assert h.sample_size == q.sample_size
    for p, val in zip(PS, q.values):
        below, at = np.searchsorted(v, val, "left") / v.size, np.searchsorted(v, val, "right") / v.size
        assert below - q.rank_error - 1 / v.size <= p <= at + q.rank_error + 1 / v.size, (p, val)


@pytest.mark.parametrize("size", [0, 1, 20_000])
def test_all_nan_and_empty_give_nan_quantiles(size: int) -> None:
    for x in (torch.full((size,), math.nan), torch.full((size,), math.nan, dtype=torch.bfloat16)):
        q, h = _quantiles(x)
        assert q.sample_size == 0 and h.sample_size == 0 and sum(h.counts) == 0
        assert len(q.values) == len(PS) and all(math.isnan(val) for val in q.values)
        assert q.rank_error == (1.0 if size > DEFAULT_SAMPLE_SIZE else 0.0)
