"""``layertap::tap_stats`` in aten ops: the fallback where no faster kernel serves, and the rule all share.

Why a third implementation: a CPU without a C compiler, and a CUDA device
without Triton, still get the op with the same results (the same shift K, the
same merge), only slower. It runs a fixed sequence of at most
:data:`MAX_ATEN_OPS` aten ops, whatever the tensor, and never syncs with the
host: masked-out and non-finite elements are neutralised with ``where``,
never dropped by boolean indexing.
"""

from __future__ import annotations

import math

import torch

__all__ = ["IDENTITY", "MAX_ATEN_OPS", "MAX_DIMS", "SAMPLE", "keep_mask", "reference_stats", "sample_positions"]

#: Positions the shift K is drawn from: evenly spaced in logical order.
SAMPLE = 32
#: What a row holds before any merge: no element seen (min > max marks "no finite element").
IDENTITY = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf)
#: Dims the CPU kernel reads (``tap_stats.c``'s MAX_DIMS); a tensor with more takes the plan path.
MAX_DIMS = 16
#: The bound on the aten ops :func:`reference_stats` dispatches (a test counts them).
MAX_ATEN_OPS = 90


def sample_positions(numel: int) -> list[int]:
    """The logical flat indices K is the median of: ``min(SAMPLE, numel)`` evenly spaced ones."""
    m = min(SAMPLE, numel)
    step = numel // m if m else 1
    return [j * step for j in range(m)]


def keep_mask(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask`` (over x's leading dims) broadcast to x's shape, or None."""
    if mask is None:
        return None
    return mask.to(torch.bool).reshape(*mask.shape, *([1] * (x.dim() - mask.dim()))).expand(x.shape)


def reference_stats(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
                    mask: torch.Tensor | None) -> None:
    """Merges x's basic statistics into ``out[row]`` when ``flag`` is non-zero (2: the counts only), in aten ops."""
    with torch.no_grad():
        keep = keep_mask(x, mask)
        n = x.numel()
        xd = x.to(torch.float64)
        pos = torch.tensor(sample_positions(n), dtype=torch.int64, device=x.device)
        s = xd.reshape(-1).index_select(0, pos)  # reshape copies only a non-viewable x
        ok = torch.isfinite(s)
        if keep is not None:
            ok = ok & keep.reshape(-1).index_select(0, pos)
        cnt = ok.sum()
        srt = torch.where(ok, s, math.inf).sort().values
        mid = ((cnt - 1).clamp_min(0) // 2).reshape(1)
        k = torch.where(cnt > 0, srt.index_select(0, mid).reshape(()) if n else srt.new_zeros(()), 0.0)
        fin = torch.isfinite(xd)
        nan = torch.isnan(xd)
        zero = xd == 0
        if keep is not None:
            fin, nan, zero = fin & keep, nan & keep, zero & keep
        y = torch.where(fin, xd - k, 0.0)
        stats = torch.stack([zero.sum(dtype=torch.float64), nan.sum(dtype=torch.float64),
                             fin.sum(dtype=torch.float64), y.sum(), (y * y).sum(), k,
                             torch.where(fin, xd, math.inf).amin() if n else xd.new_full((), math.inf),
                             torch.where(fin, xd, -math.inf).amax() if n else xd.new_full((), -math.inf)])
        mode = flag.reshape(())
        old = out.index_select(0, row.reshape(1)).reshape(-1)
        merged = torch.cat([old[:5] + stats[:5], stats[5:6], torch.minimum(old[6:7], stats[6:7]),
                            torch.maximum(old[7:8], stats[7:8])])
        counts = torch.cat([old[:3] + stats[:3], old[3:]])  # flag 2: zeros, NaN and the finite count only
        merged = torch.where(mode == 2, counts, merged)
        out.index_copy_(0, row.reshape(1), torch.where(mode != 0, merged, old).reshape(1, -1))
