"""Reads watched from arrival: a call still without its request when due is cancelled (issue 25).

grpc's sync server reads a request on the thread that runs the call, with no
deadline of its own, so a stranger who sends HEADERS and part of a message
holds that thread (and any place the call was counted in) until the
connection drops. Every call whose request is read by our wrappers
(:mod:`.open_pool` for Health, :mod:`.admission` for the rest) registers its
read here, with the time the call *arrived* (its handler was chosen), not
the time a thread picked it up: time spent queued behind stalled calls
counts, so a backlog of them is cleared in one pass instead of ``workers``
at a time, and a deadline means the same thing however long the queue was.

Each read has two due times, each measured from arrival:

- under **pressure** (the watch's ``pressed()``: for Health a call waits for a
  thread while every thread is busy; elsewhere every server-wide place is
  taken), ``arrived + patience``;
- **always**, ``arrived + read_timeout``.

A read that starts after a due time has already passed (the call was queued
that long) still gets ``grace`` seconds on its thread: its request is usually
already there, and it is read at once. Due reads sit in two heaps, ordered by
due time; one thread sleeps until the earliest is due and cancels every read
that is due (``context.cancel()``: the reader wakes, the call ends CANCELLED,
its places are given back by the wrapper that took them).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

__all__ = ["ReadWatch"]

log = logging.getLogger("layertap.server.admission")


class _Read:
    __slots__ = ("arrived", "context", "done")

    def __init__(self, arrived: float, context: grpc.ServicerContext) -> None:
        self.arrived, self.context, self.done = arrived, context, False


_Heap = list[tuple[float, int, _Read]]


class ReadWatch:
    """Cancels calls still without their request when due (see the module docstring).

    Args:
        name: Names the watcher thread and the log lines.
        pressed: Whether others wait for what stalled calls hold; called without this watch's lock.
        patience: Seconds from arrival a read may take under pressure (None: no such bound).
        read_timeout: Seconds from arrival a read may take in any case.
        grace: Seconds a read that starts past a due time still gets.
    """

    def __init__(self, name: str, *, pressed: Callable[[], bool], patience: float | None, read_timeout: float,
                 grace: float) -> None:
        self.name, self.patience, self.read_timeout, self.grace = name, patience, read_timeout, grace
        self._pressed = pressed
        self._cond = threading.Condition(threading.Lock())
        self._soon: _Heap = []  # due under pressure
        self._late: _Heap = []  # due in any case
        self._seq = itertools.count()
        self._live = 0
        self._generation = 0
        self._closed = False
        #: Calls cancelled still waiting for their request.
        self.cancelled = 0
        self._thread = threading.Thread(target=self._watch, name=f"{name}-reads", daemon=True)
        self._thread.start()

    @property
    def reading(self) -> int:
        """Reads registered and not yet over."""
        with self._cond:
            return self._live

    def poke(self) -> None:
        """Pressure may have begun: look again now."""
        with self._cond:
            self._generation += 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def read(self, read: Callable[[], Any], context: grpc.ServicerContext, arrived: float) -> Any:
        """``read()`` (which waits for the call's request) under watch; the call is cancelled when due."""
        entry = _Read(arrived, context)
        with self._cond:
            now = time.monotonic()
            self._live += 1
            wake = False
            if self.patience is not None:
                wake |= self._push(self._soon, max(arrived + self.patience, now + self.grace), entry)
            wake |= self._push(self._late, max(arrived + self.read_timeout, now + self.grace), entry)
            if len(self._soon) + len(self._late) > 4 * self._live + 64:  # many reads over behind one that is not
                self._soon = [e for e in self._soon if not e[2].done]
                self._late = [e for e in self._late if not e[2].done]
                heapq.heapify(self._soon)
                heapq.heapify(self._late)
            if wake:
                self._generation += 1
                self._cond.notify()
        try:
            return read()
        finally:
            with self._cond:
                if not entry.done:
                    entry.done = True
                    self._live -= 1

    def _push(self, heap: _Heap, due: float, entry: _Read) -> bool:
        """Push; whether ``entry`` is now the earliest (the watcher must look again)."""
        heapq.heappush(heap, (due, next(self._seq), entry))
        return heap[0][2] is entry

    @staticmethod
    def _trim(heap: _Heap) -> None:
        while heap and heap[0][2].done:
            heapq.heappop(heap)

    def _due(self, heap: _Heap, now: float, into: list[_Read]) -> None:
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)[2]
            if not entry.done:
                entry.done = True
                self._live -= 1
                into.append(entry)

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                generation = self._generation
            pressed = self._pressed()  # outside the lock: it takes the caller's own
            due: list[_Read] = []
            with self._cond:
                if self._closed:
                    return
                if generation != self._generation:
                    continue
                now = time.monotonic()
                self._due(self._late, now, due)
                if pressed:
                    self._due(self._soon, now, due)
                self._trim(self._late)
                self._trim(self._soon)
                if not due:
                    wake = self._late[0][0] if self._late else math.inf
                    if pressed and self._soon:
                        wake = min(wake, self._soon[0][0])
                    self._cond.wait(None if wake == math.inf else max(0.0, wake - now))
                    continue
                self.cancelled += len(due)
            for entry in due:
                log.debug("%s: cancelled a call that sent no request %.1f s after it arrived%s", self.name,
                          now - entry.arrived, " while others waited" if pressed else "")
                entry.context.cancel()  # wakes its reader (the call ends CANCELLED); outside the lock
