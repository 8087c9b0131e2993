"""Background compiles run one at a time, and step aside while serving work runs.

Why one at a time: torch's tracers keep process-wide state (proxy_tensor's
current make_fx tracer, fx's ``current_meta``, a patched
``nn.Module.__call__``), so two compiles on two threads can break each
other. Seen on a cold inductor cache, where the reducers' kernel export
(``reducers.compiled_aoti``) and a compiled model's variant
(``host.compiled``) overlapped: the variant failed with "s33 is not tracked
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
next Python call, while serving work runs (:data:`PASSES`: a model-thread
call, or an Infer from its request to its response), and while it runs the
switch interval is 0.5 ms, so the GIL comes back sooner between requests.
Measured on the 2-core VM (``docs/benchmarks.md``): Infer p99 during a tap
change went from 17x to 1.7x the steady p99 (the new graph's compile from
107 to 302 s, under a client that kept the model busy).

Bounds: it waits at most :data:`MAX_WAIT` for one stretch of serving work (a
pass that needs a lock the compile holds, an import's or a logging
handler's, must not wait for ever; nor may back-to-back requests starve
it), then runs on until that stretch ends. It costs the compile: the
trace function alone made an idle process's compile ~1.6x longer.

Not while a tracer patches ``nn.Module.__call__`` (fx's ``_Patcher``: make_fx
in AOT autograd and export): the patch holds for the whole process, so every
module call of an eager pass meanwhile runs through the tracer's wrapper
(40% of the model thread's samples in one profile). The compile runs through
the patched stretch without waiting, to keep it short.

How: ``sys.settrace`` on the compile's own thread, with a function that
returns None, so only function entries call it (no line events); other
threads run untraced. What it cannot stop: inductor's C++ compiler runs as
a subprocess and keeps its core.
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

from torch.nn import Module as _Module

__all__ = ["MAX_WAIT", "PASSES", "Passes", "step_aside"]

_T = TypeVar("_T")

#: Longest a compile waits for one model-thread call, in seconds.
MAX_WAIT = 0.25
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
        #: Bumped when the first of the running calls starts: a wait's identity.
        self.turn = 0
        #: Waits (one per call a compile stepped aside for), their seconds, and the waits cut by MAX_WAIT.
        self.waits = 0
        self.waited_seconds = 0.0
        self.cut_short = 0

    @property
    def running(self) -> bool:
        return not self._idle.is_set()

    def begin(self) -> None:
        with self._lock:
            self._running += 1
            if self._running == 1:
                self.turn += 1
                self._idle.clear()

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    def wait(self, timeout: float) -> bool:
        """Blocks until no call runs, at most ``timeout`` s; whether it got there."""
        with self._lock:
            self.waits += 1
        start = time.perf_counter()
        done = self._idle.wait(timeout)
        with self._lock:
            self.waited_seconds += time.perf_counter() - start
            self.cut_short += not done
        return done

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Marks the block as serving work: compiles wait while it runs."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"waits": self.waits, "waited_seconds": self.waited_seconds, "cut_short": self.cut_short}


#: The process's serving work (``host.model_thread.ModelThread`` marks each call, ``rpc.inference`` each Infer).
PASSES = Passes()
#: ``nn.Module.__call__`` as torch defines it; fx's tracers replace it while they trace.
_CALL = _Module.__call__
#: Held by the background compile running now: one at a time per process.
_ONE_AT_A_TIME = threading.Lock()


def step_aside(fn: Callable[..., _T], passes: Passes = PASSES, max_wait: float = MAX_WAIT) -> Callable[..., _T]:
    """``fn`` as a background compile: after any other's, and waiting whenever a model-thread call runs."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> _T:
        let_run = -1  # the turn that outlasted max_wait: the compile goes on until it ends

        def trace(_frame: FrameType, _event: str, _arg: Any) -> None:
            nonlocal let_run
            # Not while a tracer has patched nn.Module.__call__ for the whole process (make_fx, fx):
            # every pass's module calls would go through it meanwhile, ~2x slower (see the module).
            if passes.running and _Module.__call__ is _CALL:
                turn = passes.turn
                if turn != let_run and not passes.wait(max_wait):
                    let_run = turn

        with _ONE_AT_A_TIME:
            previous, interval = sys.gettrace(), sys.getswitchinterval()
            sys.settrace(trace)
            sys.setswitchinterval(min(interval, SWITCH_INTERVAL))
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setswitchinterval(interval)
                sys.settrace(previous)

    return run
