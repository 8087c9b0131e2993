"""Per-tensor state shared by the reducers of one plan, and the device helpers under it.

A :class:`Workspace` caches what several reducers would otherwise each compute
from the same tensor: the float64 upcast, the finite mask and the bounded
samples (plus their sort). Reading the tensor once is what keeps a plan of
many reducers cheap. Nothing here syncs with the host: only shapes, strides
and dtypes (host metadata) steer control flow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch

from layertap.server.reducers.samplesort import sort_ascending

__all__ = ["F64", "DeviceCache", "Workspace", "device_constant", "flat_view", "gather_flat"]

F64 = torch.float64

#: Float dtypes whose sums of 0/1 indicators are exact in their own dtype up to
#: this many elements (every partial sum is an integer <= numel). Narrower
#: dtypes, and larger tensors, sum their indicators in float64.
_EXACT_COUNT_LIMIT = {torch.float32: 1 << 24, torch.float64: 1 << 53}

#: Per-device constants: the device tensor and the pinned host source its
#: asynchronous copy reads (None when no copy was needed).
DeviceCache: TypeAlias = dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]]


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


def flat_view(x: torch.Tensor) -> torch.Tensor | None:
    """All elements as a 1-D view in memory order, or None when not dense.

    Order is irrelevant to every consumer (uniform samples), so channels_last
    and other permuted layouts need no copy.
    """
    if x.is_contiguous():
        return x.view(-1)
    if _is_dense(x):
        return x.as_strided((x.numel(),), (1,), x.storage_offset())
    return None


def gather_flat(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x.reshape(-1)[idx]`` without copying x when it is not contiguous."""
    flat = flat_view(x)
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


def device_constant(cache: DeviceCache, values: Sequence[float], device: torch.device,
                    dtype: torch.dtype = F64) -> torch.Tensor:
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


class Workspace:
    """Per-tensor cache so reducers of one plan share the upcast, mask and samples.

    Args:
        x: The tensor being reduced (detached).
        generator: The plan's private generator for ``x.device``; sampling
            never touches the global RNG.
        share_xd: Some reducer besides the basic statistics reads :attr:`xd`
            (so the basic statistics must not shift or clean it in place).
    """

    def __init__(self, x: torch.Tensor, generator: torch.Generator,
                 share_xd: bool = False) -> None:
        self.x = x
        self.numel = x.numel()
        self.floating = x.is_floating_point()
        self.generator = generator
        self.share_xd = share_xd
        self._flat: torch.Tensor | None | Literal[False] = False
        self._xd: torch.Tensor | None = None
        self._fin: torch.Tensor | None = None
        # Per sample size: (sorted sample, its non-NaN count).
        self._sorted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: The basic-statistics vector, set by the plan before any reducer runs.
        self.basic: torch.Tensor | None = None

    @property
    def flat(self) -> torch.Tensor | None:
        """:func:`flat_view` of x (all elements as 1-D, memory order), cached."""
        if self._flat is False:
            self._flat = flat_view(self.x)
        return self._flat

    @property
    def has_xd(self) -> bool:
        """Whether :attr:`xd` was already made (by another reducer)."""
        return self._xd is not None

    @property
    def xd(self) -> torch.Tensor:
        """The tensor in float64, converted once (no copy when already float64)."""
        if self._xd is None:
            self._xd = self.x if self.x.dtype == F64 else self.x.to(F64)
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
        return None if self.numel <= _EXACT_COUNT_LIMIT.get(self.x.dtype, 0) else F64

    def sorted_sample(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sorted float64 sample with NaN mapped to +inf, and its count of non-NaN values (0-d float64).

        The whole tensor when it has at most ``size`` elements, else exactly
        ``size`` elements drawn uniformly with replacement (i.i.d., which is
        what the DKW bound assumes). NaN becomes +inf so the sample is totally
        ordered for ``searchsorted``; NaNs then sit past every real value, and
        callers count only the first ``n``. Drawn and sorted (in x's own width,
        :mod:`.samplesort`) once per size: histograms and quantiles share it.
        """
        hit = self._sorted.get(size)
        if hit is not None:
            return hit
        if self.numel <= size:
            s = self.x.reshape(-1)  # copies at most `size` elements
        else:
            idx = torch.randint(
                0, self.numel, (size,), generator=self.generator, device=self.x.device
            )
            s = gather_flat(self.x, idx)
        if self.floating:
            # NaN counted as 0/1 floats, then mapped by nan_to_num: ~3x cheaper
            # on CPU than isnan's bool mask plus masked_fill (see .kernels).
            n = s.numel() - torch.ne(s, s, out=torch.empty_like(s)).sum(dtype=F64)
            s = torch.nan_to_num(s, math.inf, math.inf, -math.inf)
        else:
            n = s.new_full((), s.numel(), dtype=F64)
        hit = self._sorted[size] = (sort_ascending(s), n)
        return hit
