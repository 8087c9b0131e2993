"""Sorting a bounded sample: numpy's vectorized sort on CPU, torch's on CUDA.

Why: torch's CPU sort of a float tensor is a comparison sort with a NaN-aware
comparator, ~50-60 ns per element (0.9 ms for the default 16,384-element
sample on the 2-vCPU VM, per tapped tensor); its radix path needs integer
keys padded to 32,768 (0.10-0.14 ms). numpy >= 1.25 sorts with x86-simd-sort
(AVX-512/AVX2 sorting networks): 25 us for the same 16,384 float32 values.
A CPU tensor's ``.numpy()`` is a view of the same memory, so nothing is copied
and nothing waits on a device; the sort runs without the GIL. On CUDA the sort
stays torch's (a radix sort for every dtype), so no value reaches the host.
No op here reads a value: the device, dtype and tensor type pick the path.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["sort_ascending"]

#: dtypes numpy cannot hold (bfloat16) or sorts without SIMD, mapped to an
#: exact wider dtype; every value converts exactly.
_WIDEN = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.int32,
          torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}


def sort_ascending(s: torch.Tensor) -> torch.Tensor:
    """``torch.sort(s.to(float64)).values``, through numpy on CPU.

    Args:
        s: A 1-D sample of any supported real, integer or bool dtype, without
            NaN (callers map NaN to +inf and count it first).

    Returns:
        The sorted values as float64, exactly those of ``s`` (-0.0 and +0.0,
        equal as floats, may come in either order).
    """
    if s.device.type != "cpu" or type(s) is not torch.Tensor or torch._is_functional_tensor(s):
        # CUDA's radix sort. Subclasses have no numpy view, and a functionalized
        # tensor's numpy() reads its wrapper's storage, not its values.
        return _torch_sort(s)
    wide = _WIDEN.get(s.dtype)
    host = s.detach().resolve_neg()  # numpy refuses a negative-bit view (a no-op without one)
    if wide is not None:
        host = host.to(wide)
    try:
        values = host.numpy()
    except RuntimeError:  # torch.func.grad/vmap wrap tensors without storage numpy can view
        return _torch_sort(s)
    return torch.from_numpy(np.sort(values).astype(np.float64, copy=False))


def _torch_sort(s: torch.Tensor) -> torch.Tensor:
    return torch.sort(s.to(torch.float64)).values
