"""The basic statistics as torch functions: one read of a tensor, the math a compiler fuses.

Why apart from the compiled kernel (:mod:`layertap.server.compile.kernel`): the
statistics can be read, tested and run eagerly without the compile machinery
(a pass's batched small tensors run :func:`batched_stats_body` eagerly until
their kernel is ready), while compilation decides only when and how they run.
"""

from __future__ import annotations

import math
import threading

import torch

from layertap.server.reducers.kernels import _SHIFT_SAMPLE as SHIFT_SAMPLE
from layertap.server.reducers.workspace import F64

__all__ = ["SHIFT_SAMPLE", "UNCOMPILED", "basic_stats_body", "batched_stats_body", "evenly_spaced", "shift_sample",
           "stats_of"]

#: ``UNCOMPILED.flag`` is set when :func:`basic_stats_body` runs uncompiled
#: (a guard miss in run-only mode); callers clear it before a call and read
#: it right after, on the same thread.
UNCOMPILED = threading.local()

def basic_stats_body(x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """The eight basic statistics of ``x`` (more than ``SHIFT_SAMPLE`` elements) in one read.

    Same layout and values as ``fused_basic_stats`` with every need set,
    including the shift: K is :func:`~layertap.server.reducers.kernels.shift_of`
    computed in the graph (its ~10 tiny eager ops cost more than this whole
    kernel) from the same elements: ``rnd`` holds the random positions shift_of
    would draw from the plan's generator, and K is multiplied by ``on``
    (shape ``(1,)``, 0 when no reducer reads a shifted sum, as in the eager
    path). x is read in its own dtype and upcast per element (exact for every
    supported dtype), which lets inductor fuse the reductions.
    """
    if not torch.compiler.is_compiling():  # a constant True in the traced graph
        UNCOMPILED.flag = True
    s = shift_sample(x, rnd)
    return stats_of(x, _shift(s, on) if x.is_floating_point() else s.to(F64).mean() * on)


def _take(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``x.reshape(-1)[flat]`` without the view: a compiled model's activation may be laid out
    channels_last by inductor, and a flat view of it would make inductor copy it whole."""
    if x.dim() == 1:
        return x[flat]
    index = []
    for size in reversed(x.shape[1:]):
        index.append(flat % size)
        flat = flat // size
    return x[(flat, *reversed(index))]


def evenly_spaced(x: torch.Tensor) -> torch.Tensor:
    """``SHIFT_SAMPLE`` elements of ``x`` evenly spaced in logical (row-major) order."""
    return _take(x, torch.arange(SHIFT_SAMPLE, device=x.device) * (x.numel() // SHIFT_SAMPLE))


def shift_sample(x: torch.Tensor, rnd: torch.Tensor) -> torch.Tensor:
    """The elements the shift K is the median of: ``SHIFT_SAMPLE`` evenly spaced, then ``rnd``'s (floats only).

    Positions are logical (row-major) flat indices; for the kernel's 1-D ``dense`` and 2-D ``rows``
    forms that is memory order, as shift_of's gather reads it."""
    s = evenly_spaced(x)
    if x.is_floating_point():
        s = torch.cat([s, _take(x, rnd)])
    return s


def _shift(s: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """K: the median of the sample's finite values (0 when none), times ``on``; float64, shape (1,)."""
    ok = torch.abs(s) < math.inf
    cnt = ok.sum()
    v = torch.where(ok, s, math.inf)
    # The mid-th smallest finite value (shift_of's sorted[mid]) by ranks, not
    # a sort: inductor has no CPU sort and calls aten's, a third of a small
    # tensor's call. Exactly the elements equal to sorted[mid] have at most
    # mid elements below them and more than mid at or below them.
    mid = (cnt - 1).clamp_min(0) // 2
    below = (v.unsqueeze(0) < v.unsqueeze(1)).sum(1)
    at_or_below = (v.unsqueeze(0) <= v.unsqueeze(1)).sum(1)
    median = torch.where((below <= mid) & (at_or_below > mid), v, -math.inf).amax()
    return torch.where(cnt > 0, median, 0.0).to(F64) * on


def stats_of(x: torch.Tensor, k: torch.Tensor, counts: torch.dtype = F64) -> torch.Tensor:
    """The eight basic statistics of ``x``, any rank, its sums shifted by ``k`` (float64, shape (1,)).

    Every reduction is over all of x's elements, so a compiler may read them in memory order (a
    channels_last activation inside a compiled model: ``reshape(-1)`` first would force logical order,
    a strided scalar loop). ``counts`` is the dtype the three counts accumulate in (exact: an
    integer type must hold ``x.numel()``)."""
    if x.is_floating_point():
        fin = torch.abs(x) < math.inf
        nan = (x != x).sum(dtype=counts).to(F64)
        count = fin.sum(dtype=counts).to(F64)
        # x - K only overflows for float64 x near its range limit; that inf is
        # kept (std -> inf) as in the eager path, since fin is x's own mask.
        y = torch.where(fin, x.to(F64) - k, 0.0)
        lo = torch.where(fin, x, math.inf).amin().to(F64)
        hi = torch.where(fin, x, -math.inf).amax().to(F64)
    else:  # integers and bool: all finite, no NaN
        v = x.to(torch.uint8) if x.dtype == torch.bool else x
        nan = torch.zeros((), dtype=F64, device=x.device)
        count = (x == x).sum(dtype=counts).to(F64)
        y = x.to(F64) - k
        lo = v.amin().to(F64)
        hi = v.amax().to(F64)
    zeros = (x == 0).sum(dtype=counts).to(F64)
    return torch.stack([zeros, nan, count, y.sum(), (y * y).sum(), k.reshape(()), lo, hi])


def batched_stats_body(x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Each row's basic statistics of a ``(rows, n)`` float tensor (``n > SHIFT_SAMPLE``), in one read.

    Row ``i`` of the ``(rows, 8)`` result is :func:`basic_stats_body` of
    ``x[i]`` with ``rnd[i]`` as its random positions: the same shift K (the
    rank median of the row's finite sampled values) and the same slots.
    Float32, float16 and bfloat16 only: their float64 upcast minus K cannot
    overflow, so every non-finite value of ``x - K`` is x's own.
    """
    if not torch.compiler.is_compiling():
        UNCOMPILED.flag = True
    pos = torch.arange(SHIFT_SAMPLE, device=x.device) * (x.shape[1] // SHIFT_SAMPLE)
    s = torch.cat([x[:, pos], x.gather(1, rnd)], dim=1)
    ok = torch.abs(s) < math.inf
    cnt = ok.sum(1, keepdim=True)
    v = torch.where(ok, s, math.inf)
    mid = (cnt - 1).clamp_min(0) // 2
    below = (v.unsqueeze(1) < v.unsqueeze(2)).sum(2)
    at_or_below = (v.unsqueeze(1) <= v.unsqueeze(2)).sum(2)
    median = torch.where((below <= mid) & (at_or_below > mid), v, -math.inf).amax(1, keepdim=True)
    k = torch.where(cnt > 0, median, 0.0).to(F64) * on
    fin = torch.abs(x) < math.inf
    y = torch.where(fin, x.to(F64) - k, 0.0)
    lo = torch.where(fin, x, math.inf).amin(1).to(F64)
    hi = torch.where(fin, x, -math.inf).amax(1).to(F64)
    return torch.stack([(x == 0).sum(1, dtype=F64), (x != x).sum(1, dtype=F64), fin.sum(1, dtype=F64),
                        y.sum(1), (y * y).sum(1), k[:, 0], lo, hi], dim=1)
