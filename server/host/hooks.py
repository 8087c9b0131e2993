"""Module hooks owned by captures and taps, counted so leaks are visible.

Every torch hook layertap installs goes through :class:`HookRegistry`, which
keeps the live count that ``GetServerStats``/``ListLayers`` report. Callbacks
only fire while a pass is current (see :mod:`layertap.server.host.model_host`), so
each firing belongs to exactly one pass.

Gradient points use tensor hooks, not ``register_full_backward_hook``: a full
backward hook wraps the module's outputs in a custom Function, and a later
in-place op on them (``ReLU(inplace=True)``) then raises inside the user's
forward. A tensor hook registered before an in-place op still receives the
gradient of the value it saw, and never raises. A tap only observes: no
callback exception ever reaches the model's forward or backward.

``input`` sees keyword arguments (:class:`CallArgs`); ``grad_input`` does
not: like torch's own ``grad_input``, it covers positional tensor arguments
only, so a module called with keywords only gives none (docs/design.md,
Decisions).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, NamedTuple, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from layertap.v1 import telemetry_pb2 as pb

log = logging.getLogger(__name__)

#: ``callback(ctx, value)``: ``value`` is the output object, the args tuple (a
#: :class:`CallArgs` when the call had keyword arguments), the grad tuple, or a
#: :class:`ParamGrad` depending on the point.
HookCallback = Callable[[Any, object], None]

_T = TypeVar("_T")

#: ``Point`` value -> API name (``POINT_GRAD_OUTPUT`` -> ``"grad_output"``), derived
#: from the proto enum so a point added to the API needs no second table.
POINT_NAMES: Final[Mapping[int, str]] = MappingProxyType({
    value: name.removeprefix("POINT_").lower() for name, value in pb.Point.items() if value != pb.POINT_UNSPECIFIED
})
POINT_BY_NAME: Final[Mapping[str, int]] = MappingProxyType({v: k for k, v in POINT_NAMES.items()})


class ParamGrad(NamedTuple):
    """One gradient tensor and its ``position``: a parameter's place in the module
    (``name`` its name), or the index of the output or input it belongs to (``name`` "")."""

    position: int
    name: str
    grad: torch.Tensor


class CallArgs:
    """An ``input`` point's value when the module was called with keyword arguments.

    Hugging Face calls its attention modules with keywords only
    (``hidden_states=..., position_embeddings=(cos, sin), past_key_values=cache``).
    A call without keywords still hands hooks the bare args tuple, so models
    called positionally see no change and pay nothing.

    :meth:`named_tensors` lists the positional tensors first (keyed by their
    position, as a tuple's are), then each keyword's tensors keyed by their
    path: ``hidden_states``, ``position_embeddings.0``. Non-tensors (a cache
    object, a flag, ``None``) are skipped.
    """

    __slots__ = ("_named", "_positional", "args", "kwargs")

    #: Containers in a keyword argument are followed this deep (a path has at most this many dots).
    MAX_DEPTH = 4

    def __init__(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self.args = args
        self.kwargs = kwargs
        self._named: list[tuple[str, torch.Tensor]] | None = None
        self._positional = 0

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor argument with its key; computed once per call (several taps may read it)."""
        if self._named is None:
            named = [(str(i), v) for i, v in enumerate(self.args) if isinstance(v, torch.Tensor)]
            self._positional = len(named)
            for name, v in self.kwargs.items():
                _walk(str(name), v, named, self.MAX_DEPTH)
            self._named = named
        return self._named

    @property
    def positional(self) -> int:
        """How many of :meth:`named_tensors` are positional (the rest are keyword tensors)."""
        self.named_tensors()
        return self._positional


def _walk(path: str, value: object, out: list[tuple[str, torch.Tensor]], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif depth > 0 and isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _walk(f"{path}.{i}", v, out, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for k, v in value.items():
            _walk(f"{path}.{k}", v, out, depth - 1)


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


def _modifies_input(module: nn.Module) -> bool:
    """Modules that write their input in place (``ReLU(inplace=True)``, dropout...)."""
    return bool(getattr(module, "inplace", False))


class HookRegistry:
    """Installs and counts torch hooks on the hosted model's modules.

    Args:
        model: The module whose named submodules are hooked.
        current_pass: The pass a firing belongs to (None: ignore the firing).
        deferred_param_grads: Read ``param_grad`` only in :meth:`read_param_grads`
            (a training step's optimizer pre-step) instead of after each
            gradient accumulation.
    """

    def __init__(self, model: nn.Module, current_pass: Callable[[], Any], *,
                 deferred_param_grads: bool = False, raw_pass: Callable[[], object] | None = None) -> None:
        self._modules = dict(model.named_modules())
        self._current_pass = current_pass
        #: The pass running now even while firings are ignored (``current_pass``
        #: is None during a training step's evaluation forward, the pass is not).
        self._raw_pass = raw_pass if raw_pass is not None else current_pass
        self._deferred = deferred_param_grads
        self._lock = threading.Lock()
        self._live: set[int] = set()
        #: Deferred param_grad readers, copy-on-write: the model thread reads without the lock.
        self._readers: tuple[tuple[HookHandle, Callable[[], None]], ...] = ()
        #: Callback exceptions swallowed so the model's pass went on.
        self.errors = 0
        #: Modules found writing their input in place: grad_input hooks them without an alias.
        self._inplace: set[int] = set()
        #: Timers by module id: (handle, start pre-hook), kept last among layertap's pre-hooks.
        self._timers: dict[int, list[tuple[HookHandle, Callable[[nn.Module, object], None]]]] = {}

    @property
    def active(self) -> int:
        """Number of torch hook handles currently installed."""
        with self._lock:
            return len(self._live) + len(self._readers)

    def add_timer(self, layer: str, on_start: HookCallback, on_stop: HookCallback) -> HookHandle:
        """Install a timer around ``layer``'s forward: ``on_start(ctx, None)`` as its last
        pre-hook and ``on_stop(ctx, None)`` as its FIRST forward hook, so the time spans
        the forward and as few other hooks as possible; the caller owns removal.

        A pre-hook layertap adds to the module later (an input tap) moves the
        start back to the end (see :meth:`_start_last`), so a slow input
        reducer is never timed as the module's forward.
        """
        module = self._modules[layer]
        handle = HookHandle(layer, pb.POINT_OUTPUT, [], self)
        start = self._firer(layer, pb.POINT_INPUT, on_start, handle)
        stop = self._firer(layer, pb.POINT_OUTPUT, on_stop, handle)

        def pre(_m: nn.Module, _a: object) -> None:
            start(None)

        handles = [module.register_forward_pre_hook(pre),
                   module.register_forward_hook(lambda _m, _a, _o: stop(None), prepend=True)]
        handle._handles = handles
        with self._lock:
            self._live.update(id(h) for h in handles)
            self._timers.setdefault(id(module), []).append((handle, pre))
        return handle

    def _start_last(self, module: nn.Module) -> None:
        """Re-register the start pre-hook of each timer on ``module`` so it runs after every other.

        The new hook goes in before the old one goes: a pass starting in
        between sees two starts (the timer keeps the later), never none.
        """
        with self._lock:
            for handle, pre in self._timers.get(id(module), ()):
                old = handle._handles[0]
                new = module.register_forward_pre_hook(pre)
                old.remove()
                handle._handles[0] = new
                self._live.discard(id(old))
                self._live.add(id(new))

    def _firer(self, layer: str, point: int, callback: HookCallback, handle: HookHandle) -> Callable[[object], None]:
        """Wraps ``callback`` so it fires only inside a pass, never raises, and stops once removed."""
        current = self._current_pass
        # A hook added while a pass runs (a training step: the model thread
        # never waits for the RPC adding it) would see only part of that pass.
        born = self._raw_pass()
        replays = _Replays() if point in (pb.POINT_OUTPUT, pb.POINT_INPUT) else None

        def fire(value: object) -> None:
            # A handle removed mid-pass (from another thread) goes quiet at
            # once; torch copies its hook dicts before iterating, so the
            # removal itself is safe without holding the model lock.
            ctx = current()
            if ctx is None or handle._removed or ctx is born or (replays is not None and replays.skip(ctx)):
                return
            try:
                callback(ctx, value)
            except Exception:  # a tap never raises into the model
                self.errors += 1
                log.exception("hook at %s (%s) failed; the pass went on", layer, POINT_NAMES.get(point))

        return fire

    def add(self, layer: str, point: int, callback: HookCallback) -> HookHandle:
        """Install ``callback`` at ``layer``/``point``; the caller owns removal."""
        module = self._modules[layer]
        handle = HookHandle(layer, point, [], self)
        fire = self._firer(layer, point, callback, handle)
        handles: list[RemovableHandle] = []
        if point == pb.POINT_OUTPUT:
            handles.append(module.register_forward_hook(lambda _m, _a, out: fire(out)))
        elif point == pb.POINT_INPUT:
            # with_kwargs: a module called with keywords only (Hugging Face attention) has empty args.
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs: fire(CallArgs(args, kwargs) if kwargs else args), with_kwargs=True))
        elif point == pb.POINT_GRAD_OUTPUT:
            handles.append(module.register_forward_hook(lambda _m, _a, out: self._watch_outputs(out, fire, handle)))
        elif point == pb.POINT_GRAD_INPUT:
            aliases: list[tuple[torch.Tensor, int]] = []
            handles.append(module.register_forward_pre_hook(
                lambda m, args: self._watch_inputs(m, args, fire, handle, aliases)))
            handles.append(module.register_forward_hook(lambda m, _a, _o: self._check_aliases(m, aliases)))
        elif point == pb.POINT_PARAM_GRAD:
            params = [(i, n, p) for i, (n, p) in enumerate(module.named_parameters()) if p.requires_grad]
            if self._deferred:
                def read() -> None:
                    for i, n, p in params:
                        if p.grad is not None:
                            fire(ParamGrad(i, n, p.grad))

                handle._handles = []
                with self._lock:
                    self._readers = (*self._readers, (handle, read))
                return handle
            for i, pname, param in params:
                handles.append(param.register_post_accumulate_grad_hook(
                    lambda p, _i=i, _n=pname: fire(ParamGrad(_i, _n, p.grad))))
        else:
            raise ValueError(f"unknown point {point}")
        handle._handles = handles
        with self._lock:
            self._live.update(id(h) for h in handles)
        if point in (pb.POINT_INPUT, pb.POINT_GRAD_INPUT):
            self._start_last(module)
        return handle

    def read_param_grads(self) -> None:
        """Fire every deferred ``param_grad`` hook with the gradients as they are now."""
        for _handle, read in self._readers:
            read()

    # -- gradient hooks (forward hooks that hook tensors; never raise) ----------
    def _guarded(self, what: str, work: Callable[[], _T]) -> _T | None:
        if not torch.is_grad_enabled():
            return None  # no backward will come: nothing to hook
        try:
            return work()
        except Exception:  # a tap never raises into the model
            self.errors += 1
            log.exception("installing a %s tensor hook failed; the pass went on", what)
            return None

    def _watch_outputs(self, out: object, fire: Callable[[object], None], handle: HookHandle) -> None:
        def work() -> None:
            for i, t in enumerate(_tensors(out)):
                if t is not None and t.requires_grad and not handle._removed:
                    t.register_hook(lambda g, _i=i: fire(ParamGrad(_i, "", g)))  # type: ignore[no-untyped-call]  # unannotated in torch

        self._guarded("grad_output", work)

    def _watch_inputs(self, module: nn.Module, args: tuple[object, ...], fire: Callable[[object], None],
                      handle: HookHandle, aliases: list[tuple[torch.Tensor, int]]) -> tuple[object, ...] | None:
        # The module's own share of its input's gradient needs a tensor only
        # it uses: an alias (a view, no copy). A module that writes its input
        # in place would orphan the alias's hook, so its input is hooked
        # directly (the in-place write makes the module its only reader).
        direct = _modifies_input(module) or id(module) in self._inplace
        aliases.clear()

        def work() -> tuple[object, ...] | None:
            if handle._removed:
                return None
            new = list(args)
            for i, t in enumerate(args):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    target = t if direct else t.view_as(t)
                    target.register_hook(lambda g, _i=i: fire(ParamGrad(_i, "", g)))  # type: ignore[no-untyped-call]  # unannotated in torch
                    if not direct:
                        aliases.append((target, target._version))
                    new[i] = target
            return None if direct else tuple(new)

        return self._guarded("grad_input", work)

    def _check_aliases(self, module: nn.Module, aliases: list[tuple[torch.Tensor, int]]) -> None:
        """An alias written in place never gets its gradient: hook that module directly from now on."""
        written = any(t._version != v for t, v in aliases)
        aliases.clear()
        if written and id(module) not in self._inplace:
            self._inplace.add(id(module))
            self.errors += 1
            log.warning("%s writes its input in place: its grad_input is missed this pass and read "
                        "directly from the next one", type(module).__name__)

    def _remove(self, handle: HookHandle) -> None:
        with self._lock:
            if handle._removed:
                return
            handle._removed = True
            for h in handle._handles:
                self._live.discard(id(h))
            self._readers = tuple(r for r in self._readers if r[0] is not handle)
            key = id(self._modules[handle.layer])
            timers = [t for t in self._timers.get(key, ()) if t[0] is not handle]
            if timers:
                self._timers[key] = timers
            else:
                self._timers.pop(key, None)
            handles = list(handle._handles)
        for h in handles:
            h.remove()


#: Whether this thread is running inside autograd's backward (-1: it is not).
_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether the calling thread runs inside autograd's backward (a checkpoint's recompute does)."""
    return _graph_task is not None and _graph_task() != -1


class _Replays:
    """Tells a forward hook's firings during backward that recompute an observed forward.

    Activation checkpointing runs a module's forward again inside backward
    (once per enclosing checkpoint, when they nest). Once the pass has
    observed the module's forward, every firing in backward is such a
    recompute: skipped. When it has not (a whole model checkpointed with
    ``use_reentrant=True`` runs its first forward under ``no_grad``, an
    evaluation forward to the step tracker), the recompute is the only
    forward this pass sees of the micro-batch: kept.
    """

    __slots__ = ("_ctx", "_forwards")

    def __init__(self) -> None:
        self._ctx: object = None
        self._forwards = 0

    def skip(self, ctx: object) -> bool:
        if ctx is not self._ctx:
            self._ctx, self._forwards = ctx, 0
        if in_backward():
            return self._forwards > 0
        self._forwards += 1
        return False


def _tensors(value: object) -> list[torch.Tensor | None]:
    """The tensors of a module output, by position (non-tensors as None)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in value]
    if isinstance(value, dict):
        return [v if isinstance(v, torch.Tensor) else None for v in value.values()]
    return []
