"""Compiled serving's compile schedule: slots by tap set, one background compiler thread, eviction.

Why apart from serving a pass (:mod:`.serving`): a pass only looks a slot up
and asks for one; everything that takes time happens here, on the compiler
thread, never on a request's:

* Each tap set (its *key*) has one slot: queued, compiling, ready or failed.
  A tap set's first compile still queued when another set is wanted is
  dropped (its taps changed before it ran), so the live set never waits
  behind dead ones. A new input shape queues once per slot, up to
  ``max_shapes``.
* Where a variant compiles (``where``): on a CPU model, a niced child process
  builds an AOTInductor package (:mod:`.process`), so no compile shares the
  serving process's GIL and tracer state; otherwise (a CUDA model,
  ``--compile-where thread``, a model the child cannot load) dynamo compiles
  on this process's compiler thread, stepping aside for passes
  (:mod:`.step_aside`).
* At most ``max_variants`` ready variants stay: the least recently used goes,
  sparing the one serving now while another can go.
* From construction until :meth:`CompileSchedule.close`, every host of the
  process probes shapes with module-local hooks (:mod:`~layertap.server.host.probe`):
  a compile may trace at any time.
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
from typing import Any

import torch

from layertap.server.compile.process import ProcessVariant, SkeletonRefused
from layertap.server.compile.skeleton import skeleton_bytes
from layertap.server.compile.variant import StatsFunction, Variant
from layertap.server.host import probe
from layertap.server.host.model_thread import in_own_thread
from layertap.server.host.step_aside import Passes, step_aside

__all__ = ["COMPILING", "FAILED", "QUEUED", "READY", "CompileJob", "CompileSchedule", "Slot"]

log = logging.getLogger("layertap.server.compiled")

QUEUED, COMPILING, READY, FAILED = "queued", "compiling", "ready", "failed"

#: Runs before ``concurrent.futures`` shuts its pools at exit, so a compile in
#: flight can finish (see ``compile.worker``, which does the same).
_at_exit: Callable[..., Any] = getattr(threading, "_register_atexit", atexit.register)


@dataclass
class Slot:
    """One tap set's variant and its compiles."""

    key: tuple[str, ...]
    state: str = QUEUED
    variant: Variant | ProcessVariant | None = None
    error: str = ""
    #: Input shapes compiled or queued (a miss queues its shape once).
    shapes: set[tuple[tuple[int, ...], ...]] = field(default_factory=set)


@dataclass
class CompileJob:
    """One compile for the compiler thread: a slot's first variant, or another input shape of it."""

    slot: Slot
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: Set (under the lock) when a newer tap set superseded this queued first compile.
    dropped: bool = False


class CompileSchedule:
    """The slots of one model's compiled variants and the thread that compiles them (see the module docstring).

    :class:`~layertap.server.compile.serving.CompiledServing` is one; it serves the passes.

    Args:
        module: The eager module the variants are compiled from.
        free_dims: Per input (positional by index, keyword by name): the dims declared free (-1).
        mode: Inductor's mode (already checked).
        max_variants: Compiled variants kept at most (least recently used goes).
        max_shapes: Compiled input-shape entries per variant at most.
        where: ``process`` or ``thread`` (already checked): where variants compile.
        passes: The process's pass registry: a compile steps aside while passes run.
    """

    def __init__(self, module: torch.nn.Module, free_dims: dict[int | str, tuple[int, ...]] | None, *,
                 mode: str, max_variants: int, max_shapes: int, where: str, passes: Passes | None) -> None:
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
        self.max_variants = max_variants
        self.max_shapes = max_shapes
        from torch._inductor import list_mode_options  # noqa: PLC0415 - heavy; only a compiled server needs it

        self._patches = list_mode_options(mode)
        self._slots: OrderedDict[tuple[str, ...], Slot] = OrderedDict()
        self._last: Slot | None = None  # the variant that served the last compiled pass
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._first_jobs: list[CompileJob] = []  # first compiles queued, oldest first (under the lock)
        self.dropped_compiles = 0
        self._queue: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._serial = itertools.count()
        self._compiling = threading.local()
        self.compiles = self.compile_failures = self.request_thread_compiles = self.evictions = 0
        self.compile_seconds = 0.0
        # From now until close: every host of the process probes shapes with local hooks (host.probe).
        probe.compiled_started(self)

    def _statistics(self) -> StatsFunction | None:
        """The statistics a compile traces at each tapped output: the taps', once they are attached."""
        raise NotImplementedError

    # -- control ---------------------------------------------------------------
    @property
    def variants(self) -> int:
        """Live compiled variants."""
        return sum(1 for s in list(self._slots.values()) if s.state == READY)

    def state(self, key: tuple[str, ...]) -> str | None:
        """The key's variant: queued, compiling, ready, failed, or None (never asked for, or evicted)."""
        slot = self._slots.get(key)
        return slot.state if slot is not None else None

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

    # -- queueing (model thread, and start-up) -----------------------------------------
    def _example(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Zeros shaped like the pass's inputs, their free dims marked dynamic (no activation is kept).

        Inference tensors, as :meth:`~.serving.CompiledServing.serve` hands every pass's inputs to the graph: dynamo's
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
            slot = self._slots[key] = Slot(key)
            slot.shapes.add(self._shape_of(args, kwargs))
            job = CompileJob(slot, *self._example(args, kwargs))
            self._first_jobs = [j for j in self._first_jobs if not j.dropped and j.slot.state == QUEUED] + [job]
            self._submit(job)

    def _request_shape(self, slot: Slot, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shape = self._shape_of(args, kwargs)
        if shape in slot.shapes or len(slot.shapes) >= self.max_shapes:
            return
        with self._lock:
            if self._closed:
                return
            slot.shapes.add(shape)
            self._submit(CompileJob(slot, *self._example(args, kwargs)))

    def _served(self, slot: Slot) -> None:
        """``slot``'s variant ran a pass (model thread): it is the last to serve, and the most recently used."""
        if self._last is not slot:
            self._last = slot
            with self._lock:  # LRU order; the compiler thread evicts under the lock
                if slot.key in self._slots:
                    self._slots.move_to_end(slot.key)

    def _submit(self, job: CompileJob) -> None:  # under self._lock
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

    def _run(self, job: CompileJob) -> None:
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

    def _compile_here(self, job: CompileJob) -> None:
        self._compiling.active = True
        slot = job.slot
        stats: StatsFunction | None = self._statistics()
        variant = slot.variant or Variant(self._module, slot.key, self.backend, next(self._serial), stats)
        with torch.inference_mode():
            variant.compile(job.args, job.kwargs)
        slot.variant = variant

    def _compile_in_child(self, job: CompileJob) -> None:
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
        stats = self._statistics()
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

    def _compile_in_thread_from_now(self, job: CompileJob, why: str) -> None:
        """This compile, and every later one, in this process (the model cannot go to a child)."""
        self.where = "thread"
        log.warning("%s; compiling in this process", why)
        in_own_thread(step_aside(self._compile_here, self.passes), job)

    def _evict(self, keep: Slot) -> None:
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
