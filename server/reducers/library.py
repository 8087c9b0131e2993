"""On-device reducers: summarize a tensor where it lives, with no host sync.

A tap asks for reducers by :class:`~layertap.v1.telemetry_pb2.ReducerSpec`.
:func:`build_reducers` validates the specs once, host-side, and a
:class:`ReducerPlan` runs them all on a tensor as one fused plan whose output is
ONE 1-D float64 tensor on the tensor's device (the "slots"). The collector
copies a whole pass's slots to the host in one asynchronous transfer, and
:meth:`ReducerPlan.decode` turns the host array back into ``ReducerResult``
messages off the model thread.

Rules every reducer follows (DESIGN "Reducers"):

* No host sync: no ``.item()``, ``.cpu()``, ``.tolist()``, ``histc``,
  ``nonzero``, ``bincount``, boolean-mask indexing or Python branching on tensor
  values. Only shapes and dtypes (host metadata) steer control flow.
* No full-tensor sort or ``scatter_add_``: histograms and quantiles work on a
  bounded uniform sample, drawn with a private generator so the model's own RNG
  stream is never perturbed.
* Work is shared: the float64 upcast, the finite mask and the basic statistics
  (:func:`_fused_basic_stats`) are computed once per tensor for every reducer.
  The torch fallback keeps temporaries few and small: on CPU a fresh large
  allocation page-faults, and kernels with bool outputs (masks) are several
  times slower than float ones, so masks and counts are 0/1 floats, and
  non-finite values are handled with ``nan_to_num`` rather than ``where``.

Semantics (also the contract for decoders and exporters):

* ``moments``: count, mean and population std (ddof=0) of the FINITE elements;
  NaN and +-Inf are left to ``nonfinite``. Sums are accumulated in float64
  around a shift taken from the tensor itself, so huge magnitudes (1e30 in
  float32) and large offsets with a small spread stay accurate. (Only float64
  inputs beyond ~1e154 can overflow the sum of squares: std and norm -> inf.)
* ``minmax``/``abs_max``: over finite elements; NaN when there is none.
* ``zero_fraction``: exact zeros (+0 and -0) over ALL elements; ``count`` is
  that denominator (the element count), so fractions merge by weighting.
* ``nonfinite``: NaN and +-Inf counts.
* ``norm``: L2 norm of the finite elements (0 for an empty tensor).
* ``histogram``: frozen edges with open end bins; NaN is not binned, +-Inf land
  in the open end bins. Counts are exact; above ``sample_size`` elements a
  uniform sample (with replacement) of exactly ``sample_size`` elements is
  binned instead, and ``sample_size`` reports how many were binned. Binning
  is a binary search of the edges in the sorted sample when quantiles sort the
  same sample anyway (and always on CUDA: no atomics), else bucketize plus a
  scatter into the few bins of the bounded sample.
* ``quantiles``: numpy's default ('linear') interpolation on the NaN-free
  sample; exact order statistics when the tensor fits in the sample. NaN is
  excluded (it is counted by ``nonfinite``), +-Inf are ordinary extreme values.
  ``rank_error`` is the DKW bound ``sqrt(ln(2/delta) / (2 n)) + 1/n`` with
  ``delta = 0.01`` over the ``n`` non-NaN sampled values (the ``1/n`` covers
  the discreteness of a sample quantile), and 0 when unsampled.
* ``per_channel``: mean, std and abs_max of the finite elements of each slice
  along ``dim``, for the first ``max_channels`` channels.
* Integer and bool tensors are read as float64 (exact up to 2**53).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import numpy as np
import torch

from layertap.v1 import telemetry_pb2 as pb

__all__ = [
    "DEFAULT_HISTOGRAM_BINS",
    "DEFAULT_HISTOGRAM_RANGE",
    "DEFAULT_MAX_CHANNELS",
    "DEFAULT_PROBABILITIES",
    "DEFAULT_SAMPLE_SIZE",
    "MAX_BINS",
    "MAX_CHANNELS",
    "MAX_PROBABILITIES",
    "MAX_SAMPLE_SIZE",
    "QUANTILE_DELTA",
    "REDUCER_NAMES",
    "Reducer",
    "ReducerPlan",
    "SpecError",
    "build_reducers",
    "parse_reducer_names",
    "reducer_name",
]

#: Histograms and quantiles share one sample (and one sort) at equal sizes.
#: 16384 gives a quantile rank error of ~0.013 and sorts in ~1 ms on one CPU core.
DEFAULT_SAMPLE_SIZE = 16384
MAX_SAMPLE_SIZE = 1 << 20
MAX_BINS = 1024
DEFAULT_HISTOGRAM_BINS = 64
#: Used when a histogram spec gives neither edges nor a range.
DEFAULT_HISTOGRAM_RANGE = (-8.0, 8.0)
from layertap.server.reducers.spec import DEFAULT_PROBABILITIES  # noqa: E402
MAX_PROBABILITIES = 128
MAX_CHANNELS = 4096
DEFAULT_MAX_CHANNELS = MAX_CHANNELS
#: Failure probability of the DKW rank-error bound reported by quantiles.
QUANTILE_DELTA = 0.01
#: Elements read (strided) to pick the moments shift; see :func:`_shift_of`.
_SHIFT_SAMPLE = 64

_F64 = torch.float64
_SUPPORTED_DTYPES = frozenset(
    {
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint8, torch.bool,
    }
)  # fmt: skip  (uint16/32/64 lack min/max kernels in torch)

REDUCER_NAMES: dict[str, int] = {
    "moments": pb.REDUCER_KIND_MOMENTS,
    "minmax": pb.REDUCER_KIND_MINMAX,
    "abs_max": pb.REDUCER_KIND_ABS_MAX,
    "zero_fraction": pb.REDUCER_KIND_ZERO_FRACTION,
    "nonfinite": pb.REDUCER_KIND_NONFINITE,
    "norm": pb.REDUCER_KIND_NORM,
    "histogram": pb.REDUCER_KIND_HISTOGRAM,
    "quantiles": pb.REDUCER_KIND_QUANTILES,
    "per_channel": pb.REDUCER_KIND_PER_CHANNEL,
}
_KIND_NAMES = {kind: name for name, kind in REDUCER_NAMES.items()}
_ParamField = Literal["histogram", "quantiles", "per_channel"]
_PARAM_FIELDS: tuple[_ParamField, ...] = ("histogram", "quantiles", "per_channel")


class SpecError(ValueError):
    """A reducer spec is invalid, or cannot apply to a tensor.

    Attributes:
        field: Path of the offending field, e.g. ``"reducers[1].histogram.bins"``,
            so the gRPC layer can say exactly what to fix.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def reducer_name(kind: int) -> str:
    """Returns the short name (``"moments"``...) of a ``ReducerKind`` value."""
    try:
        return _KIND_NAMES[kind]
    except KeyError:
        raise ValueError(f"unknown reducer kind {kind}") from None


def parse_reducer_names(names: str, field_prefix: str = "reducers") -> list[pb.ReducerSpec]:
    """Turns ``"moments,nonfinite"`` into specs with default parameters.

    Args:
        names: Comma-separated reducer names; whitespace and case are ignored.
        field_prefix: Field path used in errors.

    Returns:
        One ``ReducerSpec`` per name, in order (duplicates are left for
        :func:`build_reducers` to reject).

    Raises:
        SpecError: For an unknown name; the message lists the valid ones.
    """
    specs: list[pb.ReducerSpec] = []
    for i, raw in enumerate(n.strip().lower() for n in names.split(",")):
        if not raw:
            continue
        kind = REDUCER_NAMES.get(raw)
        if kind is None:
            raise SpecError(
                f"{field_prefix}[{i}]",
                f"unknown reducer {raw!r}; valid: {', '.join(REDUCER_NAMES)}",
            )
        specs.append(pb.ReducerSpec(kind=kind))  # type: ignore[arg-type]
    return specs


# --------------------------------------------------------------------------
# Shared per-tensor work
# --------------------------------------------------------------------------

# Layout of the basic-statistics vector. Basic reducers' slots are views into
# it, so they cost no device work beyond the final concatenation.
_ZEROS, _NAN, _COUNT, _S1, _S2, _SHIFT, _MIN, _MAX = range(8)
_BASIC_WIDTH = 8


@dataclasses.dataclass(frozen=True)
class _StatNeeds:
    """Which basic statistics some reducer of the plan reads."""

    zeros: bool = False
    nan: bool = False
    count: bool = False
    sums: bool = False
    shifted: bool = False
    minmax: bool = False

    def __or__(self, other: _StatNeeds) -> _StatNeeds:
        return _StatNeeds(*(a or b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def any(self) -> bool:
        return any(dataclasses.astuple(self))


class _Workspace:
    """Per-tensor cache so reducers of one plan share the upcast, mask and samples."""

    def __init__(self, x: torch.Tensor, generator: torch.Generator,
                 sorted_sizes: frozenset[int] = frozenset(), share_xd: bool = False) -> None:
        self.x = x
        self.numel = x.numel()
        self.floating = x.is_floating_point()
        self._generator = generator
        self._sorted_sizes = sorted_sizes
        #: Some reducer besides the basic statistics reads :attr:`xd` (so the
        #: basic statistics must not shift or clean their upcast in place).
        self.share_xd = share_xd
        self._flat: torch.Tensor | None | bool = False
        self._xd: torch.Tensor | None = None
        self._fin: torch.Tensor | None = None
        self._samples: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sorted: dict[int, torch.Tensor] = {}
        self.basic: torch.Tensor | None = None

    @property
    def flat(self) -> torch.Tensor | None:
        """:func:`_flat_view` of x (all elements as 1-D, memory order), cached."""
        if self._flat is False:
            self._flat = _flat_view(self.x)
        return self._flat  # type: ignore[return-value]

    @property
    def has_xd(self) -> bool:
        """Whether :attr:`xd` was already made (by another reducer)."""
        return self._xd is not None

    @property
    def xd(self) -> torch.Tensor:
        """The tensor in float64, converted once (no copy when already float64)."""
        if self._xd is None:
            self._xd = self.x if self.x.dtype == _F64 else self.x.to(_F64)
        return self._xd

    @property
    def fin(self) -> torch.Tensor | None:
        """The finite mask as 0/1 in x's dtype and layout, or None for integer/bool
        tensors (all finite).

        |x| < inf is 0 for NaN and +-inf: two elementwise ops where
        torch.isfinite decomposes into four (abs, ne, eq, mul), written in place
        into one float buffer because kernels with bool outputs are several
        times slower than float ones on CPU. Its sums are exact counts with
        ``dtype=self.count_dtype``.
        """
        if self._fin is None and self.floating:
            m = torch.abs(self.x)
            self._fin = torch.lt(m, math.inf, out=m)
        return self._fin

    @property
    def count_dtype(self) -> torch.dtype | None:
        """dtype for exact sums of 0/1 indicators in x's float dtype (None: own)."""
        return None if self.numel <= _EXACT_COUNT_LIMIT.get(self.x.dtype, 0) else _F64

    def sorts(self, size: int) -> bool:
        """Whether a sorted sample of ``size`` is (or will be) available cheaply.

        True when a quantiles reducer sorts that sample anyway, and on CUDA,
        where sorting a bounded sample costs microseconds and avoids the atomics
        of a scatter into a few bins.
        """
        return size in self._sorted_sizes or size in self._sorted or self.x.device.type == "cuda"

    def sorted_sample(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample`, sorted ascending (its NaNs, now +inf, at the end)."""
        hit = self._sorted.get(size)
        s, nan = self.sample(size)
        if hit is None:
            hit = self._sorted[size] = torch.sort(s).values
        return hit, nan

    def sample(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A float64 sample with NaN mapped to +inf, and its NaN count (0-d).

        The whole tensor when it has at most ``size`` elements, else exactly
        ``size`` elements drawn uniformly with replacement (i.i.d., which is
        what the DKW bound assumes). NaN becomes +inf so the sample is totally
        ordered for ``searchsorted``/``bucketize``; NaNs then sit past every
        real value (or in the top bin) and callers subtract the NaN count.
        """
        cached = self._samples.get(size)
        if cached is not None:
            return cached
        if self.numel <= size:
            flat = self.x.reshape(-1)  # copies at most `size` elements
        else:
            idx = torch.randint(
                0, self.numel, (size,), generator=self._generator, device=self.x.device
            )
            flat = _gather_flat(self.x, idx)
        s = flat.to(_F64)
        if self.floating:
            isnan = torch.isnan(s)
            nan = isnan.sum(dtype=_F64)
            s = torch.where(isnan, math.inf, s)
        else:
            nan = s.new_zeros(())
        self._samples[size] = (s, nan)
        return s, nan


def _is_dense(x: torch.Tensor) -> bool:
    """True when x's elements fill [storage_offset, storage_offset + numel) exactly."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _flat_view(x: torch.Tensor) -> torch.Tensor | None:
    """All elements as a 1-D view in memory order, or None when not dense.

    Order is irrelevant to every consumer (uniform samples), so channels_last
    and other permuted layouts need no copy.
    """
    if x.is_contiguous():
        return x.view(-1)
    if _is_dense(x):
        return x.as_strided((x.numel(),), (1,), x.storage_offset())
    return None


def _gather_flat(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x.reshape(-1)[idx]`` without copying x when it is not contiguous."""
    flat = _flat_view(x)
    if flat is not None:
        return flat.index_select(0, idx)
    # Sliced/expanded tensors: unravel the logical index into a storage offset.
    offsets = torch.zeros_like(idx)
    rem = idx
    for size, stride in zip(reversed(x.shape), reversed(x.stride())):
        offsets += (rem % size) * stride
        rem = rem // size
    span = 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    return x.as_strided((span,), (1,), x.storage_offset()).index_select(0, offsets)


def _shift_of(ws: _Workspace) -> torch.Tensor:
    """A float64 0-d shift K near the mean of the finite elements.

    Sums of ``x - K`` and ``(x - K)**2`` give the variance without the
    catastrophic cancellation of ``E[x**2] - E[x]**2`` when |mean| >> std, in a
    single pass (a two-pass mean-then-deviation scheme would read x twice).
    Any K within a few std of the mean works, so a few strided elements do:
    the median of the finite ones is within about one std of the mean for any
    distribution, is an actual element (finite, so ``x - K`` cannot overflow
    a float64 upcast of a narrower dtype), and costs four tiny ops.
    """
    k = min(ws.numel, _SHIFT_SAMPLE)
    step = ws.numel // k
    flat = ws.flat
    if flat is not None:
        s = flat.as_strided((k,), (step,))
    else:
        idx = torch.arange(k, device=ws.x.device) * step
        s = _gather_flat(ws.x, idx)
    if not ws.floating:
        return s.to(_F64).mean()
    if ws.numel > k:
        # Plus k random positions: a strided sample alone can land entirely on
        # a masked (NaN) column, and K = 0 would then cancel catastrophically.
        rnd = torch.randint(0, ws.numel, (k,), generator=ws._generator, device=ws.x.device)
        s = torch.cat([s, _gather_flat(ws.x, rnd)])
    # The median of the finite ones by a sort of <= 128 elements: no
    # nanmedian, whose CUDA kernel has read a count on the host in some
    # torch versions. Non-finite values sort last; with none finite, K is 0.
    fin = torch.abs(s) < math.inf
    cnt = fin.sum()
    srt = torch.where(fin, s, math.inf).sort().values
    mid = ((cnt - 1).clamp_min(0) // 2).reshape(1)
    return torch.where(cnt > 0, srt.index_select(0, mid).squeeze(0), 0.0).to(_F64)


#: Float dtypes whose sums of 0/1 indicators are exact in their own dtype up to
#: this many elements (every partial sum is an integer <= numel). Narrower
#: dtypes, and larger tensors, sum their indicators in float64.
_EXACT_COUNT_LIMIT = {torch.float32: 1 << 24, torch.float64: 1 << 53}


#: A float64 zero per device, the filler of unneeded slots (only ever read).
_ZERO_CACHE: dict[torch.device, torch.Tensor] = {}


def _fused_basic_stats(ws: _Workspace, needs: _StatNeeds) -> torch.Tensor:
    """Basic statistics of the whole tensor as one float64 vector.

    Layout: ``[zeros, nan, count_finite, sum(x-K), sum((x-K)**2), K, min, max]``
    over finite elements (zeros and nan over all). Entries nobody needs are 0.

    This is the seam for a fused single-pass kernel: on CUDA a Triton kernel
    reading x once in its native dtype, with per-program register accumulators
    and one atomic per program, replaces this whole function (DESIGN measures
    1.1 TB/s, 1.10-1.40x step time, against ~2-2.6x for these torch ops). The
    torch fallback below takes one cheap pass per statistic and keeps its
    temporaries few and small (fresh allocations page-fault, and kernels with
    bool outputs are several times slower than float ones on CPU):

    * counts are sums of 0/1 indicators written in x's own float dtype into
      ONE scratch buffer (``torch.ne(x, x, out=m)`` for NaN, ...);
    * min/max are exact in the native dtype, over ``nan_to_num`` copies (into
      the same buffer) that map non-finite values to the neutral +-inf;
    * the sums use one float64 copy, shifted and with its non-finite values
      zeroed in place; it also hosts the scratch buffer before the upcast
      overwrites it, so a float32 tensor costs one temporary of 8 bytes per
      element in all.
    """
    x = ws.x
    n = ws.numel
    if n == 0:
        out = x.new_zeros((_BASIC_WIDTH,), dtype=_F64)
        out[_MIN].fill_(math.inf)  # min > max marks "no finite element"
        out[_MAX].fill_(-math.inf)
        return out
    zero = _ZERO_CACHE.get(x.device)
    if zero is None:
        zero = _ZERO_CACHE[x.device] = x.new_zeros((), dtype=_F64)
    stats = [zero] * _BASIC_WIDTH
    flat = ws.flat
    v = flat if flat is not None else x  # every statistic ignores element order
    shift = _shift_of(ws) if needs.shifted else zero

    if not ws.floating:  # integers and bool: all finite, no NaN
        if needs.zeros:
            stats[_ZEROS] = (v == 0).sum()
        if needs.count:
            stats[_COUNT] = x.new_full((), n, dtype=_F64)
        if needs.sums:
            y = ws.xd - shift if needs.shifted else ws.xd
            stats[_S1] = y.sum()
            stats[_S2] = torch.linalg.vector_norm(y).square()
            stats[_SHIFT] = shift
        if needs.minmax:
            stats[_MIN], stats[_MAX] = torch.aminmax(v if v.dtype != torch.bool else v.to(torch.uint8))
        return torch.stack([s.to(_F64) for s in stats])

    dtype = x.dtype
    # The finite mask is shared (built once) when another reducer reads it.
    shared = ws.share_xd
    # A private float64 buffer for the shifted sums, unless another reducer
    # reads the shared upcast (then x - K allocates) or x is float64 already.
    buf = v.new_empty(v.shape, dtype=_F64) if needs.sums and not shared and dtype != _F64 else None
    if needs.zeros or needs.nan or needs.count or needs.minmax:
        if buf is not None:
            m = buf.view(-1).view(dtype)[:n].view(v.shape)
        else:
            m = v.new_empty(v.shape)
        count_dtype = ws.count_dtype
        if needs.zeros:
            stats[_ZEROS] = torch.eq(v, 0, out=m).sum(dtype=count_dtype)
        if needs.nan:
            stats[_NAN] = torch.ne(v, v, out=m).sum(dtype=count_dtype)
        if needs.count:
            fin = ws.fin if shared or dtype == _F64 else None
            if fin is None:  # the same |x| < inf, in the scratch buffer
                fin = torch.lt(torch.abs(v, out=m), math.inf, out=m)
            stats[_COUNT] = fin.sum(dtype=count_dtype)
        if needs.minmax:
            # Exact in the native dtype: no need for the upcast.
            stats[_MIN] = torch.nan_to_num(v, math.inf, math.inf, math.inf, out=m).amin()
            stats[_MAX] = torch.nan_to_num(v, -math.inf, -math.inf, -math.inf, out=m).amax()
    if needs.sums:
        if dtype == _F64:
            # x - K can overflow for finite float64 x near the range limit:
            # keep that inf (std -> inf) and zero only x's own non-finite
            # values (times the 0/1 mask they turn NaN, then 0).
            fin = ws.fin
            assert fin is not None  # x is floating
            y = (x - shift).mul_(fin)
            y.nan_to_num_(0.0, math.inf, -math.inf)
        else:
            # A float64 upcast of a narrower dtype: x - K cannot overflow, so
            # every non-finite value of y comes from x.
            if buf is not None:
                y = buf.copy_(v)
                if needs.shifted:
                    y.sub_(shift)
            else:
                y = ws.xd - shift
            y.nan_to_num_(0.0, 0.0, 0.0)
        stats[_S1] = y.sum()
        # One fused multiply-add pass (BLAS dot); y is a fresh dense tensor.
        flat_y = y.view(-1) if y.is_contiguous() else _flat_view(y)
        stats[_S2] = torch.dot(flat_y, flat_y) if flat_y is not None else y.square().sum()
        stats[_SHIFT] = shift
    # stack promotes the native-dtype counts and min/max to float64 (exactly).
    return torch.stack(stats)


def _device_constant(cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]],
                     values: Sequence[float], device: torch.device,
                     dtype: torch.dtype = _F64) -> torch.Tensor:
    """A constant (float64 by default) on ``device``, created once and cached.

    On CUDA the copy goes through pinned memory with ``non_blocking=True``: a
    pageable host-to-device copy would synchronize. The pinned source is kept
    alive with the result so the asynchronous copy can never read freed memory.
    """
    hit = cache.get(device)
    if hit is not None:
        return hit[0]
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cpu":
        cache[device] = (host, None)
        return host
    pinned = host.pin_memory() if device.type == "cuda" else host
    dev = pinned.to(device, non_blocking=True)
    cache[device] = (dev, pinned)
    return dev


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


# --------------------------------------------------------------------------
# Reducers
# --------------------------------------------------------------------------


class Reducer(abc.ABC):
    """One validated reducer: knows its slot count, device work and decoding.

    Attributes:
        kind: The ``ReducerKind`` value.
        field: Field path of the spec it came from, for error messages.
    """

    kind: ClassVar[int]
    needs: ClassVar[_StatNeeds] = _StatNeeds()
    #: Reads the workspace's shared float64 upcast ``ws.xd``.
    reads_upcast: ClassVar[bool] = False

    def __init__(self, field: str) -> None:
        self.field = field

    @property
    def name(self) -> str:
        """Short name, e.g. ``"moments"``."""
        return reducer_name(self.kind)

    def spec(self) -> pb.ReducerSpec:
        """The spec with every server default filled in."""
        return pb.ReducerSpec(kind=self.kind)  # type: ignore[arg-type]

    def key(self) -> tuple[object, ...]:
        """Identity used to reject duplicate reducers."""
        return (self.kind,)

    @abc.abstractmethod
    def width(self, shape: Sequence[int]) -> int:
        """Number of float64 slots this reducer writes for a tensor of ``shape``."""

    def check(self, shape: Sequence[int]) -> None:
        """Raises SpecError when the reducer cannot apply to ``shape``."""

    @abc.abstractmethod
    def compute(self, ws: _Workspace) -> torch.Tensor:
        """Returns this reducer's ``width`` slots as a 1-D float64 device tensor."""

    @abc.abstractmethod
    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        """Builds the result message from this reducer's host slots.

        Args:
            values: Exactly ``width(shape)`` float64 values.
            shape: Shape of the reduced tensor; host metadata such as the
                element count is taken from it instead of costing device slots.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.field})"


class _BasicReducer(Reducer):
    """A reducer whose slots are a slice of the basic-statistics vector."""

    _slots: ClassVar[tuple[int, int]]

    def width(self, shape: Sequence[int]) -> int:
        return self._slots[1] - self._slots[0]

    def compute(self, ws: _Workspace) -> torch.Tensor:
        assert ws.basic is not None
        return ws.basic[self._slots[0] : self._slots[1]]


def _finite_or_nan(lo: float, hi: float) -> tuple[float, float]:
    # The fill values make lo > hi exactly when no element was finite.
    return (math.nan, math.nan) if lo > hi else (lo, hi)


class MomentsReducer(_BasicReducer):
    """Count, mean and population std of the finite elements."""

    kind = pb.REDUCER_KIND_MOMENTS
    needs = _StatNeeds(count=True, sums=True, shifted=True)
    _slots = (_COUNT, _SHIFT + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        count, s1, s2, shift = values.tolist()
        n = int(count)
        if n == 0:
            return pb.ReducerResult(moments=pb.Moments(count=0, mean=math.nan, std=math.nan))
        d = s1 / count
        if math.isinf(s2):  # float64 data beyond ~1e154: the square overflowed
            return pb.ReducerResult(moments=pb.Moments(count=n, mean=shift + d, std=math.inf))
        var = s2 / count - d * d
        std = math.sqrt(var) if var > 0 else 0.0  # also maps a NaN var to 0, never NaN
        return pb.ReducerResult(moments=pb.Moments(count=n, mean=shift + d, std=std))


class MinMaxReducer(_BasicReducer):
    """Min and max of the finite elements."""

    kind = pb.REDUCER_KIND_MINMAX
    needs = _StatNeeds(minmax=True)
    _slots = (_MIN, _MAX + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        lo, hi = _finite_or_nan(float(values[0]), float(values[1]))
        return pb.ReducerResult(minmax=pb.MinMax(min=lo, max=hi))


class AbsMaxReducer(_BasicReducer):
    """Largest magnitude among the finite elements (derived from min and max)."""

    kind = pb.REDUCER_KIND_ABS_MAX
    needs = _StatNeeds(minmax=True)
    _slots = (_MIN, _MAX + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        lo, hi = _finite_or_nan(float(values[0]), float(values[1]))
        value = math.nan if math.isnan(lo) else max(abs(lo), abs(hi))
        return pb.ReducerResult(abs_max=pb.AbsMax(value=value))


class ZeroFractionReducer(_BasicReducer):
    """Fraction of exact zeros among all elements."""

    kind = pb.REDUCER_KIND_ZERO_FRACTION
    needs = _StatNeeds(zeros=True)
    _slots = (_ZEROS, _ZEROS + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        n = _numel(shape)
        fraction = float(values[0]) / n if n else math.nan
        return pb.ReducerResult(zero_fraction=pb.ZeroFraction(fraction=fraction, count=n))


class NonfiniteReducer(_BasicReducer):
    """NaN and +-Inf counts; Inf is derived as ``numel - finite - nan``."""

    kind = pb.REDUCER_KIND_NONFINITE
    needs = _StatNeeds(nan=True, count=True)
    _slots = (_NAN, _COUNT + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        nan, finite = int(values[0]), int(values[1])
        inf = _numel(shape) - finite - nan
        return pb.ReducerResult(nonfinite=pb.Nonfinite(nan_count=nan, inf_count=inf))


class NormReducer(_BasicReducer):
    """L2 norm of the finite elements, from the (possibly shifted) sums."""

    kind = pb.REDUCER_KIND_NORM
    needs = _StatNeeds(count=True, sums=True)
    _slots = (_COUNT, _SHIFT + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        count, s1, s2, shift = values.tolist()
        # sum(x**2) = sum((x-K)**2) + 2K sum(x-K) + n K**2; K is 0 unless the
        # plan also computes moments.
        sumsq = s2 + 2.0 * shift * s1 + count * shift * shift
        if math.isinf(s2) or math.isinf(sumsq):
            return pb.ReducerResult(norm=pb.Norm(l2=math.inf))  # overflow: inf, as numpy says
        return pb.ReducerResult(norm=pb.Norm(l2=math.sqrt(sumsq) if sumsq > 0 else 0.0))


class HistogramReducer(Reducer):
    """Counts over frozen edges, on the whole tensor or a uniform sample."""

    kind = pb.REDUCER_KIND_HISTOGRAM

    def __init__(self, field: str, edges: Sequence[float], sample_size: int,
                 bins: int = 0, lo: float = 0.0, hi: float = 0.0) -> None:
        super().__init__(field)
        self.edges = tuple(float(e) for e in edges)
        self.sample_size = sample_size
        self._range = (bins, lo, hi)  # echoed in spec() when given as a range
        self._edge_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def spec(self) -> pb.ReducerSpec:
        bins, lo, hi = self._range
        params = (
            pb.HistogramParams(bins=bins, min=lo, max=hi, sample_size=self.sample_size)
            if bins
            else pb.HistogramParams(edges=self.edges, sample_size=self.sample_size)
        )
        return pb.ReducerSpec(kind=self.kind, histogram=params)

    def key(self) -> tuple[object, ...]:
        return (self.kind, self.edges, self.sample_size)

    def width(self, shape: Sequence[int]) -> int:
        return len(self.edges) + 1

    def compute(self, ws: _Workspace) -> torch.Tensor:
        x = ws.x
        if ws.numel == 0:
            return x.new_zeros((len(self.edges) + 1,), dtype=_F64)
        edges = _device_constant(self._edge_cache, self.edges, x.device)
        # Only a bounded sample is ever binned: full-tensor scatters are the
        # 39x trap in DESIGN.
        if ws.sorts(self.sample_size):
            # Binary-search the edges in the sorted sample: no atomics,
            # deterministic, and the sort is shared with quantiles.
            s, nan = ws.sorted_sample(self.sample_size)
            below = torch.searchsorted(s, edges, right=False).to(_F64)  # elements < edge
            binned = (s.numel() - nan).reshape(1)  # NaN (mapped to +inf) is not binned
            cumulative = torch.cat([below, binned])
            return torch.diff(cumulative, prepend=cumulative.new_zeros(1))
        # CPU without a shared sort: bucketize + a small scatter is ~3x cheaper.
        s, nan = ws.sample(self.sample_size)
        idx = torch.bucketize(s, edges, right=True)  # bin i holds edges[i-1] <= x < edges[i]
        counts = s.new_zeros(len(self.edges) + 1).index_add_(0, idx, torch.ones_like(s))
        counts[-1:].sub_(nan)  # the NaNs, mapped to +inf, landed in the top bin
        return counts

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        # One vectorized rint (half-to-even, like round()): round() on numpy
        # scalars costs ~1.5 us each, and decoding runs on the collector
        # thread, which competes with the model thread for the GIL.
        counts = np.rint(values).astype(np.int64).tolist()
        return pb.ReducerResult(
            histogram=pb.Histogram(
                edges=self.edges, counts=counts, sample_size=sum(counts), population=_numel(shape)
            )
        )


class QuantilesReducer(Reducer):
    """Quantiles of the non-NaN elements, exact or from a bounded sample."""

    kind = pb.REDUCER_KIND_QUANTILES

    def __init__(self, field: str, probabilities: Sequence[float], sample_size: int) -> None:
        super().__init__(field)
        self.probabilities = tuple(float(p) for p in probabilities)
        self.sample_size = sample_size
        self._p_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def spec(self) -> pb.ReducerSpec:
        params = pb.QuantileParams(probabilities=self.probabilities, sample_size=self.sample_size)
        return pb.ReducerSpec(kind=self.kind, quantiles=params)

    def key(self) -> tuple[object, ...]:
        return (self.kind, self.probabilities, self.sample_size)

    def width(self, shape: Sequence[int]) -> int:
        return 1 + len(self.probabilities)  # [non-NaN sample count, values...]

    def compute(self, ws: _Workspace) -> torch.Tensor:
        x = ws.x
        k = len(self.probabilities)
        if ws.numel == 0:
            return torch.cat([x.new_zeros((1,), dtype=_F64), x.new_full((k,), math.nan, dtype=_F64)])
        s, nan = ws.sorted_sample(self.sample_size)
        p = _device_constant(self._p_cache, self.probabilities, x.device)
        n = s.numel() - nan  # non-NaN values; they occupy s[:n]
        # numpy 'linear' (Hyndman-Fan 7), written out so results match
        # np.quantile bit for bit when unsampled.
        virtual = (n - 1.0) * p
        prev = torch.floor(virtual)
        gamma = virtual - prev
        top = (n - 1.0).clamp_min(0.0)
        prev_i = prev.clamp(min=0.0).minimum(top).long()
        next_i = (prev + 1.0).clamp(min=0.0).minimum(top).long()
        a, b = s.index_select(0, prev_i), s.index_select(0, next_i)
        diff = b - a
        lerp = torch.where(gamma >= 0.5, b - diff * (1.0 - gamma), a + diff * gamma)
        # An infinite endpoint makes the lerp NaN (inf - inf); fall back to the
        # nearer order statistic, which is within the same rank error.
        nearest = torch.where(gamma >= 0.5, b, a)
        value = torch.where(torch.isinf(a) | torch.isinf(b), nearest, lerp)
        value = torch.where(a == b, a, value)
        value = torch.where(n > 0, value, math.nan)
        return torch.cat([n.reshape(1), value])

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        population = _numel(shape)
        n = int(round(float(values[0])))
        sampled = population > self.sample_size
        if not sampled:
            rank_error = 0.0
        elif n == 0:
            rank_error = 1.0  # nothing but NaN was drawn: no information
        else:
            rank_error = min(1.0, math.sqrt(math.log(2.0 / QUANTILE_DELTA) / (2.0 * n)) + 1.0 / n)
        return pb.ReducerResult(
            quantiles=pb.Quantiles(
                probabilities=self.probabilities,
                values=values[1:].tolist(),
                sample_size=n,
                population=population,
                rank_error=rank_error,
            )
        )


class PerChannelReducer(Reducer):
    """Mean, std and abs_max of the finite elements of each channel."""

    kind = pb.REDUCER_KIND_PER_CHANNEL
    reads_upcast = True

    def __init__(self, field: str, dim: int, max_channels: int) -> None:
        super().__init__(field)
        self.dim = dim
        self.max_channels = max_channels

    def spec(self) -> pb.ReducerSpec:
        params = pb.PerChannelParams(dim=self.dim, max_channels=self.max_channels)
        return pb.ReducerSpec(kind=self.kind, per_channel=params)

    def key(self) -> tuple[object, ...]:
        return (self.kind, self.dim, self.max_channels)

    def _axis(self, shape: Sequence[int]) -> int:
        ndim = len(shape)
        if not -ndim <= self.dim < ndim:
            raise SpecError(
                f"{self.field}.per_channel.dim",
                f"dim {self.dim} is out of range for a {ndim}-d tensor of shape {list(shape)}",
            )
        return self.dim % ndim

    def check(self, shape: Sequence[int]) -> None:
        self._axis(shape)

    def _reported(self, shape: Sequence[int]) -> int:
        return min(int(shape[self._axis(shape)]), self.max_channels)

    def width(self, shape: Sequence[int]) -> int:
        return 3 * self._reported(shape)  # [mean * c, std * c, abs_max * c]

    def compute(self, ws: _Workspace) -> torch.Tensor:
        x = ws.x
        axis = self._axis(x.shape)
        c = self._reported(x.shape)
        if c == 0 or ws.numel == 0:
            return x.new_full((3 * c,), math.nan, dtype=_F64)
        xc = x.narrow(axis, 0, c)
        fin = ws.fin
        fin = fin.narrow(axis, 0, c) if fin is not None else None
        # The float64 channels, non-finite -> NaN so that nansum skips them.
        # Reuse the shared upcast when another reducer made it (or x is
        # float64), else upcast privately and clean in place.
        if ws.has_xd or x.dtype == _F64:
            xd = ws.xd.narrow(axis, 0, c)
            z = torch.nan_to_num(xd, math.nan, math.nan, math.nan) if ws.floating else xd.clone()
        else:
            z = xc.to(_F64)
            if ws.floating:
                z.nan_to_num_(math.nan, math.nan, math.nan)
        if x.dim() == 1:
            # Each element is its own channel; reducing over an empty dim
            # tuple would reduce over everything, so add a unit dim instead.
            xc, z = xc.unsqueeze(1), z.unsqueeze(1)
            fin = fin.unsqueeze(1) if fin is not None else None
            dims: tuple[int, ...] = (1,)
        else:
            dims = tuple(d for d in range(x.dim()) if d != axis)
        if fin is None:
            count = z.new_full((c,), ws.numel // int(x.shape[axis]))
            # Integers: no NaN, and abs_max is exact from the float64 extremes.
            absmax = torch.maximum(z.amax(dims), z.amin(dims).neg())
        else:
            count = fin.sum(dims, dtype=ws.count_dtype)
            # Exact in the native dtype, with non-finite values -> 0.
            absmax = torch.nan_to_num(xc, 0.0, 0.0, 0.0).abs_().amax(dims)
        # Two passes per channel (mean, then squared deviations) keep the std
        # accurate when |mean| >> std; channels are few, the extra pass small.
        mean = z.nansum(dims) / count  # 0/0 = NaN for channels without finite elements
        z.sub_(mean.reshape([c if d == axis else 1 for d in range(z.dim())])).square_()
        std = (z.nansum(dims) / count).sqrt()
        absmax = torch.where(count > 0, absmax, math.nan)
        return torch.cat([mean, std, absmax])

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        c = len(values) // 3
        return pb.ReducerResult(
            per_channel=pb.PerChannel(
                dim=self.dim,
                mean=values[:c].tolist(),
                std=values[c : 2 * c].tolist(),
                abs_max=values[2 * c :].tolist(),
                channels=int(shape[self._axis(shape)]),
            )
        )


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def _check_sample_size(field: str, size: int) -> int:
    if size == 0:
        return DEFAULT_SAMPLE_SIZE
    if size > MAX_SAMPLE_SIZE:
        raise SpecError(field, f"sample_size {size} exceeds the cap {MAX_SAMPLE_SIZE}")
    return size


def _build_histogram(field: str, params: pb.HistogramParams) -> HistogramReducer:
    f = f"{field}.histogram"
    size = _check_sample_size(f"{f}.sample_size", params.sample_size)
    if params.edges:
        edges = list(params.edges)
        if len(edges) > MAX_BINS + 1:
            raise SpecError(f"{f}.edges", f"{len(edges)} edges exceed the cap of {MAX_BINS + 1}")
        for i, e in enumerate(edges):
            if not math.isfinite(e):
                raise SpecError(f"{f}.edges[{i}]", f"edge {e} is not finite (the end bins are already open)")
            if i and e <= edges[i - 1]:
                raise SpecError(f"{f}.edges[{i}]", f"edges must be strictly increasing ({edges[i - 1]} then {e})")
        return HistogramReducer(field, edges, size)
    bins = params.bins or DEFAULT_HISTOGRAM_BINS
    lo, hi = params.min, params.max
    if lo == 0.0 and hi == 0.0:
        lo, hi = DEFAULT_HISTOGRAM_RANGE
    if bins > MAX_BINS:
        raise SpecError(f"{f}.bins", f"bins must be in 1..{MAX_BINS}, got {bins}")
    if not math.isfinite(lo):
        raise SpecError(f"{f}.min", f"min must be finite, got {lo}")
    if not math.isfinite(hi) or hi <= lo:
        raise SpecError(f"{f}.max", f"max must be finite and greater than min ({lo}), got {hi}")
    edges = np.linspace(lo, hi, bins + 1).tolist()
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise SpecError(f"{f}.bins", f"range [{lo}, {hi}) is too narrow for {bins} distinct bins")
    return HistogramReducer(field, edges, size, bins=bins, lo=lo, hi=hi)


def _build_quantiles(field: str, params: pb.QuantileParams) -> QuantilesReducer:
    f = f"{field}.quantiles"
    size = _check_sample_size(f"{f}.sample_size", params.sample_size)
    probs = list(params.probabilities) or list(DEFAULT_PROBABILITIES)
    if len(probs) > MAX_PROBABILITIES:
        raise SpecError(f"{f}.probabilities", f"{len(probs)} probabilities exceed the cap of {MAX_PROBABILITIES}")
    for i, p in enumerate(probs):
        if not 0.0 <= p <= 1.0:  # also rejects NaN
            raise SpecError(f"{f}.probabilities[{i}]", f"probability must be in [0, 1], got {p}")
    return QuantilesReducer(field, probs, size)


def _build_per_channel(field: str, params: pb.PerChannelParams) -> PerChannelReducer:
    f = f"{field}.per_channel"
    cap = params.max_channels or DEFAULT_MAX_CHANNELS
    if cap > MAX_CHANNELS:
        raise SpecError(f"{f}.max_channels", f"max_channels must be at most {MAX_CHANNELS}, got {cap}")
    # proto3 cannot tell an unset dim from 0, and the contract's default is 1.
    return PerChannelReducer(field, params.dim or 1, cap)


_SIMPLE: dict[int, type[_BasicReducer]] = {
    cls.kind: cls
    for cls in (MomentsReducer, MinMaxReducer, AbsMaxReducer, ZeroFractionReducer, NonfiniteReducer, NormReducer)
}
_PARAM_OF_KIND: dict[int, _ParamField] = {
    pb.REDUCER_KIND_HISTOGRAM: "histogram",
    pb.REDUCER_KIND_QUANTILES: "quantiles",
    pb.REDUCER_KIND_PER_CHANNEL: "per_channel",
}


def build_reducers(specs: Sequence[pb.ReducerSpec], field_prefix: str = "reducers") -> list[Reducer]:
    """Validates reducer specs and builds the reducers, host-side and once.

    Args:
        specs: The requested reducers, in the order results will come back.
        field_prefix: Field path of ``specs`` in the request, for errors.

    Returns:
        One reducer per spec, in order.

    Raises:
        SpecError: On an unknown kind, a parameter out of range, parameters
            given for a kind that takes none (or another kind's), or a
            duplicate reducer (same kind and same effective parameters).
    """
    reducers: list[Reducer] = []
    seen: dict[tuple[object, ...], int] = {}
    for i, spec in enumerate(specs):
        field = f"{field_prefix}[{i}]"
        kind = spec.kind
        if kind not in _KIND_NAMES:
            raise SpecError(
                f"{field}.kind",
                f"reducer kind {pb.ReducerKind.Name(kind) if kind in pb.ReducerKind.values() else kind} "
                f"is not valid; use one of: {', '.join(REDUCER_NAMES)}",
            )
        own = _PARAM_OF_KIND.get(kind)
        for other in _PARAM_FIELDS:
            if other != own and spec.HasField(other):
                raise SpecError(f"{field}.{other}", f"{other} parameters do not apply to a {_KIND_NAMES[kind]} reducer")
        reducer: Reducer
        if kind == pb.REDUCER_KIND_HISTOGRAM:
            reducer = _build_histogram(field, spec.histogram)
        elif kind == pb.REDUCER_KIND_QUANTILES:
            reducer = _build_quantiles(field, spec.quantiles)
        elif kind == pb.REDUCER_KIND_PER_CHANNEL:
            reducer = _build_per_channel(field, spec.per_channel)
        else:
            reducer = _SIMPLE[kind](field)
        key = reducer.key()
        if key in seen:
            raise SpecError(field, f"duplicate of {field_prefix}[{seen[key]}] ({reducer.name})")
        seen[key] = i
        reducers.append(reducer)
    return reducers


# --------------------------------------------------------------------------
# The fused plan
# --------------------------------------------------------------------------


class ReducerPlan:
    """Runs a list of reducers on a tensor as one fused unit of device work.

    Args:
        reducers: Validated reducers, from :func:`build_reducers`.
        seed: Seed of the plan's private sampling generators (one per device);
            sampling never touches the global RNG, so taps do not change a
            model's dropout or data order.
    """

    def __init__(self, reducers: Sequence[Reducer], seed: int = 0) -> None:
        self.reducers: tuple[Reducer, ...] = tuple(reducers)
        self.seed = seed
        needs = _StatNeeds()
        for r in self.reducers:
            needs = needs | r.needs
        self._needs = needs
        self._needs_any = needs.any()  # dataclasses.astuple per run costs ~30 us on the hot path
        self._sorted_sizes = frozenset(r.sample_size for r in self.reducers if isinstance(r, QuantilesReducer))
        self._share_xd = any(r.reads_upcast for r in self.reducers)
        # Only shape-dependent reducers (per_channel) check anything per tensor.
        self._checked = tuple(r for r in self.reducers if type(r).check is not Reducer.check)
        # A plan of basic reducers only is one gather from the basic vector.
        self._basic_slots: tuple[int, ...] | None = None
        if self.reducers and all(isinstance(r, _BasicReducer) for r in self.reducers):
            self._basic_slots = tuple(i for r in self.reducers for i in range(*r._slots))  # type: ignore[attr-defined]
        self._slot_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def __len__(self) -> int:
        return len(self.reducers)

    def __repr__(self) -> str:
        return f"ReducerPlan([{', '.join(r.name for r in self.reducers)}])"

    def nonfinite_only(self) -> ReducerPlan | None:
        """The sub-plan to run on unsampled passes: just ``nonfinite``, or None."""
        kept = [r for r in self.reducers if r.kind == pb.REDUCER_KIND_NONFINITE]
        return ReducerPlan(kept, self.seed) if kept else None

    def width(self, shape: Sequence[int]) -> int:
        """Total float64 slots of :meth:`run`'s output for a tensor of ``shape``.

        Raises:
            SpecError: When a reducer cannot apply to the shape (per_channel dim).
        """
        return sum(r.width(shape) for r in self.reducers)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """Reduces ``x`` on its device, without any host sync.

        Args:
            x: Any strided real, integer or bool tensor: any layout, 0-d or empty.

        Returns:
            A 1-D float64 tensor on ``x.device`` of ``width(x.shape)`` slots,
            the reducers' slots concatenated in plan order.

        Raises:
            TypeError: For complex, quantized or non-strided tensors.
            SpecError: When a reducer cannot apply to ``x``'s shape.
        """
        if x.layout != torch.strided or x.is_quantized or x.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"reducers need a strided real, integer or bool tensor, got {x.dtype} ({x.layout})")
        for r in self._checked:
            r.check(x.shape)
        if not self.reducers:
            return x.new_zeros((0,), dtype=_F64)
        with torch.no_grad():
            ws = _Workspace(x.detach() if x.requires_grad else x, self._generator(x.device),
                            self._sorted_sizes, self._share_xd)
            if self._needs_any:
                ws.basic = _fused_basic_stats(ws, self._needs)
            if self._basic_slots is not None:
                assert ws.basic is not None
                slots = _device_constant(self._slot_cache, self._basic_slots, x.device, torch.int64)
                return ws.basic.index_select(0, slots)
            return torch.cat([r.compute(ws) for r in self.reducers])

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> list[pb.ReducerResult]:
        """Turns :meth:`run`'s output, copied to the host, into result messages.

        Args:
            values: The float64 slots of one tensor.
            shape: The shape of the tensor that was reduced.

        Returns:
            One ``ReducerResult`` per reducer, in plan order.

        Raises:
            ValueError: When ``values`` does not have ``width(shape)`` slots.
        """
        values = np.asarray(values, dtype=np.float64)
        widths = [r.width(shape) for r in self.reducers]
        if values.shape != (sum(widths),):
            raise ValueError(f"expected {sum(widths)} slots for shape {list(shape)}, got {values.shape}")
        results = []
        start = 0
        for r, w in zip(self.reducers, widths):
            results.append(r.decode(values[start : start + w], shape))
            start += w
        return results
