"""ReadWatch: due times from arrival, every due read cancelled at once, the earliest first (issue 25)."""

from __future__ import annotations

import threading
import time

import pytest
from support.e2e import wait_for

from layertap.server.rpc.read_watch import ReadWatch

pytestmark = pytest.mark.unit


class _Context:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def _reading(watch: ReadWatch, arrived: float) -> tuple[_Context, threading.Thread]:
    context = _Context()
    thread = threading.Thread(target=watch.read, args=(lambda: context.cancelled.wait(30), context, arrived),
                              daemon=True)
    thread.start()
    return context, thread


#: Patience of the first test: the fresh read must still be uncancelled after the queued ones are, so on a
#: busy machine that check needs seconds of room (its cancel, which the test then waits for, comes after it).
PATIENCE = 3.0


def test_queue_time_counts_and_a_later_read_due_sooner_is_not_hidden():
    pressed = threading.Event()
    watch = ReadWatch("t", pressed=pressed.is_set, patience=PATIENCE, read_timeout=20.0, grace=0.05)
    try:
        now = time.monotonic()
        fresh, _ = _reading(watch, now)  # due in PATIENCE s under pressure
        assert wait_for(lambda: watch.reading == 1)
        queued = [_reading(watch, now - PATIENCE - 2.0) for _ in range(4)]  # waited past PATIENCE: due at once
        assert wait_for(lambda: watch.reading == 5)
        time.sleep(0.3)  # room to misbehave: nothing is due without pressure
        assert not any(c.cancelled.is_set() for c, _ in queued), "cancelled without pressure"
        pressed.set()
        watch.poke()
        for c, t in queued:
            assert c.cancelled.wait(10)
            t.join(10)
        assert not fresh.cancelled.is_set()
        assert watch.cancelled == 4 and watch.reading == 1
        assert fresh.cancelled.wait(PATIENCE + 10)  # its own patience, from its arrival
    finally:
        watch.close()


def test_the_read_timeout_counts_from_arrival_without_pressure():
    watch = ReadWatch("t", pressed=lambda: False, patience=None, read_timeout=10.0, grace=0.05)
    try:
        start = time.monotonic()
        context, thread = _reading(watch, start - 9.8)
        assert context.cancelled.wait(8.0)
        assert time.monotonic() - start < 5.0  # 0.2 s left of its 10 s, not 10 s from the read
        thread.join(10)
        assert watch.cancelled == 1 and watch.reading == 0
    finally:
        watch.close()
