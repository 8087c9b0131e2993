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
* Where a variant compiles (``where``): on a CPU model, a niced child process
  builds an AOTInductor package (:mod:`.process`), so no compile
  shares the serving process's GIL and tracer state; otherwise (a CUDA
  model, ``--compile-where thread``, a model the child cannot load) dynamo
  compiles on this process's compiler thread, stepping aside for passes
  (:mod:`.step_aside`).

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

import atexit
import itertools
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from layertap.server.compile.modes import COMPILE_MODES, FALLBACKS, WHERE
from layertap.server.compile.process import ProcessVariant, SkeletonRefused
from layertap.server.compile.skeleton import skeleton_bytes
from layertap.server.compile.variant import GraphResult, StatsFunction, Variant
from layertap.server.host import probe
from layertap.server.host.model_thread import in_own_thread
from layertap.server.host.step_aside import Passes, step_aside

__all__ = ["CompiledServing", "GraphPlan", "GraphTaps"]

log = logging.getLogger("layertap.server.compiled")

QUEUED, COMPILING, READY, FAILED = "queued", "compiling", "ready", "failed"

#: Runs before ``concurrent.futures`` shuts its pools at exit, so a compile in
#: flight can finish (see ``compile.worker``, which does the same).
_at_exit: Callable[..., Any] = getattr(threading, "_register_atexit", atexit.register)


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


@dataclass
class _Slot:
    key: tuple[str, ...]
    state: str = QUEUED
    variant: Variant | ProcessVariant | None = None
    error: str = ""
    #: Input shapes compiled or queued (a miss queues its shape once).
    shapes: set[tuple[tuple[int, ...], ...]] = field(default_factory=set)


@dataclass
class _Job:
    slot: _Slot
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: Set (under the lock) when a newer tap set superseded this queued first compile.
    dropped: bool = False


class CompiledServing:
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
        device = next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device
        #: ``process``: packages built by a child process (:mod:`.process`); ``thread``: dynamo
        #: variants compiled on this process's compiler thread. A CUDA model compiles in the thread (its
        #: CUDA-graph modes are dynamo's), and so does one whose skeleton does not pickle.
        self.where = where if device.type == "cpu" else "thread"
        self._workdir: str | None = None
        self._child: ProcessVariant | None = None  # the variant whose child runs now
        self._module = module
        #: The passes a compile steps aside for (``app.py``'s, shared with the host's model thread).
        self.passes = passes if passes is not None else Passes()
        self._free = free_dims or {}
        self.mode = mode
        self.fallback = fallback
        self.max_variants = max_variants
        self.max_shapes = max_shapes
        from torch._inductor import list_mode_options  # noqa: PLC0415 - heavy; only a compiled server needs it

        self._patches = list_mode_options(mode)
        self.taps: GraphTaps | None = None
        self._slots: OrderedDict[tuple[str, ...], _Slot] = OrderedDict()
        self._last: _Slot | None = None  # the variant that served the last compiled pass
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._first_jobs: list[_Job] = []  # first compiles queued, oldest first (under the lock)
        self.dropped_compiles = 0
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._serial = itertools.count()
        self._compiling = threading.local()
        self.compiles = self.compile_failures = self.request_thread_compiles = 0
        self.compiled_passes = self.eager_passes = self.shape_misses = self.evictions = 0
        self.compile_seconds = 0.0
        # From now until close: every host of the process probes shapes with local hooks (host.probe).
        probe.compiled_started(self)

    # -- control ---------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        return {"compiles": self.compiles, "compile_failures": self.compile_failures,
                "compile_seconds": self.compile_seconds, "request_thread_compiles": self.request_thread_compiles,
                "compiled_passes": self.compiled_passes, "eager_passes": self.eager_passes,
                "shape_misses": self.shape_misses, "evictions": self.evictions, "variants": self.variants}

    @property
    def variants(self) -> int:
        """Live compiled variants."""
        return sum(1 for s in list(self._slots.values()) if s.state == READY)

    def state(self, key: tuple[str, ...]) -> str | None:
        """The key's variant: queued, compiling, ready, failed, or None (never asked for, or evicted)."""
        slot = self._slots.get(key)
        return slot.state if slot is not None else None

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

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no compile is queued or running; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Drops queued compiles and joins the compiler after its current one; True when it stopped."""
        with self._lock:
            self._closed = True
            thread = self._thread
        child = self._child
        if child is not None:
            child.cancel()
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
        stopped = thread is None or not thread.is_alive()
        if stopped and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        if stopped:  # no trace can start now: the process's probes may go back to one global hook
            probe.compiled_stopped(self)
        return stopped

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
        if self._last is not slot:
            self._last = slot
            with self._lock:  # LRU order; the compiler thread evicts under the lock
                if slot.key in self._slots:
                    self._slots.move_to_end(slot.key)
        out, stats, shapes = result
        if taps is not None and stats is not None:
            taps.graph_feed(ctx, slot.key, stats, shapes)
        return True, out

    def _superset(self, key: tuple[str, ...]) -> _Slot | None:
        """The smallest ready variant whose statistics include every layer of ``key``."""
        want = set(key)
        best: _Slot | None = None
        for slot in list(self._slots.values()):
            if slot.state == READY and want <= set(slot.key) and (best is None or len(slot.key) < len(best.key)):
                best = slot
        return best

    # -- queueing ------------------------------------------------------------------
    def _example(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Zeros shaped like the pass's inputs, their free dims marked dynamic (no activation is kept).

        Inference tensors, as :meth:`serve` hands every pass's inputs to the graph: dynamo's
        guards check each input's dispatch keys."""
        def like(t: Any, where: int | str) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            z = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
            for d in self._free.get(where, ()):
                if d < z.dim() and z.shape[d] >= 2:
                    torch._dynamo.maybe_mark_dynamic(z, d)
            return z

        with torch.inference_mode():
            return tuple(like(t, i) for i, t in enumerate(args)), {k: like(v, k) for k, v in kwargs.items()}

    @staticmethod
    def _shape_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(t.shape) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))

    def _request(self, key: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if key in self._slots:
            return
        with self._lock:
            if self._closed or key in self._slots:
                return
            # A tap set's first compile still queued when another set is wanted serves no one (its
            # taps changed before it ran): drop it, so the live set never waits behind dead ones.
            for job in self._first_jobs:
                if job.slot.state == QUEUED and not job.dropped:
                    job.dropped = True
                    self._busy -= 1
                    self.dropped_compiles += 1
                    self._slots.pop(job.slot.key, None)
            slot = self._slots[key] = _Slot(key)
            slot.shapes.add(self._shape_of(args, kwargs))
            job = _Job(slot, *self._example(args, kwargs))
            self._first_jobs = [j for j in self._first_jobs if not j.dropped and j.slot.state == QUEUED] + [job]
            self._submit(job)

    def _request_shape(self, slot: _Slot, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shape = self._shape_of(args, kwargs)
        if shape in slot.shapes or len(slot.shapes) >= self.max_shapes:
            return
        with self._lock:
            if self._closed:
                return
            slot.shapes.add(shape)
            self._submit(_Job(slot, *self._example(args, kwargs)))

    def _submit(self, job: _Job) -> None:  # under self._lock
        self._busy += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="layertap-model-compile", daemon=True)
            self._thread.start()
            _at_exit(self.close, None)
        self._queue.put(job)

    # -- the compiler thread ---------------------------------------------------------
    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Inductor, counting any compile that is not on the compiler's own thread."""
        if not getattr(self._compiling, "active", False):
            self.request_thread_compiles += 1
            log.warning("a model compile ran on thread %s, not the compiler's", threading.current_thread().name)
        from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415 - heavy

        return compile_fx(gm, example_inputs, config_patches=self._patches)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.dropped:
                    continue  # counted out of _busy when it was dropped
                job.slot.state = COMPILING if job.slot.variant is None else job.slot.state
            try:
                if not self._closed:
                    self._run(job)
            except Exception:
                log.exception("model compiler: a job failed outside its compile")
            finally:
                with self._lock:
                    self._busy -= 1
                    if self._busy == 0:
                        self._idle.notify_all()

    def _run(self, job: _Job) -> None:
        slot = job.slot
        first = slot.variant is None
        t0 = time.monotonic()
        if first:
            slot.state = COMPILING
        try:
            if self.where == "process":
                self._compile_in_child(job)
            else:
                in_own_thread(step_aside(self._compile_here, self.passes), job)
        except Exception as exc:  # any compile error leaves the old graph serving
            self.compile_failures += 1
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            if first:
                slot.state, slot.error = FAILED, error
            log.warning("compiling the model with taps at %d layers failed; the previous graph keeps serving: %s",
                        len(slot.key), error)
            log.debug("the compile's traceback", exc_info=exc)
            return
        finally:
            self.compile_seconds += time.monotonic() - t0
        self.compiles += 1
        if first:
            slot.state = READY
            self._evict(slot)
        log.info("compiled the model with in-graph statistics at %d layers in %.1f s (%d live variants; "
                 "background compiles so far waited %.1f s for passes)", len(slot.key), time.monotonic() - t0,
                 self.variants, self.passes.waited_seconds)

    def _compile_here(self, job: _Job) -> None:
        self._compiling.active = True
        slot = job.slot
        stats: StatsFunction | None = self.taps.statistics if self.taps is not None else None
        variant = slot.variant or Variant(self._module, slot.key, self.backend, next(self._serial), stats)
        with torch.inference_mode():
            variant.compile(job.args, job.kwargs)
        slot.variant = variant

    def _compile_in_child(self, job: _Job) -> None:
        """A package built by a child process; the model's skeleton is written on the first call.

        A skeleton that does not pickle (a class defined in a function, a lock...) switches this
        server to compiling in its own process, for this compile and every later one."""
        if self._closed:
            raise RuntimeError("the server is closing")
        if self._workdir is None:
            try:
                skeleton = skeleton_bytes(self._module)
            except Exception as exc:  # noqa: BLE001 - pickling raises many types
                first = str(exc).splitlines()[0][:200] if str(exc) else ""
                self._compile_in_thread_from_now(job, f"the model cannot be sent to a compile process "
                                                      f"({type(exc).__name__}: {first})")
                return
            workdir = tempfile.mkdtemp(prefix="layertap-compile-")
            with open(os.path.join(workdir, "skeleton"), "wb") as f:
                f.write(skeleton)
            self._workdir = workdir
        slot = job.slot
        stats = self.taps.statistics if self.taps is not None else None
        variant = slot.variant
        if not isinstance(variant, ProcessVariant):
            variant = ProcessVariant(self._module, slot.key, os.path.join(self._workdir, "skeleton"), stats,
                                     self._free, self._patches, self._workdir)
        self._child = variant
        if self._closed:  # close() read _child before it was set: it cannot have cancelled this one
            variant.cancel()
        try:
            variant.compile(job.args, job.kwargs)
        except SkeletonRefused as exc:  # the child cannot import the model's classes (a file factory's)
            self._compile_in_thread_from_now(job, f"the compile process cannot load the model ({exc})")
            return
        finally:
            self._child = None
        slot.variant = variant

    def _compile_in_thread_from_now(self, job: _Job, why: str) -> None:
        """This compile, and every later one, in this process (the model cannot go to a child)."""
        self.where = "thread"
        log.warning("%s; compiling in this process", why)
        in_own_thread(step_aside(self._compile_here, self.passes), job)

    def _evict(self, keep: _Slot) -> None:
        with self._lock:
            ready = [s for s in self._slots.values() if s.state == READY]
            while len(ready) > self.max_variants:
                # The least recently used, sparing the one serving now while another can go; never the new one.
                victim = (next((s for s in ready if s is not keep and s is not self._last), None)
                          or next((s for s in ready if s is not keep), None))
                if victim is None:
                    break
                ready.remove(victim)
                del self._slots[victim.key]
                self.evictions += 1
