"""Byte-bounded backlogs: the host-transfer queue and the subscribers' server-wide budget.

Both drop the oldest first, keep the newest, and count every drop exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import numpy as np
import pytest
import torch

from layertap.server.reducers.transfer import HostTransfer, PassBuffer, PendingPass
from layertap.server.stream.broker import Broker
from layertap.server.stream.sinks import Sink, Sinks
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


def pass_of(n: int, mark: float) -> PendingPass:
    """A CPU pass of ``n`` float64 values, all equal to ``mark``."""
    buf = PassBuffer()
    buf.add("k", torch.full((n,), mark, dtype=torch.float64))
    return buf.finish()


# -- host-transfer backlog --------------------------------------------------------


def test_pass_bytes_are_its_float64_values() -> None:
    assert pass_of(1000, 0.0).nbytes == 8000


def test_transfer_drops_oldest_passes_past_its_byte_bound_and_counts_each() -> None:
    started, release = threading.Event(), threading.Event()
    seen: list[float] = []

    def hold(values: dict[Hashable, np.ndarray]) -> None:
        started.set()
        assert release.wait(10)
        seen.append(float(values["k"][0]))

    drops: list[int] = []
    # Room for 1000 passes by count, 3 by bytes (plus the one the thread holds).
    with HostTransfer(maxsize=1000, max_bytes=4 * 8000) as t:
        t.submit(pass_of(1000, -1.0), hold)
        assert started.wait(10)  # the thread now holds pass -1: its bytes count
        assert t.stats().held_bytes == 8000
        kept = [t.submit(pass_of(1000, float(i)), hold, lambda i=i: drops.append(i)) for i in range(10)]
        assert kept == [True] * 3 + [False] * 7  # one drop per submit once full
        assert drops == [0, 1, 2, 3, 4, 5, 6]  # oldest first, each exactly once
        stats = t.stats()
        assert stats.dropped == 7 and stats.held_bytes == 4 * 8000 <= t.max_bytes
        release.set()
        assert t.flush(10)
        assert seen == [-1.0, 7.0, 8.0, 9.0]  # the newest passes, in order
        assert t.stats().held_bytes == 0 and t.stats().processed == 4


def test_a_pass_larger_than_the_bound_is_kept_alone() -> None:
    seen: list[int] = []
    gate, started = threading.Event(), threading.Event()

    def slow(values: dict[Hashable, np.ndarray]) -> None:
        started.set()
        assert gate.wait(10)
        seen.append(len(values["k"]))

    with HostTransfer(maxsize=64, max_bytes=1000) as t:
        t.submit(pass_of(10, 0.0), slow)
        # The thread holds the first pass before the others come: else, slow to wake on a loaded machine,
        # it could take the big pass itself before pending() is read (it did once in CI).
        assert started.wait(10)
        t.submit(pass_of(10, 1.0), slow)
        assert t.submit(pass_of(500, 2.0), slow) in (True, False)  # 4000 bytes: over the bound alone
        assert t.pending() == 1  # whatever was queued went; the big newest pass stays
        gate.set()
        assert t.flush(10)
        assert seen[-1] == 500


def test_transfer_byte_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--transfer-queue-bytes"):
        HostTransfer(max_bytes=0)


# -- subscribers' server-wide budget ----------------------------------------------


class BudgetSink(Sink):
    def __init__(self) -> None:
        self.dropped = 0
        self.held: list[int] = []

    def on_budget(self, dropped: int, held_bytes: int) -> None:
        self.dropped += dropped
        self.held.append(held_bytes)


def summary(tap: str, n: int, index: int) -> pb.Summary:
    return pb.Summary(tap=tap, layer="x" * n, pass_index=index)


def test_budget_drops_the_oldest_messages_server_wide_and_counts_them() -> None:
    sinks = Sinks()
    seen = sinks.add(BudgetSink())
    one = summary("t", 1000, 1).ByteSize()
    # Each queue alone could hold 100 messages; all together hold 10.
    broker = Broker(default_queue_size=100, queue_bytes=100 * one, budget_bytes=10 * one, sinks=sinks)
    subs = [broker.subscribe(["t"]) for _ in range(2)]
    for i in range(1, 21):
        broker.publish([summary("t", 1000, i)], {"t": False})
    held = sum(s.pending_bytes() for s in subs)
    assert broker.budget.held == held == 10 * one
    assert broker.budget.dropped == seen.dropped == 30  # 40 queued, 10 kept
    assert [s.dropped for s in subs] == [15, 15]  # the stream's own count says so too
    assert broker.dropped_total == 30
    assert seen.held[-1] == held
    for s in subs:  # each keeps the newest five passes, oldest gone first
        assert [s.get(0).summaries[0].pass_index for _ in range(5)] == [16, 17, 18, 19, 20]  # type: ignore[union-attr]
    assert broker.budget.held == 0


def test_a_reader_that_keeps_up_loses_nothing_to_one_that_does_not() -> None:
    one = summary("t", 1000, 1).ByteSize()
    broker = Broker(default_queue_size=1000, queue_bytes=1000 * one, budget_bytes=4 * one)
    reader, idle = broker.subscribe(["t"]), broker.subscribe(["t"])
    got = []
    for i in range(50):
        broker.publish([summary("t", 1000, i)], {"t": False})
        batch = reader.get(0)
        assert batch is not None
        got.append(batch.summaries[0].pass_index)
    assert got == list(range(50)) and reader.dropped == 0
    # At each publish the reader's newest message is queued too: the idle queue keeps three.
    assert idle.dropped == broker.budget.dropped == 50 - 3 and idle.pending() == 3
    assert broker.budget.held <= 4 * one


def test_the_newest_pass_is_kept_even_over_the_budget() -> None:
    broker = Broker(budget_bytes=100)
    subs = [broker.subscribe(["t"]) for _ in range(3)]
    broker.publish([summary("t", 10, 1)], {"t": False})
    broker.publish([summary("t", 500, 2)], {"t": False})  # each copy alone is over the budget
    assert broker.budget.dropped == 3  # pass 1 went from every queue
    assert [s.pending() for s in subs] == [1, 1, 1]
    assert broker.budget.held == 3 * summary("t", 500, 2).ByteSize()


def test_a_queue_s_own_byte_bound_keeps_the_budget_exact() -> None:
    one = summary("t", 1000, 1).ByteSize()
    broker = Broker(default_queue_size=100, queue_bytes=3 * one, budget_bytes=1 << 20)
    sub = broker.subscribe(["t"])
    for i in range(10):
        broker.publish([summary("t", 1000, i)], {"t": False})
    assert sub.pending() == 3 and sub.dropped == 7  # its own bound: one drop per publish once full
    assert broker.budget.held == sub.pending_bytes() == 3 * one and broker.budget.dropped == 0


def test_unsubscribing_gives_its_bytes_back_to_the_budget() -> None:
    broker = Broker(budget_bytes=1 << 20)
    a, b = broker.subscribe(["t"]), broker.subscribe(["t"])
    for i in range(5):
        broker.publish([summary("t", 100, i)], {"t": False})
    assert broker.budget.held == a.pending_bytes() + b.pending_bytes() > 0
    broker.unsubscribe(a)
    assert broker.budget.held == b.pending_bytes()
    assert a.pending() == 0 and a.dropped == 0  # a stream that left lost nothing it could read
    broker.unsubscribe(b)
    assert broker.budget.held == 0 and broker.budget.dropped == 0


def test_a_pass_published_while_a_stream_ends_is_not_held_for_it() -> None:
    """publish() snapshots the subscribers, then puts: a put that lands after the
    unsubscribe's clear must not leave bytes in a queue no one will read or clear
    (seen in CI: layertap_stream_held_bytes stayed > 0 with no subscriber left)."""
    broker = Broker(budget_bytes=1 << 20)
    sub = broker.subscribe(["t"])
    real_put = sub.put
    entered, release = threading.Event(), threading.Event()

    def slow_put(batch):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)  # the stream ends here, between the snapshot and the put
        return real_put(batch)

    sub.put = slow_put  # type: ignore[method-assign]
    publisher = threading.Thread(target=broker.publish, args=([summary("t", 100, 0)], {"t": False}))
    publisher.start()
    assert entered.wait(10)
    broker.unsubscribe(sub)
    release.set()
    publisher.join(10)
    assert sub.pending() == 0 and sub.pending_bytes() == 0
    assert broker.budget.held == 0


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--subscribers-budget-bytes"):
        Broker(budget_bytes=0)


def test_a_batch_read_and_sent_is_freed_while_a_slow_reader_queues_older_ones() -> None:
    """The budget's publish order must not keep read batches alive behind a slow reader's queue."""
    import gc
    import weakref

    broker = Broker(budget_bytes=1 << 30)
    slow, fast = broker.subscribe(), broker.subscribe()
    refs = []
    for i in range(20):
        broker.publish([summary("t", 10, i)], {"t": True})
        batch = fast.get(timeout=1)
        assert batch is not None
        refs.append(weakref.ref(batch))
        del batch
    gc.collect()
    assert all(r() is None for r in refs)  # the fast reader's batches are gone
    assert slow.pending() == 20  # the slow reader's are all still queued
