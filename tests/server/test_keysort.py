"""The integer-key sort of samples: exact against torch's float64 sort, and sync-free.

The keys path runs on CPU for samples above ``_DIRECT_MAX`` elements (padded to
``_RADIX_MIN`` below it), so the sizes below straddle both thresholds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from layertap.server.reducers import keysort
from layertap.server.reducers.keysort import sort_ascending
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.workspace import Workspace
from support.sync_guard import NoSyncMode
from support.tensors import gen, plant_nonfinite
from layertap.v1 import telemetry_pb2 as pb

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
SIZES = [0, 1, 7, keysort._DIRECT_MAX, keysort._DIRECT_MAX + 1, 16384, keysort._RADIX_MIN - 1,
         keysort._RADIX_MIN, 40_000]


def _special(dtype: torch.dtype) -> list[float]:
    """Values where an order-preserving key is easy to get wrong."""
    fi = torch.finfo(dtype)
    return [math.inf, -math.inf, 0.0, -0.0, fi.max, -fi.max, fi.tiny, -fi.tiny,
            fi.tiny / 4, -fi.tiny / 4, fi.eps, 1.0, -1.0]  # tiny/4: subnormal


def _float_sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = gen(seed)
    # Magnitudes over many binades, both signs, then the special values.
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (n,), generator=g)
    x = x.to(dtype)
    special = torch.tensor(_special(dtype), dtype=dtype)[:n]
    x[: special.numel()] = special
    return x


def _int_sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(n, generator=gen(seed)) > 0.5
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (n,), generator=gen(seed), dtype=dtype)
    ends = torch.tensor([info.min, info.max, 0, -1 if info.min < 0 else 1], dtype=dtype)[:n]
    x[: ends.numel()] = ends
    return x


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_sort_matches_float64_sort(dtype: torch.dtype, n: int) -> None:
    x = _float_sample(n, dtype) if dtype.is_floating_point else _int_sample(n, dtype)
    got = sort_ascending(x)
    ref = np.sort(x.to(torch.float64).numpy())
    assert got.dtype == torch.float64 and got.shape == (n,)
    np.testing.assert_array_equal(got.numpy(), ref)  # -0.0 == +0.0: their order is free


def test_largest_int64_ties_with_the_padding() -> None:
    # A real key equal to the pad key must still come back (the pad is never read).
    x = torch.full((5000,), torch.iinfo(torch.int64).max, dtype=torch.int64)
    x[:10] = -3
    got = sort_ascending(x)
    assert torch.equal(got, torch.sort(x.to(torch.float64)).values)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float16, np.float32, np.float64]),
        shape=st.sampled_from([3, 100, keysort._DIRECT_MAX + 3, 9000]),
        elements={"allow_nan": False},
    )
)
def test_sort_is_exact_on_arbitrary_floats(a: np.ndarray) -> None:
    # Hypothesis favours the awkward values: repeats, extremes, signed zeros, subnormals.
    got = sort_ascending(torch.from_numpy(a.copy()))
    np.testing.assert_array_equal(got.numpy(), np.sort(a.astype(np.float64)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_padded_key_sort_runs_without_sync(dtype: torch.dtype) -> None:
    # The default sample (16,384 of 200,000 elements) takes the padded radix
    # path: one integer sort of exactly _RADIX_MIN keys, and nothing larger.
    x = (torch.randn(50, 4000, generator=gen()) * 3).to(dtype)
    if dtype.is_floating_point:
        x.view(-1)[::97] = math.nan
        x.view(-1)[1::89] = math.inf
    specs = [pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM), pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES)]
    plan = ReducerPlan(build_reducers(specs))
    for _ in range(2):  # the first run also fills the per-device caches
        with NoSyncMode(sample_op_limit=keysort._RADIX_MIN) as mode:
            out = plan.run(x)
    sorts = [op for op in mode.ops if op.overloadpacket is torch.ops.aten.sort]
    assert len(sorts) == 1
    hist, quant = plan.decode(out.numpy(), x.shape)
    assert quant.quantiles.sample_size == hist.histogram.sample_size <= 16384
    assert all(math.isfinite(v) for v in quant.quantiles.values[1:-1])


def test_padded_path_sorts_integer_keys() -> None:
    x = torch.randn(100_000, generator=gen())
    seen: list[tuple[torch.dtype, int]] = []

    class Recorder(NoSyncMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func.overloadpacket is torch.ops.aten.sort:
                seen.append((args[0].dtype, args[0].numel()))
            return super().__torch_dispatch__(func, types, args, kwargs)

    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES)]))
    with Recorder():
        plan.run(x)
    expected = (torch.int32, keysort._RADIX_MIN) if keysort._HAS_RADIX else (torch.float64, 16384)
    assert seen == [expected]


@pytest.mark.parametrize("sample_size", [1000, keysort._DIRECT_MAX + 1, 16384])
def test_histogram_alone_counts_the_drawn_sample_exactly(sample_size: int) -> None:
    # Without quantiles a CPU histogram bucketizes small samples and sorts
    # larger ones on keys; both must count exactly the sample drawn.
    x = plant_nonfinite(torch.randn(300, 400, generator=gen(3)) * 4)
    edges = [-5.0, -1.0, -0.1, 0.0, 1 / 3, 2.0, 6.5]
    spec = pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM,
                          histogram=pb.HistogramParams(edges=edges, sample_size=sample_size))
    plan = ReducerPlan(build_reducers([spec]), seed=0)
    ws = Workspace(x, torch.Generator().manual_seed(0))  # the plan's first draw, replayed
    assert ws.sorts(sample_size) == (sample_size > keysort._DIRECT_MAX and keysort._HAS_RADIX)
    s, n = ws.sample(sample_size)
    drawn = np.sort(s.numpy())[: int(n)]  # NaN was mapped to +inf: drop it
    (h,) = plan.decode(plan.run(x).numpy(), x.shape)
    ref = np.bincount(np.searchsorted(edges, drawn, side="right"), minlength=len(edges) + 1)
    assert list(h.histogram.counts) == ref.tolist() and h.histogram.sample_size == int(n)
