"""The source of the compiled basic-statistics kernel, and what decides which compile applies.

Why a torch function and not a hand-written kernel: inductor turns this one
source into vectorized C++ on CPU and Triton on CUDA, fusing all eight
reductions into one read of the tensor.

Tensors reach the kernel in two canonical forms, so one compile per dtype
serves every shape: ``dense`` (all elements as 1-D, any permuted layout such
as channels_last) and ``rows`` (R runs of C contiguous elements spaced wider
than C: slices and chunks along the last dim). They are passed as fresh
non-view aliases (``set_`` on the same storage, no copy): dynamo also guards
a view's base tensor, whose shape would then decide recompiles. The shift
switch ``on`` goes in as a 1-element tensor: for a 0-d CPU float tensor
dynamo adds a guard that reads its value with ``.item()``.
"""

from __future__ import annotations

import math
import types
from typing import NamedTuple, cast

import torch

from layertap.server.compile.variant import COUNT32_LIMIT
from layertap.server.reducers.stats_body import SHIFT_SAMPLE, basic_stats_body, batched_stats_body, evenly_spaced, stats_of
from layertap.server.reducers.workspace import F64

__all__ = [
    "BATCH", "DENSE", "ROWS", "SHIFT_SAMPLE", "Canonical", "Signature", "alias", "body_of", "canonical_form",
    "graph_stats", "kernel_function", "signature_of",
]

DENSE, ROWS = "dense", "rows"
#: A pass's small tensors stacked ``(rows, n)``, reduced row by row (:mod:`.batched`).
BATCH = "batch"

#: ``(form, size, stride)`` of the alias the kernel reads.
Canonical = tuple[str, tuple[int, ...], tuple[int, ...]]


def graph_stats(x: torch.Tensor) -> torch.Tensor:
    """:func:`stats_of` for an activation inside a compiled model, K the mean of the finite values
    among ``SHIFT_SAMPLE`` evenly spaced elements.

    K only keeps the shifted sums well conditioned: any value near the data does, and the slots
    say which K was used. The eager path's K, a rank median of a random sample, costs inductor
    several serial regions and barriers per tensor; summed over a model's tapped tensors that was
    a third of the statistics' cost in the graph."""
    if x.dim() == 0:
        x = x.reshape(1)
    s = evenly_spaced(x).to(F64)
    if x.is_floating_point():
        ok = torch.abs(s) < math.inf
        k = (torch.where(ok, s, 0.0) / ok.sum().clamp_min(1)).sum()  # divided first: no overflow near max
    else:
        k = s.mean()
    return stats_of(x, k.reshape(1), counts=_count_dtype(x.numel()))


def _count_dtype(n: int | torch.SymInt) -> torch.dtype:
    """int32 lanes for the counts when every count fits: a mask adds to them in two instructions,
    where float64 lanes take a conversion into two vectors and two adds (a quarter of the
    statistics' cost in the graph).

    A symbolic size gets int32 only while exporting: the server's guards on a package
    (``compile.package.Package.flat``) refuse an input whose tapped tensor would reach
    ``COUNT32_LIMIT`` elements. A compile in this process (dynamo) has no such guard: int64.
    """
    if isinstance(n, int):
        return torch.int32 if n < COUNT32_LIMIT else torch.int64
    return torch.int32 if torch.compiler.is_exporting() else torch.int64


def body_of(form: str) -> types.FunctionType:
    """The kernel body a form compiles: :func:`batched_stats_body` for BATCH, else :func:`basic_stats_body`."""
    return cast(types.FunctionType, batched_stats_body if form == BATCH else basic_stats_body)


class Signature(NamedTuple):
    """What decides whether a compiled kernel applies: one compile each.

    Beyond the tensor's device, dtype and form, dynamo's guards check the
    thread's grad mode and autocast state (its global-state guard) and the
    tensors' dispatch keys, which differ for inference tensors.
    """

    device: torch.device
    dtype: torch.dtype
    form: str  # DENSE, ROWS or BATCH
    grad: bool  # torch.is_grad_enabled()
    inference: bool  # torch.is_inference_mode_enabled()
    autocast: torch.dtype | None  # the autocast dtype when enabled for the device type

    def describe(self) -> str:
        mode = "inference" if self.inference else ("grad" if self.grad else "no_grad")
        cast = f" autocast={self.autocast}" if self.autocast is not None else ""
        return f"{self.device} {self.dtype} {self.form} {mode}{cast}"


def canonical_form(x: torch.Tensor) -> Canonical | None:
    """The form, size and stride the kernel reads x as, or None (eager only).

    Host metadata only. Dense layouts become 1-D; otherwise size-1 dims are
    dropped, dims sorted by stride and mergeable neighbours merged, and the
    result is ``rows`` when two dims remain, the inner one unit-strided, in
    x's own dim order. Tiny tensors, overlapping (expanded) and other strided
    layouts return None.
    """
    n = x.numel()
    if n <= SHIFT_SAMPLE:  # shift_of samples everything: a separate graph, for tiny tensors
        return None
    if x.is_contiguous():
        return DENSE, (n,), (1,)
    logical = [(st, sz) for sz, st in zip(x.shape, x.stride()) if sz != 1]
    dims = sorted(logical, reverse=True)
    merged: list[tuple[int, int]] = []
    for st, sz in dims:
        if merged and merged[-1][0] == st * sz:
            merged[-1] = (st, merged[-1][1] * sz)
        else:
            merged.append((st, sz))
    if len(merged) == 1 and merged[0][0] == 1:
        return DENSE, (n,), (1,)
    # rows also needs logical order = memory order: shift_of samples by logical index.
    if len(merged) == 2 and merged[1][0] == 1 and merged[0][0] > merged[1][1] and dims == logical:
        (row_stride, rows), (_, cols) = merged
        return ROWS, (rows, cols), (row_stride, 1)
    return None


def signature_of(x: torch.Tensor, canon: Canonical | None = None, *, grad: bool | None = None,
                 inference: bool | None = None, autocast: torch.dtype | None | bool = True) -> Signature | None:
    """The signature ``x`` would run under, or None when it never runs compiled.

    The modes default to the calling thread's; pass them to describe a pass
    on another thread (taps are created on a gRPC thread, server passes run
    in inference mode: ``inference=True`` implies ``grad=False``).
    ``autocast=True`` reads the current autocast state.
    """
    if type(x) is not torch.Tensor or x.layout != torch.strided or x.is_quantized:
        return None
    if canon is None:
        canon = canonical_form(x)
        if canon is None:
            return None
    dev = x.device
    if inference is None:
        inference = torch.is_inference_mode_enabled()
    if grad is None:  # inference mode implies no grad
        grad = torch.is_grad_enabled() and not inference
    if autocast is True:
        cast = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
    else:
        cast = autocast or None
    return Signature(dev, x.dtype, canon[0], grad, inference, cast)


def alias(x: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """A non-view tensor over x's storage (no copy), so dynamo guards x alone."""
    return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), size, stride)


def kernel_function(sig: Signature) -> types.FunctionType:
    """A fresh function (own code object) running :func:`basic_stats_body`.

    Dynamo keeps compiled entries per code object, so each signature gets its
    own: a call checks one guard set, no signature counts against another's
    recompile limit, and a failed compile cannot touch the others.
    """
    name = f"basic_stats_{sig.device.type}_{str(sig.dtype).removeprefix('torch.')}_{sig.form}"
    body = body_of(sig.form)
    code = body.__code__.replace(co_name=name)
    return types.FunctionType(code, body.__globals__, name)
