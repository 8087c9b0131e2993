"""A module tree pickled without its large tensors: what a compile process needs of the served model.

Why: a child process that compiles the model (:mod:`.process`) needs
its structure, not its weights. Every tensor over :data:`SMALL_BYTES` goes as
its shape, stride and dtype, and the child allocates a placeholder with
``torch.empty`` that it never reads (untouched pages cost no memory), so a
multi-GB model crosses in kilobytes. Small tensors (biases, norms' statistics,
scales) go by value. Parameters stay parameters, and a tensor reachable twice
(tied weights) stays one, by pickle's memo.

The package the child builds must not read a placeholder's memory: the child
records each placeholder's storage in :data:`PLACEHOLDERS` so it can refuse
to bake one in.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import nn

from layertap.server.compile.variant import clone_tree

__all__ = ["PLACEHOLDERS", "SMALL_BYTES", "Skeleton", "skeleton_bytes"]

#: Tensors at most this large travel by value; larger ones as placeholders.
SMALL_BYTES = 1 << 16
#: In the child: the placeholder storages (their addresses).
PLACEHOLDERS: set[int] = set()


def _placeholder(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, requires_grad: bool,
                 param: bool) -> torch.Tensor:
    t = torch.empty_strided(shape, stride, dtype=dtype)  # pages untouched: never read by the child
    PLACEHOLDERS.add(t.untyped_storage().data_ptr())
    return nn.Parameter(t, requires_grad=requires_grad) if param else t


def _by_value(data: bytes, requires_grad: bool, param: bool) -> torch.Tensor:
    t = torch.load(io.BytesIO(data), weights_only=True)
    return nn.Parameter(t, requires_grad=requires_grad) if param else t


class Skeleton(pickle.Pickler):
    """Pickles a module tree with its large tensors as placeholders (CPU, in the child)."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        param = isinstance(obj, nn.Parameter)
        t = obj.detach()
        if t.untyped_storage().nbytes() <= SMALL_BYTES:
            buf = io.BytesIO()
            torch.save(t.to("cpu").clone(), buf)
            return _by_value, (buf.getvalue(), obj.requires_grad, param)
        return _placeholder, (tuple(t.shape), t.stride(), t.dtype, obj.requires_grad, param)


def skeleton_bytes(module: nn.Module) -> bytes:
    """The module's skeleton, hook-free (:func:`~layertap.server.compile.variant.clone_tree`); raises whatever pickling raises."""
    buf = io.BytesIO()
    Skeleton(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(clone_tree(module))
    return buf.getvalue()
