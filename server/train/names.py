"""The user's own model behind the wrappers that rename it.

DDP keeps the model as ``.module`` and ``torch.compile`` as ``._orig_mod``,
so hooking the wrapper would prefix every layer name with ``module.`` or
``_orig_mod.``. Hooks on the inner model fire when the wrapper runs it, and
its names are the ones the user wrote. FSDP is not unwrapped: it flattens
and shards parameters, so per-layer parameter gradients are not what the
user's modules hold (out of scope, see docs/training.md).
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel


def _is_ddp(module: nn.Module) -> bool:
    return isinstance(module, (DistributedDataParallel, DataParallel))


def is_compiled(model: nn.Module) -> bool:
    """Whether ``torch.compile`` wraps the model anywhere in the top nesting."""
    while True:
        if getattr(model, "_orig_mod", None) is not None and isinstance(model._orig_mod, nn.Module):
            return True
        inner = getattr(model, "module", None) if _is_ddp(model) else None
        if not isinstance(inner, nn.Module):
            return False
        model = inner


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost user model under any nesting of DDP/DataParallel and torch.compile."""
    while True:
        inner = getattr(model, "module", None) if _is_ddp(model) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
