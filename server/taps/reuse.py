"""Reuse a reduction within a pass when the hooked tensor is provably the one already reduced.

Two firings see the very same tensor, unchanged, in two cases:

- **One layer, several taps.** Hooks of one module call run back to back on
  its output: two taps with equal reducers on a layer (two users, or a
  durable tap and a stream) reduce it once. A second call of the module in
  the pass is another call: an in-place activation returns its input object,
  which may have been written since.
- **A container and its last child.** ``nn.Sequential.forward`` returns its
  last child's output as is, so ``layer1``'s output *is* ``layer1.1``'s, and
  block-level selectors (``layer*``) tap both: ResNet's four stages, for one.

Anything else (a custom forward, on the class or set on the instance as
wrappers do, a compiled module, a module called twice, a hook that returns a
new output) fails the identity check and is reduced afresh. Tensors that track
versions (outside inference mode) must also show the same version, so an
in-place write between the two firings is caught. Inference tensors carry no
version; there, a hook registered by someone else that writes the output in
place between the two firings would go unseen.

At most the tensors of one layer are held, and only until a hook fires on
another layer or the pass ends, so no activation outlives its pass here.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import torch
from torch import nn

from layertap.server.reducers.batched import Row
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["PassReuse", "passthrough_parents"]


def passthrough_parents(modules: Mapping[str, nn.Module]) -> dict[str, str]:
    """Container name -> the child whose output it returns unchanged (its last, for a plain ``Sequential``)."""
    out: dict[str, str] = {}
    for name, module in modules.items():
        if name and isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward \
                and "forward" not in vars(module) and getattr(module, "_compiled_call_impl", None) is None \
                and len(module) > 0:  # a forward replaced on the instance (wrappers do) is not Sequential's
            last = list(module._modules)[-1]
            out[name] = f"{name}.{last}"
    return out


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


class PassReuse:
    """Results of the current layer's reductions, keyed by plan and tensor; cleared as the pass moves on.

    Args:
        parents: :func:`passthrough_parents` of the hosted model.
    """

    def __init__(self, parents: Mapping[str, str]) -> None:
        self._parents = dict(parents)
        self._at: tuple[str, int, int] | None = None
        self._held: dict[tuple[Hashable, int], tuple[torch.Tensor, int | None, torch.Tensor | Row]] = {}
        #: Reductions skipped because an equal one had run on the same tensor.
        self.reused = 0

    def possible(self, hooked: Iterable[tuple[str, int]]) -> bool:
        """Whether any two firings of a pass could see one tensor: a layer and point hooked twice,
        or a container and its last child both hooked at their output. When not, the engine skips
        the bookkeeping (three calls a firing, in the model's forward)."""
        seen: set[tuple[str, int]] = set()
        for here in hooked:
            if here in seen:
                return True
            seen.add(here)
        outputs = {layer for layer, point in seen if point == pb.POINT_OUTPUT}
        return any(parent in outputs and child in outputs for parent, child in self._parents.items())

    def at(self, layer: str, point: int, call: int) -> None:
        """A hook fires on ``layer``/``point`` in the module's ``call``-th call of the pass."""
        here = (layer, point, call)
        if here == self._at:
            return
        keep = (point == pb.POINT_OUTPUT and self._at is not None and self._at[1] == point
                and self._parents.get(layer) == self._at[0])
        if not keep:
            self._held.clear()
        self._at = here

    def get(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor | Row | None:
        """The result of an equal plan (``key``) on this very tensor, unchanged since; else None."""
        hit = self._held.get((key, id(tensor)))
        if hit is None or hit[0] is not tensor or hit[1] != _version(tensor):
            return None
        self.reused += 1
        return hit[2]

    def put(self, key: Hashable, tensor: torch.Tensor, result: torch.Tensor | Row) -> None:
        self._held[(key, id(tensor))] = (tensor, _version(tensor), result)

    def clear(self) -> None:
        """The pass ended: hold nothing."""
        self._held.clear()
        self._at = None
