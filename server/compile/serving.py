"""Serving a compiled model (``serve --compile-model``): variants by tap set, compiled off the request path.

What a pass runs (model thread, under the model lock, :meth:`CompiledServing.serve`):

* The taps say which layers need statistics in the graph (their *key*) and
  whether every hook on the model belongs to them (:class:`GraphTaps`). A
  hook the graph cannot serve (a histogram tap, a capture, an input point, a
  request's inline tap, an armed shape probe) makes the pass eager, with
  every Python hook, as an uncompiled server runs it.
* A ready variant for the key (or one whose key holds it: a deleted tap's
  statistics are just not read) runs the pass compiled, its guards checked
  by us (:mod:`.variant`): a request never compiles.
* None ready: the key's variant is queued for the background compiler, and
  meanwhile (``fallback``) either the last variant that served keeps serving
  and the new taps wait (``pending``, the default: a tap change leaves the
  latency as it was) or the eager module serves the pass with the taps'
  hooks (``eager``: the taps are active at once, at the eager model's
  latency, 1.4-3.1x the compiled one on the demo model). A new
  input shape that no compiled entry accepts runs eager once and compiles in
  the background, up to ``max_shapes`` per variant.
* A failed compile is counted and logged; the last variant keeps serving and
  the taps it lacks see no pass (their state says so) until the tap set
  changes again.
* Compiles are scheduled by :class:`~.schedule.CompileSchedule` (this
  class's base): one slot per tap set, one background compiler thread, where
  a variant compiles (a niced child process on a CPU model, :mod:`.process`;
  else this process, stepping aside for passes), and eviction.

Shape policy: each declared free dimension (``-1``: the batch, a token
model's sequence) is traced dynamic (``maybe_mark_dynamic``), so one entry
serves every batch from 2 up and every sequence length from 2 up; torch
specializes sizes 0 and 1, so a batch of 1 gets its own entry, compiled in the
background the first time one arrives.

Compiled modes: ``reduce-overhead`` and ``max-autotune`` use CUDA graphs on
CUDA; they are refused until a CUDA-graph test has passed on a lent GPU
(:data:`CUDA_GRAPHS_VERIFIED`), since a CUDA graph's replay is where Python
hooks are skipped and a wrong statistic would go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from layertap.server.compile.modes import COMPILE_MODES, FALLBACKS, WHERE
from layertap.server.compile.schedule import COMPILING, FAILED, QUEUED, READY, CompileSchedule, Slot
from layertap.server.compile.variant import GraphResult, StatsFunction
from layertap.server.host.step_aside import Passes

# The slot states are the schedule's; the taps' stage reads them here, with the class.
__all__ = ["COMPILING", "FAILED", "QUEUED", "READY", "CompiledServing", "GraphPlan", "GraphTaps"]


def _inference(t: Any) -> Any:
    """An inference tensor over ``t``'s memory (no copy), not a view: how every compiled pass sees its inputs.

    Dynamo's guards check an input's dispatch keys, and a view's base: a request's
    tensor is a view of its wire buffer, a warm-up's is not. Called in inference mode.
    """
    if not isinstance(t, torch.Tensor) or (t.is_inference() and t._base is None):
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


@dataclass(frozen=True)
class GraphPlan:
    """What the taps need of a compiled pass."""

    #: Layers whose output statistics the graph computes, sorted.
    key: tuple[str, ...]
    #: The pass must run eager: a hook the graph cannot serve is live (a capture, a
    #: histogram tap...), or a tap must leave this pass's padding out.
    eager: bool = False


class GraphTaps(Protocol):
    """The taps' side of a compiled pass (the tap engine's ``taps.graph``)."""

    #: The statistics traced at a tapped output (:data:`~layertap.server.compile.variant.StatsFunction`).
    def statistics(self, out: torch.Tensor) -> torch.Tensor: ...

    def graph_plan(self, ctx: Any) -> GraphPlan: ...

    def graph_feed(self, ctx: Any, key: tuple[str, ...], stats: torch.Tensor, shapes: list[tuple[int, ...]]) -> None: ...



class CompiledServing(CompileSchedule):
    """Compiled variants of one model, keyed by tap set, compiled on one background thread.

    Args:
        module: The eager module (it keeps serving eager passes, Explain and replays).
        free_dims: Per input (positional by index, keyword by name): the dims declared free (-1).
        mode: Inductor's mode (:data:`COMPILE_MODES`).
        max_variants: Compiled variants kept at most (least recently used goes).
        max_shapes: Compiled input-shape entries per variant at most.
        fallback: ``eager`` or ``pending`` (see the module docstring).
        where: ``process`` or ``thread``: where variants compile.
        passes: The process's pass registry: a compile steps aside while passes run.

    Counters (plain ints, each written by one thread): ``compiles``,
    ``compile_failures``, ``compile_seconds``, ``request_thread_compiles``
    (compiles seen on any thread but the compiler's: must stay 0),
    ``compiled_passes``, ``eager_passes``, ``shape_misses``, ``evictions``.
    """

    def __init__(self, module: torch.nn.Module, free_dims: dict[int | str, tuple[int, ...]] | None = None, *,
                 mode: str = "default", max_variants: int = 4, max_shapes: int = 4,
                 fallback: str = "pending", where: str = "process", passes: Passes | None = None) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {mode!r}")
        if fallback not in FALLBACKS:
            raise ValueError(f"unknown fallback {fallback!r}")
        if where not in WHERE:
            raise ValueError(f"unknown compile place {where!r}")
        super().__init__(module, free_dims, mode=mode, max_variants=max_variants, max_shapes=max_shapes,
                         where=where, passes=passes)
        self.fallback = fallback
        self.taps: GraphTaps | None = None
        self.compiled_passes = self.eager_passes = self.shape_misses = 0

    def _statistics(self) -> StatsFunction | None:
        """The taps' statistics, traced at each tapped output (none before the tap engine attaches)."""
        return self.taps.statistics if self.taps is not None else None

    # -- control ---------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        return {"compiles": self.compiles, "compile_failures": self.compile_failures,
                "compile_seconds": self.compile_seconds, "request_thread_compiles": self.request_thread_compiles,
                "compiled_passes": self.compiled_passes, "eager_passes": self.eager_passes,
                "shape_misses": self.shape_misses, "evictions": self.evictions, "variants": self.variants}

    def serves(self, layers: list[str]) -> bool:
        """Whether the variant that served the last compiled pass computes these layers' statistics."""
        last = self._last
        return last is not None and set(layers) <= set(last.key)

    def serving_stats(self) -> dict[str, int]:
        """The compiled-serving fields of ``GetServerStatsResponse``."""
        return {"compiled_passes": self.compiled_passes, "eager_passes": self.eager_passes,
                "model_compiles": self.compiles, "model_compile_failures": self.compile_failures,
                "request_thread_compiles": self.request_thread_compiles, "compiled_variants": self.variants}

    def prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: tuple[str, ...] = ()) -> None:
        """Queue the key's variant for example inputs like these (start-up: the untapped graph)."""
        self._request(key, args, kwargs)

    # -- the pass (model thread) -------------------------------------------------
    def serve(self, args: tuple[Any, ...], kwargs: dict[str, Any], ctx: Any) -> tuple[bool, Any]:
        """``(True, output)`` when a compiled variant ran the pass (its statistics fed to the taps), else
        ``(False, None)``: the caller runs the eager module. Never compiles."""
        taps = self.taps
        plan = taps.graph_plan(ctx) if taps is not None else GraphPlan(())
        args, kwargs = tuple(_inference(t) for t in args), {k: _inference(v) for k, v in kwargs.items()}
        if plan.eager:
            self.eager_passes += 1
            return False, None
        slot = self._slots.get(plan.key)
        if slot is None or slot.state != READY:
            if slot is None or slot.state != FAILED:
                self._request(plan.key, args, kwargs)
                slot = self._superset(plan.key)
                if slot is None and self.fallback == "pending" and plan.key:
                    slot = self._last
            else:
                slot = self._last  # the old graph keeps serving; the taps it lacks see nothing
            if slot is None or slot.variant is None:
                self.eager_passes += 1
                return False, None
        variant = slot.variant
        assert variant is not None
        result: GraphResult | None = variant.run(args, kwargs)
        if result is None:  # no compiled entry takes this shape: eager now, compiled in the background
            self.shape_misses += 1
            self.eager_passes += 1
            self._request_shape(slot, args, kwargs)
            return False, None
        self.compiled_passes += 1
        self._served(slot)
        out, stats, shapes = result
        if taps is not None and stats is not None:
            taps.graph_feed(ctx, slot.key, stats, shapes)
        return True, out

    def _superset(self, key: tuple[str, ...]) -> Slot | None:
        """The smallest ready variant whose statistics include every layer of ``key``."""
        want = set(key)
        best: Slot | None = None
        for slot in list(self._slots.values()):
            if slot.state == READY and want <= set(slot.key) and (best is None or len(slot.key) < len(best.key)):
                best = slot
        return best
