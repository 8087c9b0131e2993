"""Module hooks owned by captures and taps, counted so leaks are visible.

Every torch hook layertap installs goes through :class:`HookRegistry`, which
keeps the live count that ``GetServerStats``/``ListLayers`` report. Callbacks
only fire while a pass is current (see :mod:`layertap.server.host.model_host`), so
each firing belongs to exactly one pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from layertap.v1 import telemetry_pb2 as pb

#: ``callback(ctx, value)``: ``value`` is the output object, the args tuple,
#: the grad tuple, or a :class:`ParamGrad` depending on the point.
HookCallback = Callable[[Any, Any], None]

#: ``Point`` value -> API name (``POINT_GRAD_OUTPUT`` -> ``"grad_output"``), derived
#: from the proto enum so a point added to the API needs no second table.
POINT_NAMES: dict[int, str] = {
    value: name.removeprefix("POINT_").lower() for name, value in pb.Point.items() if value != pb.POINT_UNSPECIFIED
}
POINT_BY_NAME: dict[str, int] = {v: k for k, v in POINT_NAMES.items()}


class ParamGrad(NamedTuple):
    """A parameter's accumulated gradient; ``position`` is its place in the module."""

    position: int
    name: str
    grad: torch.Tensor


@dataclass
class HookHandle:
    """One registered hook; ``remove()`` is idempotent."""

    layer: str
    point: int
    _handles: list[RemovableHandle]
    _registry: HookRegistry
    _removed: bool = False

    def remove(self) -> None:
        self._registry._remove(self)


class HookRegistry:
    """Installs and counts torch hooks on the hosted model's modules."""

    def __init__(self, model: nn.Module, current_pass: Callable[[], Any]) -> None:
        self._modules = dict(model.named_modules())
        self._current_pass = current_pass
        self._lock = threading.Lock()
        self._live: set[int] = set()

    @property
    def active(self) -> int:
        """Number of torch hook handles currently installed."""
        with self._lock:
            return len(self._live)

    def add(self, layer: str, point: int, callback: HookCallback) -> HookHandle:
        """Install ``callback`` at ``layer``/``point``; the caller owns removal."""
        module = self._modules[layer]
        current = self._current_pass
        handle = HookHandle(layer, point, [], self)

        def fire(value: Any) -> None:
            # A handle removed mid-pass (from another thread) goes quiet at
            # once; torch copies its hook dicts before iterating, so the
            # removal itself is safe without holding the model lock.
            ctx = current()
            if ctx is not None and not handle._removed:
                callback(ctx, value)

        handles: list[RemovableHandle] = []
        if point == pb.POINT_OUTPUT:
            handles.append(module.register_forward_hook(lambda _m, _a, out: fire(out)))
        elif point == pb.POINT_INPUT:
            handles.append(module.register_forward_pre_hook(lambda _m, args: fire(args)))
        elif point == pb.POINT_GRAD_OUTPUT:
            handles.append(module.register_full_backward_hook(lambda _m, _gi, go: fire(go)))
        elif point == pb.POINT_GRAD_INPUT:
            handles.append(module.register_full_backward_hook(lambda _m, gi, _go: fire(gi)))
        elif point == pb.POINT_PARAM_GRAD:
            for i, (pname, param) in enumerate(module.named_parameters()):
                if param.requires_grad:
                    handles.append(
                        param.register_post_accumulate_grad_hook(
                            lambda p, _i=i, _n=pname: fire(ParamGrad(_i, _n, p.grad))
                        )
                    )
        else:
            raise ValueError(f"unknown point {point}")
        handle._handles = handles
        with self._lock:
            self._live.update(id(h) for h in handles)
        return handle

    def _remove(self, handle: HookHandle) -> None:
        with self._lock:
            if handle._removed:
                return
            handle._removed = True
            for h in handle._handles:
                self._live.discard(id(h))
        for h in handle._handles:
            h.remove()
