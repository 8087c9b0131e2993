"""Fan-out of summary batches to subscribers, never blocking the model.

Each subscriber has a queue bounded in messages and in bytes (the summaries'
wire size): past either bound the oldest messages are dropped and counted, so
a slow reader of a wide tap (big histograms on many layers) holds at most
``queue_bytes``, not ``queue_size`` large messages. All queues together
hold at most ``budget_bytes`` (``--subscribers-budget-bytes``) plus the
newest pass: 30 never-reading subscribers of wide stream taps each stayed
under their own bound yet took the server from 272 MiB to 3 GB. Past the
budget the oldest messages server-wide go first, so readers that keep up
lose nothing to those that do not. Publishing is O(subscribers) appends
under short locks; each summary's size is computed once per pass, however
many subscribers receive it.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from layertap.server.errors import LimitExceeded, Unavailable
from layertap.server.host.allocator import trim_soon
from layertap.server.protowire import varint
from layertap.server.stream.sinks import Sinks
from layertap.v1 import telemetry_pb2 as pb

#: Bytes one subscriber's queue may hold by default (``--subscriber-queue-bytes``).
DEFAULT_QUEUE_BYTES = 16 << 20
#: Bytes all subscribers' queues may hold together by default (``--subscribers-budget-bytes``).
DEFAULT_BUDGET_BYTES = 64 << 20
#: ``SubscribeResponse.summaries``' key (a length-delimited field), from the generated descriptor.
_SUMMARIES_KEY = varint(pb.SubscribeResponse.DESCRIPTOR.fields_by_name["summaries"].number << 3 | 2)


@dataclass
class Batch:
    """One stream message: the summaries of one pass (and any tap events)."""

    summaries: list[pb.Summary] = field(default_factory=list)
    events: list[pb.TapEvent] = field(default_factory=list)
    #: Wire size of the summaries and events, what the byte bound counts.
    nbytes: int = 0
    #: Publish number, for the server-wide budget's oldest-first order.
    seq: int = 0
    #: Read or dropped: no longer counted anywhere.
    gone: bool = False
    #: The summaries' wire bytes, as the publisher wrote them (None: serialize the messages): a stream
    #: sends them as they are, so thirty subscribers of one reduction do not serialize it thirty times.
    wires: list[bytes] | None = None

    def response(self, dropped: int) -> bytes:
        """This batch as a serialized ``SubscribeResponse``, stamped with the stream's drop count."""
        rest = pb.SubscribeResponse(events=self.events, dropped=dropped)
        if self.wires is None:
            rest.summaries.extend(self.summaries)
            return rest.SerializeToString()
        # Serialized messages concatenate as one message: the summaries' entries, then the rest's fields.
        return b"".join([_SUMMARIES_KEY + varint(len(w)) + w for w in self.wires]) + rest.SerializeToString()


class Subscription:
    """A subscriber's drop-oldest queue, bounded in messages and in bytes.

    The newest message is always kept, so one message larger than
    ``max_bytes`` is held alone rather than lost.
    """

    def __init__(self, tap_ids: Iterable[str] | None, queue_size: int, max_bytes: int = DEFAULT_QUEUE_BYTES,
                 budget: ByteBudget | None = None) -> None:
        self.tap_ids: set[str] | None = set(tap_ids) if tap_ids is not None else None
        self.queue_size = queue_size
        self.max_bytes = max_bytes
        self._queue: collections.deque[Batch] = collections.deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self._budget = budget
        self.dropped = 0
        self.closed = False

    def wants(self, tap_id: str, durable: bool) -> bool:
        return durable if self.tap_ids is None else tap_id in self.tap_ids

    def put(self, batch: Batch) -> int:
        """Enqueue; returns how many old messages were dropped to make room.

        A closed subscription takes nothing: a pass published while its stream
        ended (the broker's snapshot of subscribers still named it) would
        otherwise sit in a queue no one reads or clears, held against the budget.
        """
        with self._cond:
            if self.closed:
                return 0
            dropped = freed = 0
            while self._queue and (len(self._queue) >= self.queue_size
                                   or self._bytes + batch.nbytes > self.max_bytes):
                old = self._queue.popleft()
                old.gone = True
                self._bytes -= old.nbytes
                freed += old.nbytes
                dropped += 1
            self.dropped += dropped
            self._queue.append(batch)
            self._bytes += batch.nbytes
            self._cond.notify()
        if self._budget is not None:
            self._budget.add(batch.nbytes - freed)
        return dropped

    def drop_if_oldest(self, batch: Batch) -> bool:
        """Drops ``batch`` (counted) if it is still the oldest queued; the budget's eviction."""
        with self._cond:
            if not self._queue or self._queue[0] is not batch:
                return False
            self._queue.popleft()
            batch.gone = True
            self._bytes -= batch.nbytes
            self.dropped += 1
        if self._budget is not None:
            self._budget.add(-batch.nbytes)
        return True

    def clear(self) -> int:
        """Drops every queued message uncounted (the stream is gone); returns the bytes freed."""
        with self._cond:
            for batch in self._queue:
                batch.gone = True
            self._queue.clear()
            freed, self._bytes = self._bytes, 0
        if self._budget is not None:
            self._budget.add(-freed)
        return freed

    def get(self, timeout: float | None = None) -> Batch | None:
        """Next batch, or None on timeout or close."""
        with self._cond:
            if not self._queue and not self.closed:
                self._cond.wait(timeout)
            if not self._queue:
                return None
            batch = self._queue.popleft()
            batch.gone = True
            self._bytes -= batch.nbytes
        if self._budget is not None:
            self._budget.add(-batch.nbytes)
        return batch

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def pending_bytes(self) -> int:
        """Bytes of the messages queued, as the byte bound counts them."""
        with self._cond:
            return self._bytes

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class ByteBudget:
    """Bytes queued for all subscribers together, and what the budget dropped."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"--subscribers-budget-bytes {limit}: must be at least 1")
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0
        #: Messages dropped because all queues together were over ``limit``.
        self.dropped = 0

    @property
    def held(self) -> int:
        """Bytes queued now, over all subscribers."""
        with self._lock:
            return self._held

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._held += nbytes

    def over(self) -> bool:
        with self._lock:
            return self._held > self.limit


class Broker:
    """Routes per-pass summaries to every interested subscription."""

    def __init__(self, default_queue_size: int = 256, max_subscribers: int = 32, sinks: Sinks | None = None,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if queue_bytes < 1:
            raise ValueError(f"--subscriber-queue-bytes {queue_bytes}: must be at least 1")
        self.default_queue_size = default_queue_size
        #: Bytes each subscriber's queue may hold (``--subscriber-queue-bytes``).
        self.queue_bytes = queue_bytes
        #: Bytes all subscribers' queues may hold together (``--subscribers-budget-bytes``).
        self.budget = ByteBudget(budget_bytes)
        self.max_subscribers = max_subscribers
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        #: (subscription, batch) in publish order: the budget evicts from the left. Weak:
        #: a batch that was read and sent is freed at once, not held here behind an
        #: older one that a slow reader still queues (that memory is in no budget).
        self._order: collections.deque[tuple[Subscription, weakref.ref[Batch]]] = collections.deque()
        self._seq = 0
        self.dropped_total = 0
        #: Set by ``close()``: open streams end UNAVAILABLE, new ones are refused.
        self.shutting_down = False
        #: Told of each message queued, with how many it pushed out.
        self.sinks: Sinks = sinks if sinks is not None else Sinks()

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return len(self._subs)

    def subscribe(self, tap_ids: Iterable[str] | None = None, queue_size: int = 0) -> Subscription:
        """Register a subscriber; ``tap_ids=None`` follows every durable tap."""
        sub = Subscription(tap_ids, queue_size or self.default_queue_size, self.queue_bytes, self.budget)
        with self._lock:
            if self.shutting_down:
                raise Unavailable("the server is shutting down; reconnect to another replica or retry")
            if len(self._subs) >= self.max_subscribers:
                raise LimitExceeded(f"{len(self._subs)} subscribers already, the server limit is {self.max_subscribers}")
            self._subs.append(sub)
        return sub

    def wants(self, tap_id: str, durable: bool) -> bool:
        """Whether a subscriber reads ``tap_id``'s summaries now: the publisher builds none for no one."""
        with self._lock:
            return any(sub.wants(tap_id, durable) for sub in self._subs)

    def unsubscribe(self, sub: Subscription) -> None:
        """Ends ``sub`` and frees its queue now, not when its stream's thread next wakes."""
        sub.close()
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
        freed = sub.clear()
        if freed:
            self.sinks.on_budget(0, self.budget.held)
        # What the stream's messages, its tap's passes and its gRPC call held
        # is free now but stays in malloc's arenas until trimmed.
        trim_soon()

    def publish(self, summaries: list[pb.Summary], durable: dict[str, bool], events: Iterable[pb.TapEvent] = (),
                wires: Sequence[bytes] | None = None) -> None:
        """Send one pass's summaries; each subscriber gets one message with its share.

        Args:
            summaries: every summary of the pass.
            durable: tap id -> whether it is durable (for "all durable" subscribers).
            events: tap events (errors, expiry) to deliver alongside.
            wires: ``summaries``' wire bytes, when the publisher wrote them: sized and sent as they are.
        """
        events = list(events)
        with self._lock:
            subs = list(self._subs)
            self._seq += 1
            seq = self._seq
        if not subs:
            return
        # Sizes once per pass, not once per subscriber: ByteSize walks the message. Who wants what is
        # decided once per subscriber and tap, not per summary: thirty subscribers of thirty taps over
        # 67 layers would otherwise ask 60,000 times a sampled pass, on the thread that shares the GIL.
        sizes = [s.ByteSize() for s in summaries] if wires is None else [len(w) for w in wires]
        by_tap: dict[str, list[int]] = {}
        for i, s in enumerate(summaries):
            by_tap.setdefault(s.tap, []).append(i)
        sized_events = [(e, e.ByteSize()) for e in events]
        total = sum(sizes)
        for sub in subs:
            wanted = [t for t in by_tap if sub.wants(t, durable.get(t, False))]
            if len(wanted) == len(by_tap):
                mine, nbytes = list(summaries), total
                mine_wires = None if wires is None else list(wires)
            else:
                # The pass's order, as one tap would see it.
                rows = by_tap[wanted[0]] if len(wanted) == 1 else sorted(i for t in wanted for i in by_tap[t])
                mine, nbytes = [summaries[i] for i in rows], sum(sizes[i] for i in rows)
                mine_wires = None if wires is None else [wires[i] for i in rows]
            evs = [(e, n) for e, n in sized_events if sub.wants(e.tap, durable.get(e.tap, False))]
            if not mine and not evs:
                continue
            nbytes += sum(n for _, n in evs)
            batch = Batch(mine, [e for e, _ in evs], nbytes, seq, wires=mine_wires)
            dropped = sub.put(batch)
            with self._lock:
                self.dropped_total += dropped
                self._order.append((sub, weakref.ref(batch)))
            self.sinks.on_delivery(dropped)
        self._enforce_budget(seq)

    def _enforce_budget(self, seq: int) -> None:
        """Drops the oldest messages server-wide until all queues fit the budget.

        The pass ``seq`` just published is kept whole, so the newest data
        always reaches a subscriber that reads again.
        """
        dropped = 0
        with self._lock:
            while self._order:
                sub, ref = self._order[0]
                batch = ref()
                if batch is None or batch.gone:  # read or dropped by its own queue: nothing to evict
                    self._order.popleft()
                elif batch.seq < seq and self.budget.over():
                    self._order.popleft()
                    dropped += sub.drop_if_oldest(batch)
                else:
                    break
            batch = None  # hold no batch past the loop
            self.budget.dropped += dropped
            self.dropped_total += dropped
        self.sinks.on_budget(dropped, self.budget.held)

    def tap_gone(self, tap_id: str) -> None:
        """A tap was deleted or expired: end the streams that followed only taps now gone.

        Their queued messages (the tap's last event included) are still delivered.
        """
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            if sub.tap_ids is not None and tap_id in sub.tap_ids:
                sub.tap_ids.discard(tap_id)
                if not sub.tap_ids:
                    sub.close()

    def close(self) -> None:
        """Server shutdown: end every subscription now (their streams answer UNAVAILABLE)."""
        with self._lock:
            self.shutting_down = True
            subs, self._subs = self._subs, []
        for sub in subs:
            sub.close()
