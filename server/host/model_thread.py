"""One long-lived thread that runs every server-side forward of a model.

Why not the calling RPC thread: torch's CPU kernels run on OpenMP, and
libgomp gives every thread that enters a parallel region a worker team of its
own, kept until that thread exits. Forwards from several gRPC worker threads
leave several teams, more OpenMP threads than cores; libgomp then stops
spinning between parallel regions (its throttled spin count) and every region
pays a futex wake-up. Measured on the 2-core CPU machine (demo model, batch
32): once a second thread had run one forward, the step went from 7-9 ms to
14-16 ms for the rest of the process. One model thread keeps one team, as
Triton's and TorchServe's model workers do.

Passes stay serialized by the host's model lock, as before: this module
changes which thread runs them, not when. Torch work that must run before the
model thread exists (loading the model, a compile's warm-up) runs on a thread
that exits (:func:`in_own_thread`), which takes its team with it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from layertap.server.errors import Unavailable
from layertap.server.host.step_aside import Passes

__all__ = ["ModelThread", "PassLock", "in_own_thread"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class PassLock:
    """The host's model lock (reentrant) that also says whether another thread is waiting for it.

    Why: a generation runs its decode steps back to back on the model thread
    (``generate.generator``) while nothing else wants the model. The lock is not
    fair: its holder, releasing it at a pass's end and taking it again at
    once, would starve a thread waiting to change hooks between passes.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self._waiting = 0

    @property
    def wanted(self) -> bool:
        """Whether some thread is blocked taking the lock now."""
        return self._waiting > 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking and timeout != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")  # as RLock says
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        with self._count:
            self._waiting += 1
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with self._count:
                self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # RLock's private protocol, which threading.Condition uses: a wait releases every level of a reentrant hold.
    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined, no-any-return]

    def _release_save(self) -> Any:
        return self._lock._release_save()  # type: ignore[attr-defined]

    def _acquire_restore(self, state: Any) -> None:
        self._lock._acquire_restore(state)  # type: ignore[attr-defined]


class ModelThread:
    """Runs callables on one thread, started at construction, and returns their results.

    Args:
        name: The thread's name (shows in ``py-spy`` and thread dumps).
    """

    def __init__(self, name: str = "layertap-model", passes: Passes | None = None) -> None:
        self._name = name
        #: Where this thread's calls register, so a background compile steps aside while they run
        #: (``app.py`` hands every host the process's one :class:`Passes`); None: nothing compiles here.
        self.passes = passes
        self._lock = threading.Lock()
        self._ident: int | None = None
        self.calls = 0
        self._queued = 0  # calls submitted and not yet started
        # Started now, from the constructing thread: a thread inherits its
        # creator's nice value, and a first call from a telemetry thread
        # (see host.priority) would otherwise start the model thread niced.
        # None once closed.
        self._pool: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=self._name, initializer=self._remember)
        self._pool.submit(lambda: None)

    def _remember(self) -> None:
        self._ident = threading.get_ident()

    def call(self, fn: Callable[..., _T], *args: object, inline: bool = False) -> _T:
        """``fn(*args)`` on the model thread; blocks until it returns and re-raises what it raises.

        Runs inline when already on the model thread, or when ``inline`` (a
        caller holding the model lock: the model thread would wait for it).
        """
        if inline or threading.get_ident() == self._ident:
            return self._run(fn, *args)
        with self._lock:
            if self._pool is None:
                raise Unavailable("the server is shutting down; its model thread has stopped")
            # Submitted under the lock: close() cannot shut the pool in between.
            future = self._pool.submit(self._started, fn, *args)
            self.calls += 1
            self._queued += 1
        return future.result()

    @property
    def waiting(self) -> bool:
        """Whether a call is queued behind the one running now."""
        return self._queued > 0

    def _started(self, fn: Callable[..., _T], *args: object) -> _T:
        with self._lock:
            self._queued -= 1
        return self._run(fn, *args)

    def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        if self.passes is None:
            return fn(*args)
        with self.passes.model_call():  # a background compile steps aside until it ends (host.step_aside)
            return fn(*args)

    def close(self) -> None:
        """Lets the thread finish what was queued and exit; later calls are refused (UNAVAILABLE)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


def in_own_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Runs ``fn(*args)`` on a fresh thread that exits when it returns, and returns or re-raises its outcome.

    For torch work off the model thread: loading the model (its random init
    and weight copies run parallel regions) or warming up a compiled kernel.
    Measured on the 2-core CPU machine: a server whose main thread had loaded
    the demo model ran every later forward in 12-14 ms instead of 7.4 ms, for
    the rest of the process; loaded here, 7.4 ms.

    A Ctrl-C while this waits is held until ``fn`` returns, then raised: the
    work cannot be interrupted, and an interpreter that exits with a thread
    inside torch's C++ aborts (SIGABRT), daemon thread or not.
    """
    result: list[_T] = []
    error: list[BaseException] = []
    # An event, not join(): Python 3.11's join() interrupted by Ctrl-C marks
    # a live thread stopped (its bpo-45274 clean-up), and nothing waits again.
    done = threading.Event()

    def target() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=target, name="layertap-torch-job", daemon=True)
    name = getattr(fn, "__name__", "the torch work")
    presses = 0

    def held(_signum: int, _frame: object) -> None:
        # A handler that records instead of raising: a KeyboardInterrupt may
        # land anywhere, even in this wait's own clean-up, and leave early.
        nonlocal presses
        presses += 1
        if presses == 1:
            log.warning("interrupted: waiting for %s to finish first (it cannot be stopped); "
                        "press Ctrl-C twice more to leave at once", name)
        elif presses >= 3:
            log.warning("interrupted three times: leaving now, %s unfinished", name)
            logging.shutdown()
            os._exit(130)

    own_sigint = (threading.current_thread() is threading.main_thread()
                  and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    previous = signal.signal(signal.SIGINT, held) if own_sigint else None
    interrupted: BaseException | None = None
    try:
        worker.start()
        while not done.is_set():
            try:
                done.wait()
            except KeyboardInterrupt as exc:  # another handler raised it: still wait
                if interrupted is None:
                    log.warning("interrupted: waiting for %s to finish first (it cannot be stopped)", name)
                interrupted = exc
    finally:
        if own_sigint:
            signal.signal(signal.SIGINT, previous)
    if presses and interrupted is None:
        interrupted = KeyboardInterrupt()
    if interrupted is not None:
        raise interrupted
    if error:
        raise error[0]
    return result[0]
