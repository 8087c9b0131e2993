"""The shape probe's hooks: one pass records every module's input and output shapes (ListLayers, warm-up).

Two ways to hook, because each has a cost the other avoids:

* **One process-wide hook** (``register_module_forward_hook``), the default.
  It reaches every module, a TorchScript child included (a ScriptModule
  refuses a module hook of its own), and leaves module-local hook dicts
  empty, so ``nn.TransformerEncoderLayer``'s fast path (off whenever a
  submodule has a local hook) still runs on a probing pass.
* **Hooks on the host's own modules**, while any host of the process serves
  compiled variants (:func:`compiled_started` and :func:`compiled_stopped`, from
  ``CompiledServing``'s start and close, or until it is collected). dynamo guards on torch's global hook dicts, so
  a variant traced on the compiler thread while a process-wide probe was live,
  on this host or on any other host of the process, rejected every later pass
  or failed to compile. The variants trace hook-free copies of the modules
  (``compile.variant.clone_tree``), which local hooks never reach. A module
  that refuses a hook (a ScriptModule) is skipped: its shapes stay unknown.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ProbeHooks", "Record", "compiled_started", "compiled_stopped", "install"]

log = logging.getLogger("layertap.server")

#: ``record(name, module, args, kwargs, output)`` for each call of a named module in the probing pass.
Record = Callable[[str, nn.Module, Any, dict[str, Any], Any], None]

#: The compiled servings alive in this process: while there is one, every host probes with local hooks.
_compiled: weakref.WeakSet[object] = weakref.WeakSet()


def compiled_started(serving: object) -> None:
    """A host of this process serves compiled variants (``serving``): probes go local while it lives."""
    _compiled.add(serving)


def compiled_stopped(serving: object) -> None:
    _compiled.discard(serving)


class ProbeHooks:
    """One probing pass's hooks, removed together."""

    def __init__(self, handles: list[torch.utils.hooks.RemovableHandle]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def install(modules: Mapping[str, nn.Module], record: Record) -> ProbeHooks:
    """Hook ``modules`` (name -> module; the root, named "", is skipped) for one pass."""
    if not _compiled:
        names = {id(m): n for n, m in modules.items() if n}

        def seen(module: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
            name = names.get(id(module))
            if name is not None:  # another host's module, or one called outside the tree
                record(name, module, args, kwargs, out)

        return ProbeHooks([nn.modules.module.register_module_forward_hook(seen, with_kwargs=True)])
    handles: list[torch.utils.hooks.RemovableHandle] = []
    for name, module in modules.items():
        if not name or isinstance(module, torch.jit.ScriptModule):
            continue  # a ScriptModule raises on register_forward_hook; its children run inside TorchScript
        try:
            handles.append(module.register_forward_hook(functools.partial(record, name), with_kwargs=True))
        except Exception:  # a module that refuses a hook loses its shapes, never the pass
            log.debug("shape probe: %s refuses a forward hook", name, exc_info=True)
    return ProbeHooks(handles)
