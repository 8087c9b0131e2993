"""The background compiler of the compiled basic statistics: one thread, one compile at a time.

Why a thread of its own: a compile takes seconds and must never run inside a
model pass or under the model lock. It warms each kernel with a synthetic
tensor of the signature's form, made under the signature's thread modes, so
no activation is kept alive (or read while the model may overwrite it).

Persistent cache: inductor's FX graph cache and AOTAutograd cache are on by
default in torch 2.13 and live under ``TORCHINDUCTOR_CACHE_DIR`` (default
``/tmp/torchinductor_<user>``, which a container loses). Point it at a
persistent volume and a restart skips inductor's codegen and C++/Triton
build; dynamo still traces. Measured on the 2-core CPU machine: the first
signature 15-17 s cold (most of it inductor's start-up) and 4.6 s warm,
later ones 1.5-6 s cold and 0.2-0.3 s warm. The cache key ignores the
example's sizes, so keep the warm-up shapes below fixed: a graph cached from
a tiny example keeps its serial loop.

Caveat (torch 2.13, ``torch/_dynamo/convert_frame.py``, ``preserve_global_state``):
dynamo saves and restores the global CPU and CUDA RNG states around a
compile, so a compile that overlaps a pass drawing from the global RNG
(training-mode dropout) rewinds that pass's draws. Server passes run in
inference mode and draw nothing; ``gate`` serializes compiles with passes
for in-process training loops that need it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from layertap.server.compile import aoti as aot
from layertap.server.compile.kernel import BATCH, DENSE, Signature, alias, body_of, kernel_function
from layertap.server.host.model_thread import in_own_thread
from layertap.server.host.step_aside import Passes, step_aside
from layertap.server.reducers.stats_body import SHIFT_SAMPLE, UNCOMPILED
from layertap.server.reducers.workspace import F64

__all__ = ["Compiler", "Entry", "Kernel", "example_of"]

log = logging.getLogger("layertap.server.compiled")


QUEUED, COMPILING, READY, FAILED, STALE = "queued", "compiling", "ready", "failed", "stale"
AOTI, DIRECT, RUN_ONLY = "aoti", "direct", "run-only"

#: Shape of the synthetic warm-up tensors. Inductor sizes its CPU loops by
#: the example (below 512 elements per thread it emits a serial loop), so
#: they are activation-sized; the sizes are distinct, because dynamo adds an
#: equality guard for sizes equal in the example ("duck sizing"), and rows are
#: strictly shorter than their stride.
_DENSE_N, _ROWS, _COLS, _ROW_STRIDE = 65539, 257, 251, 263
_BATCH_ROWS, _BATCH_N = 7, 4099

#: A ready kernel: ``(x, rnd, on)`` -> the statistics, or None when its guards
#: do not hold for these inputs (then nothing was computed).
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


#: Runs before ``concurrent.futures`` shuts its pools at exit (the threading
#: module's hooks run newest first), so a compile in flight at exit can still
#: use inductor's worker pool and finish; plain ``atexit`` runs after that
#: shutdown, and the compile then fails with "cannot schedule new futures".
_at_exit: Callable[..., Any] = getattr(threading, "_register_atexit", atexit.register)


def _never(x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor | None:
    return None


@dataclass
class Entry:
    """One signature's compile state and, once ready, its kernel."""

    sig: Signature
    state: str = QUEUED
    run: Kernel = field(default=_never, repr=False)
    backend: str = ""  # AOTI, DIRECT or RUN_ONLY once ready
    misses: int = 0
    error: str = ""


@contextlib.contextmanager
def _modes(sig: Signature) -> Iterator[None]:
    """The calling thread's modes as the signature's: its guards check them."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(sig.inference))
        stack.enter_context(torch.set_grad_enabled(sig.grad))
        if sig.autocast is not None:
            stack.enter_context(torch.autocast(sig.device.type, dtype=sig.autocast))
        yield


def example_of(sig: Signature) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic ``(x, rnd, on)`` of the signature, made under the current modes."""
    rnd = torch.zeros(SHIFT_SAMPLE, dtype=torch.int64, device=sig.device)
    on = torch.ones((1,), dtype=F64, device=sig.device)
    if sig.form == DENSE:
        return torch.zeros(_DENSE_N, dtype=sig.dtype, device=sig.device), rnd, on
    if sig.form == BATCH:
        rnd = torch.zeros((_BATCH_ROWS, SHIFT_SAMPLE), dtype=torch.int64, device=sig.device)
        return torch.zeros((_BATCH_ROWS, _BATCH_N), dtype=sig.dtype, device=sig.device), rnd, on
    base = torch.zeros(_ROWS * _ROW_STRIDE, dtype=sig.dtype, device=sig.device)
    return alias(base, (_ROWS, _COLS), (_ROW_STRIDE, 1)), rnd, on


def _run_only(compiled: Callable[..., torch.Tensor]) -> Kernel:
    """The kernel through dynamo's run-only mode: a guard miss runs the body
    uncompiled (never compiles); its result is dropped and None returned."""
    run = torch._dynamo.run(compiled)

    def kernel(x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor | None:
        UNCOMPILED.flag = False
        out: torch.Tensor = run(x, rnd, on)
        return None if UNCOMPILED.flag else out

    return kernel


def _direct(fn: types.FunctionType) -> Kernel | None:
    """The compiled bytecode behind dynamo's guards, called after checking them ourselves.

    Dynamo's per-call wrapper costs ~30 us on CPU, about as much as the
    kernel on a 32k-element tensor; checking the same guard tree costs ~2 us.
    Uses dynamo's cache-entry introspection (``_debug_get_cache_entry_list``),
    so anything unexpected returns None and the run-only kernel is used.
    """
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: PLC0415 - private; may be gone

        entries = _debug_get_cache_entry_list(fn.__code__)
        if len(entries) != 1:
            return None
        check = entries[0].guard_manager.check
        code = types.FunctionType(entries[0].code, fn.__globals__, fn.__name__)
        names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    except Exception:  # noqa: BLE001 - a torch without this introspection: run-only
        return None
    if names != ("x", "rnd", "on"):
        return None

    def kernel(x: torch.Tensor, rnd: torch.Tensor, on: torch.Tensor) -> torch.Tensor | None:
        if not check({"x": x, "rnd": rnd, "on": on}):
            return None
        out: torch.Tensor = code(x, rnd, on)
        return out

    return kernel


class Compiler:
    """Compiles signatures on one thread, started on the first request and joined at exit.

    Args:
        max_signatures: Signatures beyond this many are never compiled.
        gate: Held around each compile when given (see the module caveat).
        direct: Call kernels past dynamo's wrapper, checking its guards
            ourselves (see :func:`_direct`); False keeps dynamo's run-only mode.
        aoti: Use the AOTInductor kernel where it applies (:mod:`.aoti`);
            False compiles every signature with dynamo.
    """

    def __init__(self, max_signatures: int = 16, gate: AbstractContextManager[Any] | None = None,
                 direct: bool = True, aoti: bool = True, passes: Passes | None = None) -> None:
        self.max_signatures = max_signatures
        #: The passes a compile steps aside for (a fresh registry: none).
        self.passes = passes if passes is not None else Passes()
        self.direct = direct
        self.aoti = aoti
        self.gate = gate
        self._entries: dict[Signature, Entry] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0  # queued or compiling
        self._queue: queue.SimpleQueue[Entry | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._broken: set[str] = set()  # device types without a working C++ compiler
        self.compiles = 0
        self.failures = 0
        #: Cached AOTInductor packages that did not load (deleted and rebuilt).
        self.bad_packages = 0
        #: Ready AOTInductor kernels by (device, dtype, form): modes do not
        #: reach them, so one serves every signature of that triple.
        self.aoti_kernels: dict[tuple[torch.device, torch.dtype, str], Kernel] = {}

    def ready(self, sig: Signature) -> Entry | None:
        """The signature's entry when its kernel is ready (lock-free: one dict read)."""
        entry = self._entries.get(sig)
        return entry if entry is not None and entry.state == READY else None

    def states(self) -> dict[Signature, str]:
        with self._lock:
            return {s: e.state for s, e in self._entries.items()}

    def request(self, sig: Signature) -> bool:
        """Queues a compile unless the signature is known; True unless refused or failed."""
        entry = self._entries.get(sig)
        if entry is not None:
            return entry.state in (QUEUED, COMPILING, READY)
        with self._lock:
            if self._closed or len(self._entries) >= self.max_signatures or sig.device.type in self._broken:
                return False
            entry = self._entries.get(sig)
            if entry is not None:
                return entry.state in (QUEUED, COMPILING, READY)
            entry = self._entries[sig] = Entry(sig)
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="layertap-compile", daemon=True)
                self._thread.start()
                _at_exit(self.close, None)
        self._queue.put(entry)
        return True

    def missed(self, entry: Entry, limit: int) -> None:
        """Counts a guard miss; at ``limit`` the signature goes back to eager for good."""
        entry.misses += 1
        if entry.misses >= limit and entry.state == READY:
            entry.state = STALE
            log.warning("compiled basic statistics: guards keep missing for %s; using eager", entry.sig.describe())

    def drop_queued(self) -> None:
        """Forgets compiles not yet started (compiling off)."""
        with self._lock:
            for sig, entry in list(self._entries.items()):
                if entry.state == QUEUED:
                    del self._entries[sig]
                    entry.state = FAILED  # the loop skips it
                    self._done()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Drops queued compiles and joins the thread after its current one.

        Also runs at interpreter exit (registered when the thread starts), with
        no timeout: a daemon thread still inside inductor's C++ when the
        interpreter finalizes is unwound by ``pthread_exit`` through a
        ``noexcept`` frame, and the process aborts ("terminate called without
        an active exception"). So exit waits for a compile in flight (measured
        cold on 2 cores: up to 20 s; warm: under a second); a server that must
        stop within its grace leaves with ``os._exit`` instead (``server.cli.serve``).

        Returns:
            True when no compile is running any more.
        """
        with self._lock:
            self._closed = True
            thread = self._thread
        self.drop_queued()
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    # -- the thread --------------------------------------------------------------
    def _done(self) -> None:  # under self._lock
        self._busy -= 1
        if self._busy == 0:
            self._idle.notify_all()

    def _loop(self) -> None:
        # Not niced (see host.priority): inductor's compile pools are made once
        # per process by the first compiling thread and would pass the value on
        # to the user's own torch.compile work.
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            with self._lock:
                if entry.state != QUEUED:
                    continue  # dropped
                entry.state = COMPILING
            try:
                with self.gate if self.gate is not None else contextlib.nullcontext():
                    run, backend, bad = in_own_thread(step_aside(self._compile, self.passes), entry.sig, self.direct,
                                                      self.aoti)
            except Exception as exc:  # noqa: BLE001 - any compile error means eager for this signature
                with self._lock:
                    self.failures += 1
                    entry.state, entry.error = FAILED, f"{type(exc).__name__}: {exc}"
                    if "InvalidCxxCompiler" in entry.error:  # no compiler: every signature would fail
                        self._broken.add(entry.sig.device.type)
                    self._done()
                # Closing at exit makes a compile in flight fail (inductor cannot
                # start pools or register exit hooks any more): not worth a warning.
                (log.debug if self._closed else log.warning)(
                    "compiled basic statistics: compile failed for %s, using eager: %s",
                    entry.sig.describe(), entry.error.splitlines()[0] if entry.error else "")
                continue
            with self._lock:
                self.compiles += 1
                self.bad_packages += bad
                entry.run, entry.backend, entry.state = run, backend, READY
                if backend == AOTI:
                    self.aoti_kernels.setdefault((entry.sig.device, entry.sig.dtype, entry.sig.form), run)
                self._done()

    @staticmethod
    def _compile(sig: Signature, direct: bool = True, aoti: bool = True) -> tuple[Kernel, str, bool]:
        """Compiles (or loads) and warms one signature; raises when the result would not be used.

        Returns:
            The kernel; its backend: ``aoti`` (:mod:`.aoti`), ``direct``
            (dynamo's compiled code behind guards we check) or ``run-only``;
            and whether a cached AOTInductor package was unreadable.
        """
        if aoti and aot.applies(sig):
            with torch.no_grad():  # export wants plain tensors, whatever the signature's modes
                example = example_of(sig)
            aot_kernel, bad = aot.load_or_compile(sig, example)
            with _modes(sig):
                x, rnd, on = example_of(sig)
                got = aot_kernel(x, rnd, on)
                expected = body_of(sig.form)(x, rnd, on)  # eager: zeros make every slot exact
            if got is None or not torch.equal(got, expected):
                raise RuntimeError("the AOTInductor kernel miscomputes its own example")
            return aot_kernel, AOTI, bad
        fn = kernel_function(sig)
        compiled = torch.compile(fn, backend="inductor", dynamic=True, fullgraph=True)
        with _modes(sig):
            x, rnd, on = example_of(sig)
            expected = compiled(x, rnd, on)
            kernel = _direct(fn) if direct else None
            backend = DIRECT if kernel is not None else RUN_ONLY
            if kernel is None:
                kernel = _run_only(compiled)
            got = kernel(x, rnd, on)
            if got is None or not torch.equal(got, expected):
                raise RuntimeError("the fresh kernel rejects (or miscomputes) its own example")
        return kernel, backend, False
