"""Background compiles run one at a time, and step aside while serving work runs.

Why one at a time: torch's tracers keep process-wide state (proxy_tensor's
current make_fx tracer, fx's ``current_meta``, a patched
``nn.Module.__call__``), so two compiles on two threads can break each
other. Seen on a cold inductor cache, where the reducers' kernel export
(``compile.aoti``) and a compiled model's variant
(``compile.serving``) overlapped: the variant failed with "s33 is not tracked
with proxy for _ModuleStackTracer"; with compiles one at a time the same
run passed. In an earlier such run an Infer on the eager fallback failed
with ``KeyError: 'custom'``, the key fx's process-wide annotation context
adds and deletes: a pass can meet a compile's state too, which stepping
aside (below) makes rarer but does not rule out.

Why step aside: a compile (dynamo's tracing, inductor's lowering) is Python on
a thread of the serving process, and it shares the GIL with the model thread
and the RPC threads. Torch lets the GIL go inside each op and takes it back
after; a thread that wants it back waits until the holder lets go, up to the
switch interval (5 ms). A pass of a few hundred ops took 0.1-1.6 s while a
compile ran (80x the steady p99, issue 29). So a compile here waits, at its
next Python call, while serving work runs (a :class:`Passes`, one per process: a model-thread
call, or an Infer from its request to its response), and while it runs the
switch interval is 0.5 ms, so the GIL comes back sooner between requests.
Measured on the 2-core VM (``docs/benchmarks.md``), one client calling Infer
back to back: Infer p99 during a tap change 2.7x the steady p99 (eager
fallback; 80x in session 12's run of the code before), the new graph after
226 s.

Bounds: once it has waited :data:`MAX_WAIT` in all, it runs :data:`RUN_SLICE`
unhindered, then waits again: a load that never pauses (back-to-back passes,
overlapping requests) leaves the compile ~2.5% of the time, and a pass that
needs a lock the compile holds (an import's, a logging handler's) is not
blocked for ever, though the compile advances at that ~2.5% until it lets go. It costs the compile: the trace function alone made an idle
process's compile ~1.6x longer, and under a busy model it runs mostly in the
gaps between requests.

Not while a tracer patches ``nn.Module.__call__`` (fx's ``_Patcher``: make_fx
in AOT autograd and export): the patch holds for the whole process, so every
module call of an eager pass meanwhile runs through the tracer's wrapper
(40% of the model thread's samples in one profile). The compile runs through
the patched stretch without waiting, to keep it short. AOT autograd's and
export's tracers pass a foreign module's call through, so passes may run
meanwhile. fx's own ``Tracer`` does not: an Infer during a tap change raised
"module is not installed as a submodule" (inductor runs ``symbolic_trace``
once per process, the first time it lowers). So each trace by such a tracer
is exclusive (:meth:`Passes.enter_exclusive`): it waits for running
model-thread calls to end, and new ones wait until it returns, each side at
most :data:`EXCLUSIVE_WAIT`.

How: ``sys.settrace`` on the compile's own thread, with a function that
returns None (or what a trace function set before it returns, which it
chains to, though not for the fx trace frames it watches), so only function
entries call it; other threads run untraced. What it cannot stop: inductor's C++
compiler runs as a subprocess and keeps its core.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

from torch.fx import Tracer as _FxTracer
from torch.fx.experimental.proxy_tensor import PythonKeyTracer as _PythonKeyTracer
from torch.fx.experimental.proxy_tensor import _ModuleStackTracer
from torch.nn import Module as _Module

__all__ = ["MAX_WAIT", "RUN_SLICE", "Passes", "step_aside"]

_T = TypeVar("_T")

#: Waiting a compile may do before it runs a slice unhindered, in seconds.
MAX_WAIT = 1.0
#: The slice it then runs whatever serving work does: under a load that never pauses it still gets ~2.5% of
#: the time (short back-to-back passes, or overlapping requests, would otherwise starve it). A 0.25 s budget
#: (~10%) made the Infer p99 during a tap change 8x the steady one, against 2.7x with 1 s.
RUN_SLICE = 0.025
#: The interpreter's GIL switch interval while a compile runs (Python's default: 5 ms).
SWITCH_INTERVAL = 0.0005


class Passes:
    """Whether serving work runs in this process now: a model-thread call (every pass runs on one) or an
    Infer request around its pass (decoding its inputs, encoding its outputs, on an RPC thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._idle = threading.Event()
        self._idle.set()
        # Model-thread calls, and the exclusive stretches that keep them out (see exclusive()).
        self._models = threading.Condition()
        self._model_calls = 0
        self._exclusive = 0
        self._depth = threading.local()
        #: Waits for an exclusive stretch (either side) that ran out of EXCLUSIVE_WAIT and went ahead.
        self.exclusive_timeouts = 0
        #: Waits a compile made, their seconds, and the slices it ran unhindered once MAX_WAIT was spent.
        self.waits = 0
        self.waited_seconds = 0.0
        self.slices = 0

    @property
    def running(self) -> bool:
        return not self._idle.is_set()

    def begin(self) -> None:
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._idle.clear()

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    def wait(self, timeout: float) -> float:
        """Blocks until no serving work runs, at most ``timeout`` s; the seconds it waited."""
        with self._lock:
            self.waits += 1
        start = time.perf_counter()
        self._idle.wait(timeout)
        waited = time.perf_counter() - start
        with self._lock:
            self.waited_seconds += waited
        return waited

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Marks the block as serving work: compiles wait while it runs."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    @property
    def exclusive_held(self) -> bool:
        return self._exclusive > 0

    @contextlib.contextmanager
    def model_call(self) -> Iterator[None]:
        """Serving work that runs the model's modules: it waits while an exclusive stretch runs."""
        depth = getattr(self._depth, "n", 0)
        with self._models:
            # A nested call runs at once (its outer call already counts); bounded, whatever holds the
            # stretch: serving never stops for it.
            if depth == 0 and not self._models.wait_for(lambda: not self._exclusive, EXCLUSIVE_WAIT):
                self.exclusive_timeouts += 1
            self._model_calls += 1
        self._depth.n = depth + 1
        try:
            with self.serving():
                yield
        finally:
            self._depth.n = depth
            with self._models:
                self._model_calls -= 1
                self._models.notify_all()

    def enter_exclusive(self, timeout: float) -> bool:
        """Holds new model-thread calls back and waits, at most ``timeout`` s, for the running ones to end.

        For a tracer that patches ``nn.Module.__call__`` for the whole process
        and does not pass foreign modules through (fx's own ``Tracer``): a pass
        meanwhile raised "module is not installed as a submodule". Whether the
        running calls ended.
        """
        mine = getattr(self._depth, "n", 0)  # a model-thread call on this thread must not wait for itself
        with self._models:
            self._exclusive += 1
            try:
                if not self._models.wait_for(lambda: self._model_calls <= mine, timeout):
                    self.exclusive_timeouts += 1
                    return False
            except BaseException:
                self._exclusive -= 1
                self._models.notify_all()
                raise
        return True

    def leave_exclusive(self) -> None:
        with self._models:
            self._exclusive -= 1
            self._models.notify_all()

    @contextlib.contextmanager
    def exclusive(self, timeout: float = 5.0) -> Iterator[None]:
        """:meth:`enter_exclusive` for the block."""
        self.enter_exclusive(timeout)
        try:
            yield
        finally:
            self.leave_exclusive()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"waits": self.waits, "waited_seconds": self.waited_seconds, "slices": self.slices}


#: ``nn.Module.__call__`` as torch defines it; fx's tracers replace it while they trace.
_CALL = _Module.__call__
#: Held by the background compile running now: one at a time per process (reentrant: a compile that
#: runs another inline on its own thread must not wait for itself).
_ONE_AT_A_TIME = threading.RLock()


#: ``fx.Tracer.trace``'s code (subclasses call it), and the tracers whose module calls pass a foreign module
#: through (AOT autograd's, whose trace of a whole model runs seconds; export's, which catches the error).
_FX_TRACE = _FxTracer.trace.__code__
_PASS_THROUGH = frozenset({_PythonKeyTracer.call_module, _ModuleStackTracer.call_module})
#: Longest an fx trace waits for running model-thread calls to end before it goes ahead, in seconds.
EXCLUSIVE_WAIT = 5.0


def _leave_on_return(passes: Passes, held: list[int]) -> Callable[[FrameType, str, Any], Any]:
    """The trace function of one fx trace's frame: its end (a return or an exception) lets passes run."""
    def local(_frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "return" and held[0] > 0:
            held[0] -= 1
            passes.leave_exclusive()
            return None
        return local

    return local


def step_aside(fn: Callable[..., _T], passes: Passes, max_wait: float = MAX_WAIT,
               run_slice: float = RUN_SLICE) -> Callable[..., _T]:
    """``fn`` as a background compile: after any other's, and waiting while serving work runs (see the module)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> _T:
        waited = 0.0  # since the last slice
        free_until = 0.0
        held = [0]  # exclusive stretches entered and not yet left (a lost 'return' event is made good at the end)
        previous = sys.gettrace()

        def trace(frame: FrameType, event: str, arg: Any) -> Any:
            nonlocal waited, free_until
            if frame.f_code is _FX_TRACE \
                    and getattr(type(frame.f_locals.get("self")), "call_module", None) not in _PASS_THROUGH:
                passes.enter_exclusive(EXCLUSIVE_WAIT)
                held[0] += 1
                return _leave_on_return(passes, held)
            if not passes.running:
                waited = 0.0  # a quiet spell: the next stretch of serving gets the whole budget
            # Not while a tracer has patched nn.Module.__call__ for the whole process (make_fx, fx):
            # every pass's module calls go through it meanwhile (see the module).
            if passes.running and _Module.__call__ is _CALL and not passes.exclusive_held \
                    and time.perf_counter() >= free_until:
                waited += passes.wait(max_wait - waited)
                if waited >= max_wait:
                    waited, free_until = 0.0, time.perf_counter() + run_slice
                    passes.slices += 1
            # Chained: coverage or a debugger tracing this thread keeps working.
            return previous(frame, event, arg) if previous is not None else None  # type: ignore[arg-type]

        with _ONE_AT_A_TIME:
            interval = sys.getswitchinterval()
            sys.settrace(trace)
            sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setswitchinterval(interval)
                sys.settrace(previous)
                while held[0] > 0:  # tracing was switched off inside an fx trace (a debugger, a RecursionError)
                    held[0] -= 1
                    passes.leave_exclusive()

    return run
