"""The op's CUDA kernel: one Triton launch per firing, one atomic merge per program.

Why this shape (torchtitan's tensor logging, Transformer Engine's amax): the
statistics are cheap to compute and expensive to launch, so the whole row is
one kernel. It reads the tap's device flag first and returns at once when it
is 0, so a sampled-out pass launches the same kernel as any other (what a
CUDA graph needs). Each program keeps register accumulators over its chunk in
logical order, through the strides (no copy: a channels-last, transposed,
sliced or expanded view is read where it lies), and merges them into the row
with one atomic per statistic: never the same address from every block of a
tensor, at most :data:`MAX_PROGRAMS` merges per firing.

Importing this module needs Triton; ``op.registry`` imports it only then.
Tests run it on CPU tensors under ``TRITON_INTERPRET=1`` (read when the
kernel is decorated, so in a subprocess).
"""

# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernels take untyped pointer and scalar arguments; triton ships no type information.)
from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

__all__ = ["MAX_DIMS", "MAX_PROGRAMS", "launch"]

#: Dims the kernel indexes; a tensor with more (after dropping size-1 dims) takes the aten path.
MAX_DIMS = 4
#: Programs per launch at most: each merges its partial row with one atomic per statistic.
MAX_PROGRAMS = 1024
_BLOCK = 1024
_SAMPLE = 32  # reference.SAMPLE


@triton.jit
def _offsets(i, s1, s2, s3, t0, t1, t2, t3):
    """Storage offsets of logical flat indices ``i`` of a (≤4)-d tensor (sizes s0..s3, strides t0..t3)."""
    i3 = i % s3
    r = i // s3
    i2 = r % s2
    r = r // s2
    i1 = r % s1
    i0 = r // s1
    return i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3


@triton.jit
def _tap_stats(x_ptr, row_out_ptr, row_ptr, flag_ptr, mask_ptr, numel, mask_inner, chunk,
               s1, s2, s3, t0, t1, t2, t3,
               HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, SAMPLE: tl.constexpr):
    mode = tl.load(flag_ptr)
    if mode == 0:
        return
    out = row_out_ptr + tl.load(row_ptr).to(tl.int64) * 8
    # The shift K, as every implementation picks it: the lower median of the finite (unmasked)
    # values among min(SAMPLE, numel) evenly spaced positions. Each program computes it alike.
    j = tl.arange(0, SAMPLE).to(tl.int64)
    m = tl.minimum(numel, SAMPLE)
    step = tl.where(m > 0, numel // tl.maximum(m, 1), 1)
    taken = j < m
    pos = j * step
    v = tl.load(x_ptr + _offsets(pos, s1, s2, s3, t0, t1, t2, t3), mask=taken, other=0.0).to(tl.float64)
    ok = taken & (tl.abs(v) < float("inf"))
    if HAS_MASK:
        ok = ok & (tl.load(mask_ptr + pos // mask_inner, mask=taken, other=0) != 0)
    cnt = tl.sum(ok.to(tl.int32), 0)
    srt = tl.sort(tl.where(ok, v, float("inf")))
    mid = tl.maximum(cnt - 1, 0) // 2
    k = tl.sum(tl.where((j == mid) & (cnt > 0), srt, 0.0), 0)

    pid = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    zeros = tl.zeros([BLOCK], dtype=tl.float64)
    nan = tl.zeros([BLOCK], dtype=tl.float64)
    count = tl.zeros([BLOCK], dtype=tl.float64)
    acc1 = tl.zeros([BLOCK], dtype=tl.float64)
    acc2 = tl.zeros([BLOCK], dtype=tl.float64)
    lo = tl.full([BLOCK], float("inf"), dtype=tl.float64)
    hi = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
    begin = pid * chunk
    end = tl.minimum(begin + chunk, numel)
    for start in range(begin, end, BLOCK):
        i = start + lanes
        inside = i < end
        if HAS_MASK:
            inside = inside & (tl.load(mask_ptr + i // mask_inner, mask=inside, other=0) != 0)
        x = tl.load(x_ptr + _offsets(i, s1, s2, s3, t0, t1, t2, t3), mask=inside, other=1.0).to(tl.float64)
        fin = inside & (tl.abs(x) < float("inf"))
        zeros += (inside & (x == 0.0)).to(tl.float64)
        nan += (inside & (x != x)).to(tl.float64)
        count += fin.to(tl.float64)
        y = tl.where(fin, x - k, 0.0)
        acc1 += y
        acc2 += y * y
        lo = tl.minimum(lo, tl.where(fin, x, float("inf")))
        hi = tl.maximum(hi, tl.where(fin, x, float("-inf")))
    tl.atomic_add(out + 0, tl.sum(zeros, 0))
    tl.atomic_add(out + 1, tl.sum(nan, 0))
    tl.atomic_add(out + 2, tl.sum(count, 0))
    if mode != 2:  # 2: the counts only (nonfinite on an unsampled pass), as the CPU kernel
        tl.atomic_add(out + 3, tl.sum(acc1, 0))
        tl.atomic_add(out + 4, tl.sum(acc2, 0))
        tl.atomic_min(out + 6, tl.min(lo, 0))
        tl.atomic_max(out + 7, tl.max(hi, 0))
        if pid == 0:
            tl.store(out + 5, k)


def launch(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
           mask: torch.Tensor | None, mask_inner: int) -> bool:
    """One launch of the kernel for ``x``; False (nothing launched) when x has too many dims."""
    shape, strides = list(x.shape), list(x.stride())
    if len(shape) > MAX_DIMS:  # size-1 dims index nothing
        kept = [(s, t) for s, t in zip(shape, strides) if s != 1]
        if len(kept) > MAX_DIMS:
            return False
        shape, strides = [s for s, _ in kept], [t for _, t in kept]
    pad = MAX_DIMS - len(shape)
    shape, strides = [1] * pad + shape, [0] * pad + strides
    numel = x.numel()
    if numel == 0:  # nothing is read; sizes of 1 keep the index math free of a division by zero
        shape = [1] * MAX_DIMS
    programs = max(1, min(MAX_PROGRAMS, triton.cdiv(numel, _BLOCK)))
    chunk = triton.cdiv(triton.cdiv(max(numel, 1), programs), _BLOCK) * _BLOCK
    _tap_stats[(programs,)](x, out, row, flag, x if mask is None else mask, numel, max(mask_inner, 1), chunk,
                            shape[1], shape[2], shape[3], *strides,
                            HAS_MASK=mask is not None, BLOCK=_BLOCK, SAMPLE=_SAMPLE)
    return True
