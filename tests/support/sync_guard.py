"""Proves, on CPU, that code never forces a device-to-host sync.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` catches syncs. CPU-only
tests need another referee: :class:`NoSyncMode` is a ``TorchDispatchMode`` that
raises :class:`SyncError` on every aten op that would sync on CUDA (reading a
value on the host, or producing a data-dependent shape)::

    with NoSyncMode():
        plan.run(x)   # raises SyncError on .item(), histc, nonzero, x[mask], ...

It sees what goes through the dispatcher. ``Tensor.tolist()`` and
``Tensor.numpy()`` on a CPU tensor read memory directly and slip past it (on
CUDA they copy to the host first, which it does catch).

Optionally it also rejects "sample-only" ops (sort, top-k, quantile,
scatter_add...) on inputs above ``sample_op_limit`` elements, which catches a
reducer that sorts or scatters over a whole activation (docs/design.md: full-tensor
``scatter_add_`` is 39x, ``torch.quantile`` fails above 2**24 elements).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NoSyncMode", "SyncError", "assert_no_sync"]

_aten = torch.ops.aten


class SyncError(RuntimeError):
    """An op that would force a host sync ran under :class:`NoSyncMode`."""


# Op packets that read a device value on the host or have an output shape that
# depends on tensor values (so the host must wait for the device).
_SYNCING: dict[Any, str] = {
    _aten._local_scalar_dense: "reads a value on the host (.item(), float(t), bool(t), if t:)",
    _aten.item: "reads a value on the host",
    _aten.is_nonzero: "reads a value on the host (bool(t))",
    _aten.equal: "returns a host bool (torch.equal)",
    _aten.histc: "torch.histc syncs (and rejects fp16); sort a sample and searchsorted frozen edges",
    _aten.nonzero: "output shape depends on values (nonzero/argwhere/torch.where(cond))",
    _aten.bincount: "output shape depends on values",
    _aten.masked_select: "output shape depends on values (x[mask])",
    _aten._unique: "output shape depends on values",
    _aten._unique2: "output shape depends on values",
    _aten.unique_dim: "output shape depends on values",
    _aten.unique_consecutive: "output shape depends on values",
    _aten.nanmedian: "the CUDA kernel has read a count on the host in some torch versions; sort a sample",
    _aten.median: "the no-dim CUDA kernel shares nanmedian's code; sort a sample",
}

# Ops that are fine on a bounded sample and slow or broken on a whole tensor.
_SAMPLE_ONLY = frozenset(
    {
        _aten.sort, _aten.argsort, _aten.topk, _aten.kthvalue, _aten.median,
        _aten.nanmedian, _aten.quantile, _aten.nanquantile, _aten.scatter_add,
        _aten.scatter_add_, _aten.index_add, _aten.index_add_, _aten.scatter_reduce,
        _aten.scatter_reduce_, _aten.bucketize,
    }
)  # fmt: skip


def _has_bool_index(indices: Sequence[torch.Tensor | None]) -> bool:
    return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)


class NoSyncMode(TorchDispatchMode):
    """A dispatch mode that raises :class:`SyncError` on host-syncing ops.

    Args:
        sample_op_limit: If set, also reject sort/top-k/quantile/scatter-add
            style ops whose input has more than this many elements.
        extra: More op packets (``torch.ops.aten.foo``) to reject, mapped to
            the reason shown in the error.

    Attributes:
        ops: Every op overload seen, in order; lets a test assert that some
            expected op did run.
    """

    def __init__(self, sample_op_limit: int | None = None, extra: Mapping[Any, str] | None = None) -> None:
        super().__init__()
        self.sample_op_limit = sample_op_limit
        self._syncing = dict(_SYNCING)
        self._syncing.update(extra or {})
        self.ops: list[Any] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.ops.append(func)
        packet = func.overloadpacket
        reason = self._syncing.get(packet)
        if reason is None:
            reason = self._check(packet, args, kwargs)
        if reason is not None:
            raise SyncError(f"{func} would sync the host: {reason}")
        return func(*args, **kwargs)

    def _check(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if _has_bool_index(indices):
                return "boolean-mask indexing needs nonzero; use torch.where(mask, x, fill)"
        if packet is _aten._to_copy or packet is _aten.copy_:
            src = args[1] if packet is _aten.copy_ else args[0]
            dst_device = kwargs.get("device") if packet is _aten._to_copy else args[0].device
            if isinstance(src, torch.Tensor) and dst_device is not None:
                if src.device.type != "cpu" and torch.device(dst_device).type == "cpu":
                    return "copies a device tensor to the host"
        if self.sample_op_limit is not None and packet in _SAMPLE_ONLY:
            # The largest operand: for scatter_add_ it is the index/src, not self.
            size = max((a.numel() for a in args if isinstance(a, torch.Tensor)), default=0)
            if size > self.sample_op_limit:
                return (
                    f"runs on {size} elements, above the sample limit {self.sample_op_limit}; "
                    "work on a bounded sample"
                )
        return None


def assert_no_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn(*args, **kwargs)`` under :class:`NoSyncMode` and returns its result."""
    with NoSyncMode():
        return fn(*args, **kwargs)
