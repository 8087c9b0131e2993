"""The sample sort (numpy on CPU): exact against torch's own float64 sort, in every dtype and layout.

The reference is ``torch.sort`` of the float64 values, a different sort from
the one under test. Histograms are checked against the replayed draw.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.sync_guard import NoSyncMode
from support.tensors import drawn_sample, gen, plant_nonfinite

from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.samplesort import sort_ascending
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
SIZES = [0, 1, 7, 2048, 16384, 40_000]


def _special(dtype: torch.dtype) -> list[float]:
    """Values where a sort is easy to get wrong."""
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


def _reference(x: torch.Tensor) -> np.ndarray:
    return torch.sort(x.to(torch.float64)).values.numpy()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_sort_matches_float64_sort(dtype: torch.dtype, n: int) -> None:
    x = _float_sample(n, dtype) if dtype.is_floating_point else _int_sample(n, dtype)
    got = sort_ascending(x)
    assert got.dtype == torch.float64 and got.shape == (n,)
    np.testing.assert_array_equal(got.numpy(), _reference(x))  # -0.0 == +0.0: their order is free
    assert torch.equal(x, _float_sample(n, dtype) if dtype.is_floating_point else _int_sample(n, dtype))


def test_int64_extremes_survive() -> None:
    # No float round trip: int64 values beyond 2**53 keep their order (then round once to float64).
    x = torch.full((5000,), torch.iinfo(torch.int64).max, dtype=torch.int64)
    x[:10] = -3
    x[10:20] = 2**53 + 1
    np.testing.assert_array_equal(sort_ascending(x).numpy(), _reference(x))


@pytest.mark.parametrize("layout", ["strided", "inference", "requires_grad"])
def test_tensors_numpy_cannot_view_directly(layout: str) -> None:
    # A strided sample, an inference-mode tensor and one that requires grad
    # all sort through numpy without copying back wrong values or raising.
    base = _float_sample(9000, torch.float32, seed=4)
    if layout == "strided":
        x = base[::3]
    elif layout == "inference":
        with torch.inference_mode():
            x = base * 1.0
    else:
        x = base.clone().requires_grad_()
    np.testing.assert_array_equal(sort_ascending(x).numpy(), _reference(x.detach()))


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float16, np.float32, np.float64]),
        shape=st.sampled_from([3, 100, 2051, 9000]),
        elements={"allow_nan": False},
    )
)
def test_sort_is_exact_on_arbitrary_floats(a: np.ndarray) -> None:
    # Hypothesis favours the awkward values: repeats, extremes, signed zeros, subnormals.
    x = torch.from_numpy(a.copy())
    np.testing.assert_array_equal(sort_ascending(x).numpy(), _reference(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_distribution_plan_runs_without_sync(dtype: torch.dtype) -> None:
    # Histogram and quantiles share one drawn sample, and no op the plan
    # dispatches syncs or runs on more than the sample.
    x = (torch.randn(50, 4000, generator=gen()) * 3).to(dtype)
    if dtype.is_floating_point:
        x.view(-1)[::97] = math.nan
        x.view(-1)[1::89] = math.inf
    specs = [pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM), pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES)]
    plan = ReducerPlan(build_reducers(specs))
    for _ in range(2):  # the first run also fills the per-device caches
        with NoSyncMode(sample_op_limit=16384) as mode:
            out = plan.run(x)
    draws = [op for op in mode.ops if op.overloadpacket is torch.ops.aten.randint]
    assert len(draws) == 1
    hist, quant = plan.decode(out.numpy(), x.shape)
    assert quant.quantiles.sample_size == hist.histogram.sample_size <= 16384
    assert all(math.isfinite(v) for v in quant.quantiles.values[1:-1])


@pytest.mark.parametrize("sample_size", [7, 1000, 2049, 16384, 200_000])
def test_histogram_alone_counts_the_drawn_sample_exactly(sample_size: int) -> None:
    # Sampled and whole-tensor histograms count exactly the values drawn.
    x = plant_nonfinite(torch.randn(300, 400, generator=gen(3)) * 4)
    edges = [-5.0, -1.0, -0.1, 0.0, 1 / 3, 2.0, 6.5]
    spec = pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM,
                          histogram=pb.HistogramParams(edges=edges, sample_size=sample_size))
    plan = ReducerPlan(build_reducers([spec]), seed=0)
    drawn = drawn_sample(x, sample_size).numpy()
    (h,) = plan.decode(plan.run(x).numpy(), x.shape)
    ref = np.bincount(np.searchsorted(edges, drawn, side="right"), minlength=len(edges) + 1)
    assert list(h.histogram.counts) == ref.tolist() and h.histogram.sample_size == drawn.size


def test_views_numpy_refuses_fall_back_or_resolve() -> None:
    # An integer negative-bit view (no copy before the sort when it fits the
    # sample), and an activation inside torch.func.grad (a wrapped tensor
    # without storage): both still reduce, against float64 references.
    specs = [pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM), pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES)]
    plan = ReducerPlan(build_reducers(specs))
    x = torch._neg_view(torch.arange(100, dtype=torch.int32))
    _, q = plan.decode(plan.run(x).numpy(), x.shape)
    ref = -np.arange(100, dtype=np.float64)
    assert list(q.quantiles.values) == np.quantile(ref, list(q.quantiles.probabilities)).tolist()

    seen: list[torch.Tensor] = []

    def loss(w: torch.Tensor) -> torch.Tensor:
        h = w * 2.0
        seen.append(plan.run(h))
        return h.sum()

    w = torch.linspace(-3.0, 5.0, 100, dtype=torch.float64)
    torch.func.grad(loss)(w)
    _, q = plan.decode(seen[0].numpy(), w.shape)
    np.testing.assert_array_equal(q.quantiles.values, np.quantile(2.0 * w.numpy(), list(q.quantiles.probabilities)))


def test_functionalized_samples_sort_their_values() -> None:
    # A functionalized tensor's numpy() would read its wrapper's storage: the
    # sort must see the values (torch.sort), not that memory.
    x = _float_sample(300, torch.float32, seed=6)
    got: list[torch.Tensor] = []

    def f(a: torch.Tensor) -> torch.Tensor:
        got.append(sort_ascending(a * 1.0))
        return a

    torch.func.functionalize(f)(x)
    out = torch._from_functional_tensor(got[0]) if torch._is_functional_tensor(got[0]) else got[0]
    np.testing.assert_array_equal(out.numpy(), _reference(x))
