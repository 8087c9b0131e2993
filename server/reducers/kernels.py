"""The shared tensor kernels: the basic statistics every basic reducer reads.

Rules every reducer follows (docs/design.md, "Measured facts"):

* No host sync: no ``.item()``, ``.cpu()``, ``.tolist()``, ``histc``,
  ``nonzero``, ``bincount``, boolean-mask indexing or Python branching on tensor
  values. Only shapes and dtypes (host metadata) steer control flow.
* No full-tensor sort or ``scatter_add_``: histograms and quantiles work on a
  bounded uniform sample, drawn with a private generator so the model's own RNG
  stream is never perturbed.
* Work is shared: the float64 upcast, the finite mask and the basic statistics
  (:func:`fused_basic_stats`) are computed once per tensor for every reducer.
  The torch fallback keeps temporaries few and small: on CPU a fresh large
  allocation page-faults, and kernels with bool outputs (masks) are several
  times slower than float ones, so masks and counts are 0/1 floats, and
  non-finite values are handled with ``nan_to_num`` rather than ``where``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from layertap.server.reducers.workspace import F64, Workspace, flat_view, gather_flat

__all__ = [
    "BASIC_WIDTH", "COUNT", "MAX", "MIN", "NAN", "S1", "S2", "SHIFT", "ZEROS",
    "StatNeeds", "fused_basic_stats", "shift_of",
]

#: Elements read (strided, and as many at random) to pick the moments shift;
#: see :func:`shift_of`. 16 + 16 keep the median robust (it moves only when
#: half the sample is extreme) and cost the compiled kernel's rank median
#: 32x32 comparisons: with 64 + 64 that median was most of a small tensor's
#: call (41 -> 24 us for 1,100 elements on the 2-core CPU machine).
_SHIFT_SAMPLE = 16

# Layout of the basic-statistics vector. Basic reducers' slots are views into
# it, so they cost no device work beyond the final concatenation.
ZEROS, NAN, COUNT, S1, S2, SHIFT, MIN, MAX = range(8)
BASIC_WIDTH = 8


@dataclasses.dataclass(frozen=True)
class StatNeeds:
    """Which basic statistics some reducer of the plan reads."""

    zeros: bool = False
    nan: bool = False
    count: bool = False
    sums: bool = False
    shifted: bool = False
    minmax: bool = False

    def __or__(self, other: StatNeeds) -> StatNeeds:
        return StatNeeds(*(a or b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def any(self) -> bool:
        return any(dataclasses.astuple(self))


def shift_of(ws: Workspace) -> torch.Tensor:
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
        s = gather_flat(ws.x, idx)
    if not ws.floating:
        return s.to(F64).mean()
    if ws.numel > k:
        # Plus k random positions: a strided sample alone can land entirely on
        # a masked (NaN) column, and K = 0 would then cancel catastrophically.
        rnd = torch.randint(0, ws.numel, (k,), generator=ws.generator, device=ws.x.device)
        s = torch.cat([s, gather_flat(ws.x, rnd)])
    # The median of the finite ones by a sort of <= 2 * _SHIFT_SAMPLE elements: no
    # nanmedian, whose CUDA kernel has read a count on the host in some
    # torch versions. Non-finite values sort last; with none finite, K is 0.
    fin = torch.abs(s) < math.inf
    cnt = fin.sum()
    srt = torch.where(fin, s, math.inf).sort().values
    mid = ((cnt - 1).clamp_min(0) // 2).reshape(1)
    return torch.where(cnt > 0, srt.index_select(0, mid).squeeze(0), 0.0).to(F64)


#: A float64 zero per device, the filler of unneeded slots (only ever read).
_ZERO_CACHE: dict[torch.device, torch.Tensor] = {}


def fused_basic_stats(ws: Workspace, needs: StatNeeds) -> torch.Tensor:
    """Basic statistics of the whole tensor as one float64 vector.

    Layout: ``[zeros, nan, count_finite, sum(x-K), sum((x-K)**2), K, min, max]``
    over finite elements (zeros and nan over all). Entries nobody needs are 0.

    This is the seam for a fused single-pass kernel: on CUDA a Triton kernel
    reading x once in its native dtype, with per-program register accumulators
    and one atomic per program, replaces this whole function (docs/design.md:
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
        out = x.new_zeros((BASIC_WIDTH,), dtype=F64)
        out[MIN].fill_(math.inf)  # min > max marks "no finite element"
        out[MAX].fill_(-math.inf)
        return out
    zero = _ZERO_CACHE.get(x.device)
    if zero is None:
        zero = _ZERO_CACHE[x.device] = x.new_zeros((), dtype=F64)
    stats = [zero] * BASIC_WIDTH
    flat = ws.flat
    v = flat if flat is not None else x  # every statistic ignores element order
    shift = shift_of(ws) if needs.shifted else zero

    if not ws.floating:  # integers and bool: all finite, no NaN
        if needs.zeros:
            stats[ZEROS] = (v == 0).sum()
        if needs.count:
            stats[COUNT] = x.new_full((), n, dtype=F64)
        if needs.sums:
            y = ws.xd - shift if needs.shifted else ws.xd
            stats[S1] = y.sum()
            stats[S2] = torch.linalg.vector_norm(y).square()
            stats[SHIFT] = shift
        if needs.minmax:
            stats[MIN], stats[MAX] = torch.aminmax(v if v.dtype != torch.bool else v.to(torch.uint8))
        return torch.stack([s.to(F64) for s in stats])

    dtype = x.dtype
    # The finite mask is shared (built once) when another reducer reads it.
    shared = ws.share_xd
    # A private float64 buffer for the shifted sums, unless another reducer
    # reads the shared upcast (then x - K allocates) or x is float64 already.
    buf = v.new_empty(v.shape, dtype=F64) if needs.sums and not shared and dtype != F64 else None
    if needs.zeros or needs.nan or needs.count or needs.minmax:
        if buf is not None:
            m = buf.view(-1).view(dtype)[:n].view(v.shape)
        else:
            m = v.new_empty(v.shape)
        count_dtype = ws.count_dtype
        if needs.zeros:
            stats[ZEROS] = torch.eq(v, 0, out=m).sum(dtype=count_dtype)
        if needs.nan:
            stats[NAN] = torch.ne(v, v, out=m).sum(dtype=count_dtype)
        if needs.count:
            fin = ws.fin if shared or dtype == F64 else None
            if fin is None:  # the same |x| < inf, in the scratch buffer
                fin = torch.lt(torch.abs(v, out=m), math.inf, out=m)
            stats[COUNT] = fin.sum(dtype=count_dtype)
        if needs.minmax:
            # Exact in the native dtype: no need for the upcast.
            stats[MIN] = torch.nan_to_num(v, math.inf, math.inf, math.inf, out=m).amin()
            stats[MAX] = torch.nan_to_num(v, -math.inf, -math.inf, -math.inf, out=m).amax()
    if needs.sums:
        if dtype == F64:
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
        stats[S1] = y.sum()
        # One fused multiply-add pass (BLAS dot); y is a fresh dense tensor.
        flat_y = y.view(-1) if y.is_contiguous() else flat_view(y)
        stats[S2] = torch.dot(flat_y, flat_y) if flat_y is not None else y.square().sum()
        stats[SHIFT] = shift
    # stack promotes the native-dtype counts and min/max to float64 (exactly).
    return torch.stack(stats)
