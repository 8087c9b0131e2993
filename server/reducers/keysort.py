"""Sorting a bounded sample through order-preserving integer keys (CPU).

Why: torch's CPU sort of a float tensor is a comparison sort with a NaN-aware
comparator, ~50-60 ns per element: 0.9-1.0 ms for the default 16,384-element
sample on the 2-vCPU VM, per tapped tensor. A 1-D integer tensor of at least
``_RADIX_MIN`` elements (ATen's ``GRAIN_SIZE``) takes fbgemm's radix sort
instead: 0.14-0.16 ms for 32,768 int32 keys on one thread, ~0.1 ms on two. An
IEEE float maps exactly and reversibly to an integer of its width whose order
is the float order (flip the magnitude bits of negative values), so such
samples are sorted as keys, padded with the largest key up to ``_RADIX_MIN``,
and mapped back. Small samples, and CUDA (whose sort is a radix sort for every
dtype), sort the float64 values as before. No op here reads a value on the
host: shapes, dtypes and the device alone pick the path.

The radix sort runs on torch's OpenMP intra-op threads; on an oversubscribed
host (more busy threads than cores) their barrier can cost more than it saves,
as for any multi-threaded op of the model itself.
"""

from __future__ import annotations

import torch

__all__ = ["sort_ascending", "uses_keys"]

#: torch's CPU sort takes the radix sort for 1-D integer tensors of at least
#: this many elements (``at::internal::GRAIN_SIZE``, with OpenMP and fbgemm).
_RADIX_MIN = 32768
#: Up to this many elements the comparison sort (~50 ns per element on the
#: 2-vCPU VM, fresh data) beats padding keys to ``_RADIX_MIN`` (~0.14 ms on
#: one thread); they break even near 2,800.
_DIRECT_MAX = 2048
#: Whether this torch build has the radix sort at all (else padding only costs).
_HAS_RADIX = torch.backends.openmp.is_available() and "fbgemm" in torch.backends.quantized.supported_engines

#: float dtype -> (the float dtype its keys are made from, the key dtype).
_FLOAT_KEYS = {
    torch.float16: (torch.float32, torch.int32),
    torch.bfloat16: (torch.float32, torch.int32),
    torch.float32: (torch.float32, torch.int32),
    torch.float64: (torch.float64, torch.int64),
}


def _flip_negatives(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Maps IEEE bit patterns to order-preserving keys, and keys back (an involution).

    Non-negative floats already order as their bits; for negative ones (sign
    bit set, so negative as signed ints) flipping the other bits reverses
    their order below every non-negative key. -0.0 lands just below +0.0.
    """
    width = bits.element_size() * 8
    magnitude = (bits >> (width - 1)).bitwise_and_((1 << (width - 1)) - 1)
    return torch.bitwise_xor(bits, magnitude, out=out) if out is not None else bits ^ magnitude


def uses_keys(n: int, device: torch.device) -> bool:
    """Whether integer keys beat sorting the float64 values directly.

    Only on CPU, and only above ``_DIRECT_MAX`` elements, where the radix
    sort of the padded keys is cheaper than comparing floats. On CUDA every
    sort is a radix sort already.
    """
    return device.type == "cpu" and _HAS_RADIX and n > _DIRECT_MAX


def sort_ascending(s: torch.Tensor) -> torch.Tensor:
    """``torch.sort(s.to(float64)).values``, on integer keys where that is cheaper.

    Args:
        s: A 1-D sample of any supported real, integer or bool dtype, without
            NaN (callers map NaN to +inf and count it first: the keys of NaN
            would sort by their sign bit).

    Returns:
        The sorted values as float64, exactly those of ``s``.
    """
    n = s.numel()
    if not uses_keys(n, s.device):
        return torch.sort(s.to(torch.float64)).values
    fdtype, kdtype = _FLOAT_KEYS.get(s.dtype, (None, torch.int64 if s.dtype == torch.int64 else torch.int32))
    pad = max(0, _RADIX_MIN - n)
    if pad:
        # The largest key fills the tail and sorts after every real key
        # (+inf's key is below it), so the first n sorted keys are s's.
        keys = s.new_full((n + pad,), torch.iinfo(kdtype).max, dtype=kdtype)
        if fdtype is not None:
            _flip_negatives(s.to(fdtype).view(kdtype), out=keys[:n])
        else:
            keys[:n].copy_(s)  # integers and bool are their own keys
        ordered = torch.sort(keys).values[:n]
    else:
        keys = _flip_negatives(s.to(fdtype).view(kdtype)) if fdtype is not None else s.to(kdtype)
        ordered = torch.sort(keys).values
    if fdtype is None:
        return ordered.to(torch.float64)
    return _flip_negatives(ordered).view(fdtype).to(torch.float64)
