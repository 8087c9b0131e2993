"""``layertap::tap_stats``: the one op a firing calls, registered with torch.library.

Schema: ``tap_stats(Tensor x, Tensor(a!) out, Tensor row, Tensor flag, Tensor? mask=None) -> ()``.
It merges the basic statistics of ``x`` into ``out[row]`` when ``flag`` is
non-zero, and does nothing otherwise (the same launch either way).

Why the low-level ``torch.library.Library`` and not ``custom_op``: a
``custom_op`` call costs 7-11 us of Python on every firing; a kernel
registered per dispatch key in C++ is reached from ``torch.ops`` in about
1.3 us.
The fake kernel makes the op one node under ``torch.compile(fullgraph=True)``
(it mutates ``out`` and returns nothing), so a compiled model carries it in
its graph and, on CUDA, in its CUDA graphs.

Implementations, per device: CPU, ``tap_stats.c`` in a C++ kernel (``op.cpu``);
CUDA, one Triton launch (``op.triton_kernel``); either falls back to the aten
body (``op.reference``) where its kernel cannot serve, with the same numbers.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Final

import torch

from layertap.server.reducers.op import cpu
from layertap.server.reducers.op.reference import reference_stats

__all__ = ["FLOAT_DTYPES", "ROW_WIDTH", "check_args", "tap_stats_op", "triton_available"]

#: Slots per row: ``reducers.kernels``' basic layout.
ROW_WIDTH = 8
#: The dtypes the op reads; integer, bool and fp8 tensors keep the reducer plans' path.
FLOAT_DTYPES: Final = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})

_LIB = torch.library.Library("layertap", "DEF")  # type: ignore[no-untyped-call]  # the op's one registration
_LIB.define(  # type: ignore[no-untyped-call]
    "tap_stats(Tensor x, Tensor(a!) out, Tensor row, Tensor flag, Tensor? mask=None) -> ()")


def check_args(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
               mask: torch.Tensor | None) -> None:
    """Raises ValueError (naming the argument) for anything the kernels would misread."""
    if x.dtype not in FLOAT_DTYPES or x.layout != torch.strided:
        raise ValueError(f"tap_stats: x must be a strided float tensor ({', '.join(map(str, FLOAT_DTYPES))}), "
                         f"got {x.dtype} ({x.layout})")
    if out.dtype != torch.float64 or out.dim() != 2 or out.shape[1] != ROW_WIDTH or not out.is_contiguous():
        raise ValueError(f"tap_stats: out must be a contiguous (rows, {ROW_WIDTH}) float64 tensor, "
                         f"got {out.dtype} {list(out.shape)}")
    if row.dtype != torch.int64 or row.numel() != 1:
        raise ValueError(f"tap_stats: row must be one int64 element, got {row.dtype} {list(row.shape)}")
    if flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError(f"tap_stats: flag must be one int32 element, got {flag.dtype} {list(flag.shape)}")
    device = x.device
    if mask is not None:
        if mask.dtype not in (torch.bool, torch.uint8) or not mask.is_contiguous() \
                or tuple(mask.shape) != tuple(x.shape[:mask.dim()]):
            raise ValueError(f"tap_stats: mask must be a contiguous bool or uint8 tensor of x's leading dims "
                             f"{list(x.shape[:mask.dim()])}, got {mask.dtype} {list(mask.shape)}")
        if mask.device != device:
            raise ValueError(f"tap_stats: every tensor must be on one device, got x on {device}, "
                             f"mask on {mask.device}")
    if not device == out.device == row.device == flag.device:
        raise ValueError(f"tap_stats: every tensor must be on one device, got x on {device}, out on {out.device}, "
                         f"row on {row.device}, flag on {flag.device}")


def _mask_inner(x: torch.Tensor, mask: torch.Tensor | None) -> int:
    return x.numel() // mask.numel() if mask is not None and mask.numel() else 1


def _cpu_fallback(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
                  mask: torch.Tensor | None = None) -> None:
    """The CPU kernel where the C++ one could not be built: the aten body."""
    check_args(x, out, row, flag, mask)
    reference_stats(x, out, row, flag, mask)


@functools.cache
def _triton_kernel() -> ModuleType | None:
    """The Triton kernel's module, imported once; None without Triton."""
    try:
        import triton  # type: ignore[import-untyped]  # noqa: F401, PLC0415 - optional: a CUDA torch brings it, a CPU server never needs it
    except ImportError:
        return None
    from layertap.server.reducers.op import triton_kernel  # noqa: PLC0415 - imports Triton (optional)

    return triton_kernel


def triton_available() -> bool:
    """Whether Triton imports (the CUDA kernel's, and ``TRITON_INTERPRET``'s, precondition)."""
    return _triton_kernel() is not None


def _cuda_impl(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
               mask: torch.Tensor | None = None) -> None:
    check_args(x, out, row, flag, mask)
    kernel = _triton_kernel()
    if kernel is not None and kernel.launch(x, out, row, flag, mask, _mask_inner(x, mask)):
        return
    reference_stats(x, out, row, flag, mask)


def _fake(x: torch.Tensor, out: torch.Tensor, row: torch.Tensor, flag: torch.Tensor,
          mask: torch.Tensor | None = None) -> None:
    """Checks the arguments as the kernels do; nothing to build: the op only writes ``out``."""
    check_args(x, out, row, flag, mask)


if not cpu.load():  # the C++ kernel registers itself for CPU when it loads
    _LIB.impl("tap_stats", _cpu_fallback, "CPU")  # type: ignore[no-untyped-call]
_LIB.impl("tap_stats", _cuda_impl, "CUDA")  # type: ignore[no-untyped-call]
torch.library.register_fake("layertap::tap_stats", _fake, lib=_LIB)

#: The op's overload, what a firing calls (``torch.ops.layertap.tap_stats.default``).
tap_stats_op = torch.ops.layertap.tap_stats.default
