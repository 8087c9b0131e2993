"""Reducers against numpy float64 references, on random and adversarial tensors.

Tolerances. References are numpy float64 on the tensor's values upcast to
float64 (exact for every supported dtype), so the only legitimate difference
is float64 summation order. For n <= 1e5 terms that error is at most
n * eps * max|x| ~ 2e-11 * max|x| even in the worst case (pairwise summation,
used by both libraries, is far smaller), so sums are checked to
``1e-9 * max|x|``. That is still ~100x tighter than float32 accumulation
(~1e-7 relative), so a float32 shortcut would fail. Counts, min/max, abs_max,
histogram counts and unsampled quantiles must be exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from support.sync_guard import NoSyncMode
from support.tensors import gen, plant_nonfinite

from layertap.server.reducers import workspace
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.samplesort import sort_ascending
from layertap.server.reducers.spec import (
    DEFAULT_HISTOGRAM_BINS,
    DEFAULT_MAX_CHANNELS,
    DEFAULT_PROBABILITIES,
    DEFAULT_SAMPLE_SIZE,
    MAX_SAMPLE_SIZE,
    QUANTILE_DELTA,
    REDUCER_NAMES,
    SpecError,
    parse_reducer_names,
    reducer_name,
)
from layertap.server.reducers.workspace import flat_view, gather_flat
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

ALL = "moments,minmax,abs_max,zero_fraction,nonfinite,norm,histogram,quantiles,per_channel"
SUM_RTOL = 1e-9
EDGES = [-3.0, -1.0, -0.25, 0.0, 0.5, 2.0, 10.0]


def _with_nonfinite(n: int) -> torch.Tensor:
    return plant_nonfinite(torch.randn(n, generator=gen(1)))


# Every case is built lazily so collection stays cheap; ids read as documentation.
CASES: dict[str, Callable[[], torch.Tensor]] = {
    "f32_random": lambda: torch.randn(4, 8, 5, 5, generator=gen()) * 3 + 0.5,
    "f64_random": lambda: torch.randn(300, dtype=torch.float64, generator=gen()),
    "f16": lambda: (torch.randn(6, 50, generator=gen()) * 4).half(),
    "bf16": lambda: (torch.randn(6, 50, generator=gen()) * 4).bfloat16(),
    "zeros": lambda: torch.zeros(3, 40),
    "neg_zero": lambda: torch.tensor([-0.0, 0.0, 1.0, -0.0]),
    "nan_inf_mixed": lambda: _with_nonfinite(500).reshape(5, 100),
    "all_nan": lambda: torch.full((2, 9), math.nan),
    "only_inf": lambda: torch.tensor([[math.inf, -math.inf], [math.inf, math.inf]]),
    "huge_f32": lambda: torch.randn(2, 4000, generator=gen()) * 1e30,
    "huge_bf16": lambda: (torch.randn(3, 200, generator=gen()) * 1e30).bfloat16(),
    "offset_f32": lambda: torch.randn(5, 2000, generator=gen()) + 1e6,
    "int8": lambda: torch.randint(-128, 128, (4, 33), dtype=torch.int8, generator=gen()),
    "int64": lambda: torch.randint(-(10**12), 10**12, (3, 70), dtype=torch.int64, generator=gen()),
    "uint8": lambda: torch.randint(0, 256, (5, 20), dtype=torch.uint8, generator=gen()),
    "bool": lambda: torch.rand(4, 30, generator=gen()) > 0.3,
    "transposed": lambda: torch.randn(30, 20, generator=gen()).t(),
    "sliced": lambda: torch.randn(4, 9, 8, generator=gen())[::2, 1:, ::3],
    "expanded": lambda: torch.randn(3, 1, 5, generator=gen()).expand(3, 4, 5),
    "channels_last": lambda: torch.randn(2, 6, 5, 7, generator=gen()).to(memory_format=torch.channels_last),
    "scalar": lambda: torch.tensor(2.5),
    "scalar_nan": lambda: torch.tensor(math.nan),
    "empty_1d": lambda: torch.empty(0),
    "empty_3d": lambda: torch.empty(3, 0, 4),
    "empty_channels": lambda: torch.empty(0, 4),
}


def _np(x: torch.Tensor) -> np.ndarray:
    """The reference view of x: every element as float64 (exact upcast)."""
    return x.detach().to(torch.float64).reshape(-1).numpy().copy()


def _finite(a: np.ndarray) -> np.ndarray:
    return a[np.isfinite(a)]


def _scale(a: np.ndarray) -> float:
    f = _finite(a)
    return float(np.abs(f).max()) if f.size else 1.0


def run(x: torch.Tensor, specs: str | list[pb.ReducerSpec], seed: int = 0) -> list[pb.ReducerResult]:
    if isinstance(specs, str):
        specs = parse_reducer_names(specs)
    plan = ReducerPlan(build_reducers(specs), seed=seed)
    out = plan.run(x)
    assert out.dtype == torch.float64 and out.dim() == 1 and out.device == x.device
    assert out.numel() == plan.width(x.shape)
    return plan.decode(out.numpy(), x.shape)


def hist_spec(edges: list[float] | None = None, sample_size: int = 0, **kw: float) -> pb.ReducerSpec:
    params = pb.HistogramParams(edges=edges or [], sample_size=sample_size, **kw)
    return pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM, histogram=params)


def quant_spec(ps: list[float] | None = None, sample_size: int = 0) -> pb.ReducerSpec:
    params = pb.QuantileParams(probabilities=ps or [], sample_size=sample_size)
    return pb.ReducerSpec(kind=pb.REDUCER_KIND_QUANTILES, quantiles=params)


def pc_spec(dim: int | None = None, max_channels: int = 0) -> pb.ReducerSpec:
    params = pb.PerChannelParams(dim=dim, max_channels=max_channels)
    return pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=params)


# ------------------------------------------------------------------ per case


@pytest.mark.parametrize("case", CASES)
def test_basic_reducers_match_numpy(case: str) -> None:
    x = CASES[case]()
    a = _np(x)
    f = _finite(a)
    scale = _scale(a)
    mom, mm, am, zf, nf, norm = run(x, "moments,minmax,abs_max,zero_fraction,nonfinite,norm")

    assert mom.moments.count == f.size
    if f.size:
        assert abs(mom.moments.mean - f.mean()) <= SUM_RTOL * scale
        assert abs(mom.moments.std - f.std()) <= SUM_RTOL * scale
        assert (mm.minmax.min, mm.minmax.max) == (f.min(), f.max())
        assert am.abs_max.value == np.abs(f).max()
    else:
        assert math.isnan(mom.moments.mean) and math.isnan(mom.moments.std)
        assert math.isnan(mm.minmax.min) and math.isnan(mm.minmax.max)
        assert math.isnan(am.abs_max.value)

    assert zf.zero_fraction.count == a.size
    if a.size:
        assert zf.zero_fraction.fraction == np.count_nonzero(a == 0) / a.size
    else:
        assert math.isnan(zf.zero_fraction.fraction)
    assert nf.nonfinite.nan_count == np.isnan(a).sum()
    assert nf.nonfinite.inf_count == np.isinf(a).sum()
    # sqrt halves the relative error of the sum of squares.
    assert abs(norm.norm.l2 - np.linalg.norm(f)) <= SUM_RTOL * max(np.linalg.norm(f), 1e-300)


@pytest.mark.parametrize("case", CASES)
def test_norm_alongside_moments_uses_same_sums(case: str) -> None:
    # With moments in the plan the sums are shifted; the norm must still hold.
    x = CASES[case]()
    f = _finite(_np(x))
    (norm,) = [r for r in run(x, "moments,norm") if r.HasField("norm")]
    ref = np.linalg.norm(f)
    # Un-shifting adds at most ~(n K^2) * eps of cancellation error; K ~ mean.
    assert abs(norm.norm.l2 - ref) <= SUM_RTOL * max(ref, _scale(_np(x)))


@pytest.mark.parametrize("shared_sort", [False, True], ids=["bucketize", "sorted"])
@pytest.mark.parametrize("case", CASES)
def test_histogram_unsampled_counts_exact(case: str, shared_sort: bool) -> None:
    # Alone on CPU a histogram bucketizes its sample; next to quantiles of the
    # same sample size it searches the shared sorted sample (the CUDA path).
    x = CASES[case]()
    a = _np(x)
    extra = [quant_spec()] if shared_sort else []
    (default_hist, edge_hist) = run(x, [hist_spec(), hist_spec(EDGES)] + extra)[:2]
    v = a[~np.isnan(a)]  # NaN is never binned; +-inf go to the open end bins
    for h in (default_hist.histogram, edge_hist.histogram):
        edges = np.array(h.edges)
        ref = np.bincount(np.searchsorted(edges, v, side="right"), minlength=len(edges) + 1)
        assert list(h.counts) == ref.tolist()
        assert h.sample_size == v.size and h.population == a.size
    assert list(edge_hist.histogram.edges) == EDGES
    assert len(default_hist.histogram.edges) == DEFAULT_HISTOGRAM_BINS + 1


@pytest.mark.parametrize("case", CASES)
def test_quantiles_unsampled_are_exact(case: str) -> None:
    x = CASES[case]()
    a = _np(x)
    v = a[~np.isnan(a)]
    ps = [0.0, 0.01, 0.1, 0.25, 1 / 3, 0.5, 0.9, 0.99, 1.0]
    (q,) = run(x, [quant_spec(ps)])
    q = q.quantiles
    assert q.rank_error == 0.0
    assert (q.sample_size, q.population) == (v.size, a.size)
    assert list(q.probabilities) == ps
    if v.size == 0:
        assert all(math.isnan(val) for val in q.values)
    elif np.isinf(v).any():
        # numpy's lerp gives NaN next to an infinity; we return an order
        # statistic instead, so check ranks: value within the ECDF jump at p.
        s = np.sort(v)
        for p, val in zip(ps, q.values):
            lo, hi = np.searchsorted(s, val, "left"), np.searchsorted(s, val, "right")
            k = p * (v.size - 1)
            assert lo - 1 <= k <= hi, (p, val)
    else:
        # Same 'linear' formula, same float64 operations: bit-for-bit.
        np.testing.assert_array_equal(q.values, np.quantile(v, ps))


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("scalar", "scalar_nan")])
def test_per_channel_matches_numpy(case: str) -> None:
    x = CASES[case]()
    dim = 1 if x.dim() > 1 else 0
    (pc,) = run(x, [pc_spec(dim=dim if dim else -1)])
    pc = pc.per_channel
    arr = x.detach().to(torch.float64).numpy()
    c = arr.shape[dim]
    rows = np.moveaxis(arr, dim, 0).reshape(c, arr.size // c if c else 0)
    assert pc.channels == c and len(pc.mean) == len(pc.std) == len(pc.abs_max) == c
    for i in range(c):
        f = _finite(rows[i])
        if f.size == 0:
            assert math.isnan(pc.mean[i]) and math.isnan(pc.std[i]) and math.isnan(pc.abs_max[i])
            continue
        scale = float(np.abs(f).max())
        assert abs(pc.mean[i] - f.mean()) <= SUM_RTOL * scale
        assert abs(pc.std[i] - f.std()) <= SUM_RTOL * scale
        assert pc.abs_max[i] == np.abs(f).max()


# ------------------------------------------------------------ targeted checks


def test_std_is_accurate_with_large_offset() -> None:
    # mean 1e6, std ~1: E[x^2] - E[x]^2 in float64 loses ~1e-4 relative here;
    # the shifted sums keep std to float64 accuracy relative to std itself.
    x = torch.randn(100_000, generator=gen()) + 1e6
    f = _np(x)
    (m,) = run(x, "moments")
    assert m.moments.std == pytest.approx(f.std(), rel=1e-9)
    assert m.moments.mean == pytest.approx(f.mean(), rel=1e-12)


def test_huge_float32_moments_do_not_overflow() -> None:
    # Squares of 1e30 overflow float32 (3.4e38); float64 accumulation must not.
    x = torch.randn(10_000, generator=gen()) * 1e30
    f = _np(x)
    m, n = run(x, "moments,norm")
    assert math.isfinite(m.moments.std) and math.isfinite(n.norm.l2)
    assert m.moments.std == pytest.approx(f.std(), rel=1e-9)
    assert n.norm.l2 == pytest.approx(np.linalg.norm(f), rel=1e-9)


def test_zero_fraction_counts_negative_zero() -> None:
    (zf,) = run(torch.tensor([-0.0, 0.0, 1.0, math.nan]), "zero_fraction")
    assert zf.zero_fraction.fraction == 0.5 and zf.zero_fraction.count == 4


@pytest.mark.parametrize("shared_sort", [False, True], ids=["bucketize", "sorted"])
def test_sampled_histogram_sums_to_sample_size(shared_sort: bool) -> None:
    x = torch.randn(40, 5000, generator=gen()) * 2
    extra = [quant_spec(None, 1000)] if shared_sort else []
    h = run(x, [hist_spec(EDGES, sample_size=1000)] + extra)[0]
    h = h.histogram
    assert sum(h.counts) == h.sample_size == 1000
    assert h.population == x.numel()
    # The sample is uniform: its CDF at each edge is within the DKW band of
    # the population's (delta = 0.01; the seed is fixed, so this is stable).
    a = _np(x)
    eps = math.sqrt(math.log(2 / 0.01) / (2 * 1000))
    cdf = np.cumsum(h.counts)[:-1] / 1000
    ref = np.array([(a < e).mean() for e in EDGES])
    assert np.all(np.abs(cdf - ref) <= eps)


@pytest.mark.parametrize("shared_sort", [False, True], ids=["bucketize", "sorted"])
def test_sampled_histogram_excludes_nan_from_sample_size(shared_sort: bool) -> None:
    x = _with_nonfinite(30_000)
    extra = [quant_spec(None, 2000)] if shared_sort else []
    h = run(x, [hist_spec(EDGES, sample_size=2000)] + extra)[0]
    h = h.histogram
    assert sum(h.counts) == h.sample_size
    # ~1/7 of the elements are NaN; the binned count is what is left of 2000.
    assert 1500 < h.sample_size < 2000
    assert h.population == 30_000


@pytest.mark.parametrize(
    "name, make",
    [
        ("normal", lambda: torch.randn(200_000, generator=gen())),
        ("ties", lambda: torch.randint(0, 5, (200_000,), generator=gen()).float()),
        ("nonfinite", lambda: _with_nonfinite(200_000)),
        ("channels_last_bf16", lambda: torch.randn(8, 16, 40, 40, generator=gen())
         .bfloat16().to(memory_format=torch.channels_last)),
        ("sliced", lambda: torch.randn(600, 700, generator=gen())[::2, 100:]),
    ],
)
def test_sampled_quantiles_within_rank_error(name: str, make: Callable[[], torch.Tensor]) -> None:
    x = make()
    a = _np(x)
    v = np.sort(a[~np.isnan(a)])
    ps = [0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0]
    (q,) = run(x, [quant_spec(ps, sample_size=4096)])
    q = q.quantiles
    assert q.population == a.size
    assert 0 < q.sample_size <= 4096
    dkw = math.sqrt(math.log(2 / QUANTILE_DELTA) / (2 * q.sample_size))
    assert q.rank_error == pytest.approx(dkw + 1 / q.sample_size)
    for p, val in zip(ps, q.values):
        below = np.searchsorted(v, val, "left") / v.size  # F(q-)
        at = np.searchsorted(v, val, "right") / v.size  # F(q)
        assert below - q.rank_error <= p <= at + q.rank_error, (p, val, below, at)


def test_histogram_and_quantiles_share_one_sorted_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(100_000, generator=gen())
    plan = ReducerPlan(build_reducers([hist_spec(EDGES, 5000), quant_spec(None, 5000)]))
    sorted_sizes: list[int] = []

    def counting_sort(s: torch.Tensor) -> torch.Tensor:
        sorted_sizes.append(s.numel())
        return sort_ascending(s)

    monkeypatch.setattr(workspace, "sort_ascending", counting_sort)
    with NoSyncMode() as mode:
        plan.run(x)
    randints = [op for op in mode.ops if op.overloadpacket is torch.ops.aten.randint]
    assert sorted_sizes == [5000] and len(randints) == 1


class _SizeRecorder(NoSyncMode):
    """Records (op packet, numel of the first tensor argument) for each op."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.calls.append((func.overloadpacket, -1 if first is None else first.numel()))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_reducers_share_one_upcast_and_one_finite_mask() -> None:
    x = torch.randn(10, 100, generator=gen()).bfloat16()
    x[0, 0] = math.nan
    plan = ReducerPlan(build_reducers(parse_reducer_names("moments,norm,minmax,per_channel")))
    with _SizeRecorder() as rec:
        plan.run(x)
    full = [op for op, n in rec.calls if n == x.numel()]
    assert full.count(torch.ops.aten._to_copy) == 1  # x -> float64, once
    # The finite mask (|x| < inf) is built once and shared.
    assert full.count(torch.ops.aten.lt) == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 6, 7, generator=gen()),
        lambda: torch.randn(2, 6, 5, 7, generator=gen()).to(memory_format=torch.channels_last),
        lambda: torch.randn(30, 20, generator=gen()).t(),
        lambda: torch.randn(4, 9, 8, generator=gen())[::2, 1:, ::3],
        lambda: torch.randn(3, 1, 5, generator=gen()).expand(3, 4, 5),
        lambda: torch.randn(10, 10, generator=gen())[2:5, 3],
    ],
    ids=["contiguous", "channels_last", "transposed", "sliced", "expanded", "column"],
)
def test_sample_gather_reads_the_right_elements(make: Callable[[], torch.Tensor]) -> None:
    x = make()
    idx = torch.randint(0, x.numel(), (500,), generator=gen())
    flat = flat_view(x)
    if flat is None:
        # Non-dense: indices are unravelled in logical (row-major) order.
        assert torch.equal(gather_flat(x, idx), x.reshape(-1)[idx])
    else:
        # Dense: a memory-order view, which must hold exactly x's elements.
        assert sorted(flat.tolist()) == sorted(x.reshape(-1).tolist())
        assert torch.equal(gather_flat(x, idx), flat[idx])


def test_sampling_leaves_global_rng_alone() -> None:
    x = torch.randn(100_000, generator=gen())
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    run(x, [hist_spec(EDGES, 100), quant_spec(None, 100)])
    assert torch.equal(torch.rand(4), expected)


def test_sampling_is_deterministic_per_seed() -> None:
    x = torch.randn(100_000, generator=gen())
    spec = [quant_spec(None, 500)]
    assert run(x, spec, seed=7) == run(x, spec, seed=7)


def test_per_channel_cap_and_negative_dim() -> None:
    x = torch.randn(4, 10, 3, generator=gen())
    (pc,) = run(x, [pc_spec(dim=-2, max_channels=3)])
    pc = pc.per_channel
    assert pc.channels == 10 and len(pc.mean) == 3 and pc.dim == -2
    rows = x.double().permute(1, 0, 2).reshape(10, -1).numpy()
    np.testing.assert_allclose(pc.mean, rows[:3].mean(1), rtol=0, atol=1e-12)
    np.testing.assert_allclose(pc.std, rows[:3].std(1), rtol=0, atol=1e-12)


def test_per_channel_default_dim_is_one_and_channels_last() -> None:
    x = torch.randn(2, 5, 4, 4, generator=gen()).to(memory_format=torch.channels_last)
    (pc,) = run(x, "per_channel")
    assert pc.per_channel.dim == 1 and pc.per_channel.channels == 5
    ref = x.double().mean(dim=(0, 2, 3)).numpy()
    np.testing.assert_allclose(pc.per_channel.mean, ref, rtol=0, atol=1e-12)


def test_per_channel_default_axis_of_a_token_model_is_the_last_of_3d_only() -> None:
    def tokens_run(x: torch.Tensor, spec: pb.ReducerSpec) -> pb.PerChannel:
        plan = ReducerPlan(build_reducers([spec], tokens=True))
        return plan.decode(plan.run(x).numpy(), x.shape)[0].per_channel

    seq = torch.randn(2, 5, 3, generator=gen())  # (batch, tokens, hidden)
    pc = tokens_run(seq, pc_spec())
    assert pc.dim == 2 and pc.channels == 3
    np.testing.assert_allclose(pc.mean, seq.double().mean(dim=(0, 1)).numpy(), rtol=0, atol=1e-12)
    conv = torch.randn(2, 4, 3, 3, generator=gen())  # a map: channels stay dim 1
    assert tokens_run(conv, pc_spec()).dim == 1 and tokens_run(conv, pc_spec()).channels == 4
    assert tokens_run(torch.randn(2, 7, generator=gen()), pc_spec()).channels == 7
    # An explicit dim wins, 0 included (the field is `optional`).
    pc0 = tokens_run(seq, pc_spec(dim=0))
    assert pc0.dim == 0 and pc0.channels == 2
    # Unset and the same rule for every model: dim 1, as before token models.
    (plain,) = run(seq, [pc_spec()])
    assert plain.per_channel.dim == 1 and plain.per_channel.channels == 5
    unset = build_reducers([pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL)], tokens=True)[0]
    assert not unset.spec().per_channel.HasField("dim")


def test_per_channel_dim_out_of_range_is_a_spec_error() -> None:
    plan = ReducerPlan(build_reducers([pc_spec(dim=3)], field_prefix="tap.reducers"))
    for x in (torch.randn(2, 3), torch.tensor(1.0)):
        with pytest.raises(SpecError) as err:
            plan.run(x)
        assert err.value.field == "tap.reducers[0].per_channel.dim"
        with pytest.raises(SpecError):
            plan.width(x.shape)


def test_requires_grad_input_builds_no_graph() -> None:
    x = torch.randn(10, 4, requires_grad=True)
    plan = ReducerPlan(build_reducers(parse_reducer_names(ALL)))
    out = plan.run(x * 2)
    assert not out.requires_grad


def test_unsupported_dtype_is_a_type_error() -> None:
    plan = ReducerPlan(build_reducers(parse_reducer_names("moments")))
    with pytest.raises(TypeError):
        plan.run(torch.randn(3, dtype=torch.complex64))


# ------------------------------------------------------------------- the plan


@pytest.mark.parametrize("case", CASES)
def test_plan_width_and_decode_roundtrip(case: str) -> None:
    x = CASES[case]()
    # per_channel's default dim 1 needs at least 2 dims.
    names = ALL if x.dim() > 1 else ALL.replace(",per_channel", "")
    plan = ReducerPlan(build_reducers(parse_reducer_names(names)))
    out = plan.run(x)
    assert out.shape == (plan.width(x.shape),)
    results = plan.decode(out.numpy(), x.shape)
    assert [r.WhichOneof("value") for r in results] == names.split(",")
    with pytest.raises(ValueError):
        plan.decode(out.numpy()[:-1], x.shape)


def test_empty_plan_and_nonfinite_only() -> None:
    empty = ReducerPlan([])
    assert empty.run(torch.randn(3)).shape == (0,) and empty.decode(np.zeros(0), (3,)) == []
    plan = ReducerPlan(build_reducers(parse_reducer_names("moments,nonfinite,histogram")))
    sub = plan.nonfinite_only()
    assert sub is not None and [r.name for r in sub.reducers] == ["nonfinite"]
    x = _with_nonfinite(100)
    (nf,) = sub.decode(sub.run(x).numpy(), x.shape)
    assert nf.nonfinite.nan_count == int(torch.isnan(x).sum())
    assert ReducerPlan(build_reducers(parse_reducer_names("moments"))).nonfinite_only() is None


def test_resolved_spec_fills_defaults() -> None:
    (h, q, pc) = build_reducers([hist_spec(), quant_spec(), pc_spec()])
    assert h.spec().histogram.bins == DEFAULT_HISTOGRAM_BINS
    assert h.spec().histogram.sample_size == DEFAULT_SAMPLE_SIZE
    assert list(q.spec().quantiles.probabilities) == list(DEFAULT_PROBABILITIES)
    assert pc.spec().per_channel.dim == 1
    assert pc.spec().per_channel.max_channels == DEFAULT_MAX_CHANNELS


# ---------------------------------------------------------------- validation


def _spec_error(specs: list[pb.ReducerSpec]) -> SpecError:
    with pytest.raises(SpecError) as err:
        build_reducers(specs)
    return err.value


M = pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)


@pytest.mark.parametrize(
    "specs, field",
    [
        ([pb.ReducerSpec()], "reducers[0].kind"),
        ([M, pb.ReducerSpec(kind=99)], "reducers[1].kind"),  # type: ignore[arg-type]
        ([M, hist_spec(bins=2000, min=0, max=1)], "reducers[1].histogram.bins"),
        ([hist_spec(bins=10, min=1, max=1)], "reducers[0].histogram.max"),
        ([hist_spec(bins=10, min=2, max=1)], "reducers[0].histogram.max"),
        ([hist_spec(bins=10, min=-math.inf, max=1)], "reducers[0].histogram.min"),
        ([hist_spec(bins=1024, min=1, max=1 + 1e-13)], "reducers[0].histogram.bins"),
        ([hist_spec([0, 1, 1, 2])], "reducers[0].histogram.edges[2]"),
        ([hist_spec([0, 2, 1])], "reducers[0].histogram.edges[2]"),
        ([hist_spec([0, math.inf])], "reducers[0].histogram.edges[1]"),
        ([hist_spec([math.nan])], "reducers[0].histogram.edges[0]"),
        ([hist_spec(list(range(1026)))], "reducers[0].histogram.edges"),
        ([hist_spec(EDGES, sample_size=MAX_SAMPLE_SIZE + 1)], "reducers[0].histogram.sample_size"),
        ([quant_spec([0.5, 1.5])], "reducers[0].quantiles.probabilities[1]"),
        ([quant_spec([-0.1])], "reducers[0].quantiles.probabilities[0]"),
        ([quant_spec([math.nan])], "reducers[0].quantiles.probabilities[0]"),
        ([quant_spec([0.5] * 129)], "reducers[0].quantiles.probabilities"),
        ([quant_spec(None, MAX_SAMPLE_SIZE + 1)], "reducers[0].quantiles.sample_size"),
        ([pc_spec(max_channels=4097)], "reducers[0].per_channel.max_channels"),
        ([pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS, histogram=pb.HistogramParams(bins=3))],
         "reducers[0].histogram"),
        ([pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM, quantiles=pb.QuantileParams())],
         "reducers[0].quantiles"),
        ([M, pb.ReducerSpec(kind=pb.REDUCER_KIND_NORM), M], "reducers[2]"),
        ([hist_spec(EDGES), hist_spec(EDGES)], "reducers[1]"),
        ([hist_spec(), hist_spec(bins=64, min=-8, max=8)], "reducers[1]"),  # same after defaults
        ([pc_spec(), pc_spec(dim=1)], "reducers[1]"),
    ],
)
def test_spec_errors_name_the_field(specs: list[pb.ReducerSpec], field: str) -> None:
    err = _spec_error(specs)
    assert err.field == field
    assert str(err).startswith(field + ": ")


def test_duplicate_error_points_at_the_original() -> None:
    err = _spec_error([M, pb.ReducerSpec(kind=pb.REDUCER_KIND_NORM), M])
    assert "reducers[0]" in err.message


def test_distinct_parameters_are_not_duplicates() -> None:
    reducers = build_reducers([hist_spec(EDGES), hist_spec(), quant_spec([0.5]), quant_spec([0.9])])
    assert len(reducers) == 4


def test_field_prefix_is_used() -> None:
    with pytest.raises(SpecError) as err:
        build_reducers([pb.ReducerSpec()], field_prefix="spec.reducers")
    assert err.value.field == "spec.reducers[0].kind"


def test_parse_reducer_names() -> None:
    specs = parse_reducer_names(" Moments, nonfinite ,histogram,")
    assert [s.kind for s in specs] == [
        pb.REDUCER_KIND_MOMENTS, pb.REDUCER_KIND_NONFINITE, pb.REDUCER_KIND_HISTOGRAM,
    ]  # fmt: skip
    assert parse_reducer_names("") == []
    assert [reducer_name(s.kind) for s in parse_reducer_names(ALL)] == ALL.split(",")


def test_parse_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(SpecError) as err:
        parse_reducer_names("moments,mean")
    assert err.value.field == "reducers[1]"
    assert "'mean'" in str(err.value)
    for name in REDUCER_NAMES:
        assert name in str(err.value)


def _results(names: str, x: torch.Tensor) -> dict[str, pb.ReducerResult]:
    plan = ReducerPlan(build_reducers(parse_reducer_names(names)))
    out = plan.decode(plan.run(x).numpy(), x.shape)
    return {r.WhichOneof("value"): r for r in out}


def test_moments_survive_a_strided_shift_sample_landing_on_a_nan_column():
    # Every element the strided shift sample reads is NaN (column 0 of a
    # (64, 10000) tensor); a shift of 0 would cancel catastrophically.
    g = torch.Generator().manual_seed(0)
    x = 1e6 + 1e-6 * torch.randn(64, 10000, generator=g, dtype=torch.float64)
    x[:, 0] = math.nan
    ref = x.numpy()[:, 1:]
    m = _results("moments", x)["moments"].moments
    assert m.count == ref.size
    np.testing.assert_allclose(m.std, ref.std(), rtol=1e-6)
    np.testing.assert_allclose(m.mean, ref.mean(), rtol=1e-12)


def test_float64_overflow_reports_inf_not_nan():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e200
    res = _results("moments,norm", x)
    assert res["moments"].moments.std == math.inf
    assert res["norm"].norm.l2 == math.inf == np.linalg.norm(x.numpy())


def test_plan_never_modifies_the_hooked_tensor():
    plan = ReducerPlan(build_reducers(parse_reducer_names(
        "moments,minmax,abs_max,zero_fraction,nonfinite,norm,histogram,quantiles,per_channel")))
    base = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(2))
    base[0, 0, 0, 0] = math.nan
    base[1, 1, 1, 1] = math.inf
    for x in (base, base.double(), base.half(), base.bfloat16(), base.to(memory_format=torch.channels_last),
              base.transpose(1, 3)):
        before, version = x.clone(), x._version
        plan.run(x)
        assert x._version == version
        assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(before))
        assert torch.equal(torch.isnan(x), torch.isnan(before))
