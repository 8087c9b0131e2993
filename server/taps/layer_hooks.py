"""The engine's hooks: one per hooked (layer, point), shared by every tap there.

Why: a hook per tap made each tap cost the model thread a few Python calls per
layer on every pass, sampled or not. Thirty ``**`` subscribers on a 67-module
model were 2,010 calls a pass (about 5.7 ms on a 3.4 ms pass) even when the
overhead budget (``taps.budget``) had thinned them all out. Now a layer has one
hook whatever the number of taps, and a pass calls only the firings of taps
that are on in it (decided once for all taps at the pass's first hook), plus
every firing bound to the op layout, whose op call is made on every pass so
that a sampled and an unsampled pass launch alike (``taps.firing``). The list
of firings to call is rebuilt only when the set of taps that are on changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from layertap.server.host.hooks import HookHandle, HookRegistry
from layertap.server.host.model_host import PassContext
from layertap.server.taps.firing import Firing
from layertap.server.taps.tap import Tap

__all__ = ["LayerHook", "TapHooks"]


class LayerHook:
    """The hook callback of one (layer, point): calls the firings that are on in this pass."""

    __slots__ = ("firings", "active", "seen", "handle", "fired", "_hooks")

    def __init__(self, hooks: TapHooks) -> None:
        self._hooks = hooks
        #: Every firing here, in the order their taps were made (copy-on-write: the model thread reads it).
        self.firings: tuple[Firing, ...] = ()
        #: Those called in this pass, and the generation they were chosen at.
        self.active: tuple[Firing, ...] = ()
        self.seen = -1
        self.handle: HookHandle | None = None
        #: The last pass it was called in: a tap none of whose layer hooks were is refunded its decision.
        self.fired = -1

    def __call__(self, ctx: PassContext, value: Any) -> None:
        if ctx.active:
            return  # active-capture passes are never fed to taps
        start = time.perf_counter()
        hooks = self._hooks
        self.fired = ctx.index
        try:
            if hooks.index != ctx.index:
                hooks.start(ctx)
            generation = hooks.generation
            if self.seen != generation:
                index = ctx.index
                firings = self.firings
                # A tap not yet decided for this pass (made during it) starts with the next one; the
                # list that leaves it out is not kept past this pass.
                self.active = tuple(f for f in firings if f.tap._pass == index and (f.tap._on or f.layout is not None))
                # Set last: a removal meanwhile bumped the generation, so the next call chooses again.
                self.seen = generation if all(f.tap._pass == index for f in firings) else -1
            for firing in self.active:
                firing(ctx, value)
        finally:
            hooks.seconds += time.perf_counter() - start


class TapHooks:
    """Every tap firing's place in a :class:`LayerHook`, and the pass's one decision for all taps.

    Args:
        registry: The host's hooks, where each layer hook is installed.
        decide: Decides every tap's pass (``PassDecisions.decide`` for each) and returns which are on
            (a key that changes whenever the taps, or which of them are on, change).
    """

    def __init__(self, registry: HookRegistry, decide: Callable[[PassContext], tuple[int, ...]]) -> None:
        self._registry = registry
        self._decide = decide
        self._layers: dict[tuple[str, int], LayerHook] = {}
        #: The pass decided last, and a count bumped whenever the firings to call may differ.
        self.index = -1
        self.generation = 0
        self._on: tuple[int, ...] = ()
        #: Model-thread seconds in the layer hooks since :meth:`take_seconds`: the firings and the
        #: dispatch around them (the pass's decision included), which no tap's own figure holds.
        self.seconds = 0.0

    def take_seconds(self) -> float:
        """The seconds since the last call (the pass's, when called at its end)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def start(self, ctx: PassContext) -> None:
        """The pass's first hook: decide every tap once; layer hooks choose their firings again if that changed."""
        self.index = ctx.index
        on = self._decide(ctx)
        if on != self._on:  # (tap ids in it: one tap deleted and another made compare unequal)
            self._on = on
            self.generation += 1

    def changed(self) -> None:
        """Firings were bound or unbound (a new op layout): layer hooks choose again."""
        self.generation += 1

    def add(self, firings: Iterable[Firing], point: int) -> None:
        """Hooks each firing at its layer (the caller holds the engine lock)."""
        for firing in firings:
            key = (firing.layer, point)
            hook = self._layers.get(key)
            if hook is None:
                hook = self._layers[key] = LayerHook(self)
                hook.handle = self._registry.add(firing.layer, point, hook)
            hook.firings = (*hook.firings, firing)
            firing.hook = hook
        self.generation += 1

    def remove(self, firings: Iterable[Firing], point: int) -> None:
        """Unhooks the firings; a layer hook with none left goes (the caller holds the engine lock)."""
        gone = {id(f) for f in firings}
        for key in {(f.layer, point) for f in firings}:
            hook = self._layers.get(key)
            if hook is None:
                continue
            hook.firings = tuple(f for f in hook.firings if id(f) not in gone)
            hook.active = tuple(f for f in hook.active if id(f) not in gone)  # quiet from the next call on
            if not hook.firings:
                del self._layers[key]
                if hook.handle is not None:
                    hook.handle.remove()
        self.generation += 1

    def ran(self, firings: Iterable[Firing], index: int) -> bool:
        """Whether any of these firings' layer hooks was called in pass ``index``."""
        return any(f.hook is not None and f.hook.fired == index for f in firings)

    def torch_handles(self, taps: Iterable[Tap]) -> int:
        """The torch hooks that serve ``taps``: their layers' hooks (each once) and their timers."""
        ids = {id(t) for t in taps}
        # A copy: deletes (RPC threads, no model lock) change the dict while the model thread counts.
        count = sum(len(h.handle._handles) for h in list(self._layers.values())
                    if h.handle is not None and any(id(f.tap) in ids for f in h.firings))
        return count + sum(len(h._handles) for t in taps for h in t.handles)
