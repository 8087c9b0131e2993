"""ReadWatch: due times from arrival, every due read cancelled at once, the earliest first (issue 25)."""

from __future__ import annotations

import threading
import time

from layertap.server.rpc.read_watch import ReadWatch


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


def test_queue_time_counts_and_a_later_read_due_sooner_is_not_hidden():
    pressed = threading.Event()
    watch = ReadWatch("t", pressed=pressed.is_set, patience=1.0, read_timeout=5.0, grace=0.05)
    try:
        now = time.monotonic()
        fresh, _ = _reading(watch, now)  # due in 1 s under pressure
        time.sleep(0.05)
        queued = [_reading(watch, now - 3.0) for _ in range(4)]  # waited 3 s for a thread: due at once
        time.sleep(0.3)
        assert not any(c.cancelled.is_set() for c, _ in queued), "cancelled without pressure"
        pressed.set()
        watch.poke()
        for c, t in queued:
            assert c.cancelled.wait(1.0)
            t.join(1.0)
        assert not fresh.cancelled.is_set()
        assert watch.cancelled == 4 and watch.reading == 1
        assert fresh.cancelled.wait(2.0)  # its own patience, from its arrival
    finally:
        watch.close()


def test_the_read_timeout_counts_from_arrival_without_pressure():
    watch = ReadWatch("t", pressed=lambda: False, patience=None, read_timeout=1.0, grace=0.05)
    try:
        start = time.monotonic()
        context, thread = _reading(watch, start - 0.8)
        assert context.cancelled.wait(2.0)
        assert time.monotonic() - start < 0.6  # 0.2 s left of its 1 s, not 1 s from the read
        thread.join(1.0)
        assert watch.cancelled == 1 and watch.reading == 0
    finally:
        watch.close()
