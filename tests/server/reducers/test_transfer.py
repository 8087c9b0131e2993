"""PassBuffer / PendingPass / HostTransfer / PinnedPool on CPU."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable

import numpy as np
import pytest
import torch

from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.reducers.spec import parse_reducer_names
from layertap.server.reducers.transfer import HostTransfer, PassBuffer, PendingPass, PinnedPool, TransferStats

pytestmark = pytest.mark.unit

F64 = torch.float64


def pending_of(**pieces: list[float]) -> PendingPass:
    buf = PassBuffer()
    for key, values in pieces.items():
        buf.add(key, torch.tensor(values, dtype=F64))
    return buf.finish()


@pytest.fixture
def transfer():
    c = HostTransfer(maxsize=4)
    yield c
    c.close()


class Gate:
    """A callback that blocks until opened, to hold the host-transfer thread."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()
        self.seen: list[dict[Hashable, np.ndarray]] = []

    def __call__(self, values: dict[Hashable, np.ndarray]) -> None:
        self.started.set()
        assert self.opened.wait(10)
        self.seen.append(values)


# -------------------------------------------------------------- PassBuffer


def test_values_and_slices_by_key() -> None:
    buf = PassBuffer()
    buf.add("a", torch.tensor([1.0, 2.0], dtype=F64))
    buf.add(("tap", 3), torch.tensor([3.0], dtype=F64))
    buf.add("empty", torch.zeros(0, dtype=F64))
    assert len(buf) == 3
    pending = buf.finish()
    assert len(buf) == 0  # ready for the next pass
    np.testing.assert_array_equal(pending.wait(), [1.0, 2.0, 3.0])
    assert pending.slices == {"a": slice(0, 2), ("tap", 3): slice(2, 3), "empty": slice(3, 3)}
    by_key = pending.values_by_key()
    np.testing.assert_array_equal(by_key[("tap", 3)], [3.0])
    assert by_key["empty"].shape == (0,)
    assert pending.ready()
    assert pending.wait() is pending.wait()  # idempotent


def test_a_tensor_added_under_several_keys_is_copied_once() -> None:
    """Taps sharing a reduction (taps.reuse) add one tensor under each piece's key: one slice for all."""
    shared, other = torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([3.0], dtype=F64)
    buf = PassBuffer()
    buf.add(0, shared)
    buf.add(1, other)
    buf.add(2, shared)
    buf.add(3, shared)
    pending = buf.finish()
    np.testing.assert_array_equal(pending.wait(), [1.0, 2.0, 3.0])
    assert pending.slices == {0: slice(0, 2), 1: slice(2, 3), 2: slice(0, 2), 3: slice(0, 2)}
    values = pending.values_by_key()
    assert np.shares_memory(values[0], values[3]) and not np.shares_memory(values[0], values[1])
    # The next pass starts afresh: an equal tensor, even the same object, is its own entry there.
    buf.add(0, shared)
    assert buf.finish().slices == {0: slice(0, 2)}


def test_wait_returns_a_private_copy() -> None:
    t = torch.tensor([1.0, 2.0], dtype=F64)
    buf = PassBuffer()
    buf.add("a", t)
    values = buf.finish().wait()
    t.fill_(9.0)  # the device buffer is reused by the next pass
    np.testing.assert_array_equal(values, [1.0, 2.0])


def test_single_piece_and_empty_pass() -> None:
    np.testing.assert_array_equal(pending_of(a=[5.0]).wait(), [5.0])
    empty = PassBuffer().finish()
    assert empty.wait().shape == (0,) and empty.values_by_key() == {}


def test_add_rejects_duplicates_and_bad_tensors() -> None:
    buf = PassBuffer()
    buf.add("a", torch.zeros(2, dtype=F64))
    with pytest.raises(ValueError, match="already"):
        buf.add("a", torch.zeros(2, dtype=F64))
    with pytest.raises(ValueError, match="float64"):
        buf.add("b", torch.zeros(2))
    with pytest.raises(ValueError, match="1-D"):
        buf.add("c", torch.zeros(2, 2, dtype=F64))


def test_discarded_pass_cannot_be_read() -> None:
    pending = pending_of(a=[1.0])
    pending.discard()
    with pytest.raises(RuntimeError, match="discarded"):
        pending.wait()


def test_reducer_outputs_round_trip() -> None:
    plan = ReducerPlan(build_reducers(parse_reducer_names("moments,histogram,quantiles,per_channel")))
    xs = [torch.randn(2, 4, 5, 5), torch.randn(3, 7)]
    # The shift sample is random, so compare against the very outputs that went in.
    outs = [plan.run(x) for x in xs]
    buf = PassBuffer()
    for i, out in enumerate(outs):
        buf.add(i, out)
    values = buf.finish().values_by_key()
    for i, x in enumerate(xs):
        assert plan.decode(values[i], x.shape) == plan.decode(outs[i].numpy(), x.shape)


# --------------------------------------------------------------- HostTransfer


def test_callbacks_get_values_in_order(transfer: HostTransfer) -> None:
    seen: list[tuple[int, float]] = []
    threads: set[str] = set()

    def cb(i: int):
        def record(values: dict[Hashable, np.ndarray]) -> None:
            threads.add(threading.current_thread().name)
            seen.append((i, float(values["v"][0])))
        return record

    for i in range(40):  # more than maxsize: the thread keeps up or drops
        transfer.submit(pending_of(v=[float(i)]), cb(i))
        if i % 3 == 0:
            assert transfer.flush(5)
    assert transfer.flush(5)
    assert [i for i, _ in seen] == sorted(i for i, _ in seen)  # FIFO
    assert all(i == v for i, v in seen)
    assert len(seen) + transfer.dropped == 40 and transfer.processed == len(seen)
    assert threads == {"layertap-host-transfer"}  # never on the submitting thread


def test_flush_waits_for_every_pass_of_a_batch() -> None:
    """The thread takes every queued pass at once; flush must wait for the whole batch."""
    c = HostTransfer(maxsize=64)
    try:
        gate = Gate()
        c.submit(pending_of(v=[0.0]), gate)
        assert gate.started.wait(5)  # the thread is busy: the next passes queue up
        done: list[int] = []
        slow = threading.Event()

        def cb(i: int):
            def record(values: dict[Hashable, np.ndarray]) -> None:
                if i == 3:
                    assert slow.wait(10)
                done.append(i)
            return record

        for i in range(1, 6):
            c.submit(pending_of(v=[float(i)]), cb(i))
        gate.opened.set()
        assert c.flush(0.3) is False  # pass 3 of the batch still runs
        slow.set()
        assert c.flush(5)
        assert done == [1, 2, 3, 4, 5] and c.processed == 6
    finally:
        c.close()


def test_flush_waits_and_times_out(transfer: HostTransfer) -> None:
    gate = Gate()
    transfer.submit(pending_of(v=[1.0]), gate)
    assert gate.started.wait(5)
    assert transfer.flush(0.05) is False  # the running job is not done
    gate.opened.set()
    assert transfer.flush(5) is True
    assert len(gate.seen) == 1 and transfer.processed == 1


def test_callback_errors_are_counted_not_raised(transfer: HostTransfer, caplog) -> None:
    def boom(values: dict[Hashable, np.ndarray]) -> None:
        raise KeyError("no such tap")

    ok: list[int] = []
    transfer.submit(pending_of(v=[1.0]), boom)
    transfer.submit(pending_of(v=[2.0]), lambda values: ok.append(1))
    assert transfer.flush(5)
    assert transfer.errors == 1 and transfer.processed == 1 and ok == [1]
    assert "no such tap" in (transfer.last_error or "")
    assert "host-transfer callback failed" in caplog.text


def test_full_queue_drops_the_oldest(transfer: HostTransfer) -> None:
    gate = Gate()
    got: list[float] = []
    transfer.submit(pending_of(v=[-1.0]), gate)
    assert gate.started.wait(5)  # job 0 is running, the queue is empty
    accepted = [
        transfer.submit(pending_of(v=[float(i)]), lambda values: got.append(float(values["v"][0])))
        for i in range(7)
    ]
    # maxsize 4: passes 0, 1, 2 were pushed out by 4, 5, 6; never blocked.
    assert accepted == [True] * 4 + [False] * 3
    assert transfer.dropped == 3 and transfer.pending() == 4
    gate.opened.set()
    assert transfer.flush(5)
    assert got == [3.0, 4.0, 5.0, 6.0]


def test_flush_is_not_fooled_by_later_drops() -> None:
    # A job still running must keep flush waiting even if newer jobs get dropped.
    c = HostTransfer(maxsize=1)
    try:
        gate = Gate()
        c.submit(pending_of(v=[0.0]), gate)
        assert gate.started.wait(5)
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(c.flush(5)))
        waiter.start()
        for i in range(3):
            c.submit(pending_of(v=[float(i)]), lambda values: None)
        waiter.join(0.1)
        assert waiter.is_alive()  # still waiting on job 0
        gate.opened.set()
        waiter.join(5)
        assert result == [True]
    finally:
        c.close()


def test_close_drains_then_rejects() -> None:
    c = HostTransfer(maxsize=100)
    got: list[float] = []
    for i in range(20):
        c.submit(pending_of(v=[float(i)]), lambda values: got.append(float(values["v"][0])))
    c.close()
    assert got == [float(i) for i in range(20)]
    assert c.closed
    with pytest.raises(RuntimeError, match="closed"):
        c.submit(pending_of(v=[1.0]), lambda values: None)


def test_context_manager_closes() -> None:
    with HostTransfer() as c:
        c.submit(pending_of(v=[1.0]), lambda values: None)
    assert c.closed and c.processed == 1


def test_maxsize_must_be_positive() -> None:
    with pytest.raises(ValueError):
        HostTransfer(maxsize=0)


def test_stats_counts_processed_dropped_errors_and_allocations() -> None:
    pool = PinnedPool(pin=False)
    transfer = HostTransfer(maxsize=2, pool=pool)
    try:
        assert transfer.stats() == TransferStats(processed=0, dropped=0, errors=0, pinned_allocations=0)
        for i in range(3):
            transfer.submit(pending_of(v=[float(i)]), lambda values: None)
            assert transfer.flush(5)  # one at a time: nothing is dropped
        assert transfer.stats().processed == 3 and transfer.stats().dropped == 0

        gate = Gate()
        transfer.submit(pending_of(v=[-1.0]), gate)
        assert gate.started.wait(5)  # the thread is held, the queue is empty
        for i in range(5):  # maxsize 2: the first three are pushed out
            transfer.submit(pending_of(v=[float(i)]), lambda values: None)
        transfer.submit(pending_of(v=[9.0]), lambda values: 1 / 0)  # pushes out one more
        assert transfer.stats().dropped == 4
        gate.opened.set()
        assert transfer.flush(5)
        pool.acquire(3)  # a host buffer for a device copy
        stats = transfer.stats()
        # 3 earlier, then the held job and the one survivor of the queue; the last one raised.
        assert stats == TransferStats(processed=5, dropped=4, errors=1, pinned_allocations=1)
        assert (stats.processed, stats.dropped, stats.errors) == (transfer.processed, transfer.dropped, transfer.errors)
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.processed = 0  # type: ignore[misc]
    finally:
        transfer.close()


# -------------------------------------------------------------- PinnedPool


class FakeEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_pool_reuses_released_buffers() -> None:
    pool = PinnedPool(pin=False)
    a = pool.acquire(10)
    assert a.numel() == 10 and a.dtype == F64
    pool.release(a)
    b = pool.acquire(12)  # capacity was rounded up to 16
    assert b.data_ptr() == a.data_ptr() and b.numel() == 12
    c = pool.acquire(100)
    assert c.data_ptr() != a.data_ptr()
    assert pool.allocations == 2


def test_pool_waits_for_the_copy_event_before_reuse() -> None:
    pool = PinnedPool(pin=False)
    a = pool.acquire(8)
    event = FakeEvent(done=False)
    pool.release(a, event)  # type: ignore[arg-type]
    assert pool.acquire(8).data_ptr() != a.data_ptr()  # copy may still be writing
    event.done = True
    assert pool.acquire(8).data_ptr() == a.data_ptr()


def test_pool_keeps_at_most_max_free() -> None:
    pool = PinnedPool(max_free=2, pin=False)
    bufs = [pool.acquire(4) for _ in range(4)]
    for b in bufs:
        pool.release(b)
    assert len(pool._free) == 2
