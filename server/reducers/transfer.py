"""The asynchronous device-to-host path for a pass's reducer outputs.

During a forward pass each tap adds its reducer slots (1-D float64 device
tensors) to a :class:`PassBuffer`. At the end of the pass :meth:`PassBuffer.finish`
concatenates them into one device buffer per device and, on CUDA, starts ONE
non-blocking copy into pinned host memory and records an event: the model
thread never waits. A :class:`HostTransfer` thread waits for the event and
hands the host values to a callback (decode, broker, metrics) off the model
thread; :meth:`HostTransfer.stats` reports its counts for self-metrics. The
backlog waiting for that thread is bounded in passes and in bytes
(:data:`DEFAULT_TRANSFER_BYTES`, ``--transfer-queue-bytes``): a pass of a
wide tap holds megabytes, so a count alone let a stalled thread hold gigabytes.

    buf = PassBuffer()
    buf.add(("tap1", "layer1"), plan.run(x))
    transfer.submit(buf.finish(), on_values)   # on_values({key: np.ndarray})
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from layertap.server.host.priority import telemetry_thread

__all__ = ["DEFAULT_TRANSFER_BYTES", "HostTransfer", "PassBuffer", "PendingPass", "PinnedPool", "TransferStats", "ValuesCallback"]

_log = logging.getLogger(__name__)

#: Bytes of pass values the transfer backlog may hold by default (``--transfer-queue-bytes``).
DEFAULT_TRANSFER_BYTES = 64 << 20

#: Receives each key's float64 host values for one pass.
ValuesCallback = Callable[[dict[Hashable, np.ndarray]], None]


class PinnedPool:
    """Reusable host buffers (pinned when CUDA is available) for the copies.

    A buffer goes back to the pool with the event of the copy into it and is
    handed out again only once that event has completed, so a dropped pass
    whose copy is still in flight never has its memory reused early. Capacities
    are rounded up to powers of two so passes of similar size share buffers.

    Args:
        max_free: Free buffers kept; more are released to the allocator.
        pin: Pin the buffers; defaults to ``torch.cuda.is_available()``.
    """

    def __init__(self, max_free: int = 8, pin: bool | None = None) -> None:
        self.max_free = max_free
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._lock = threading.Lock()
        self.allocations = 0

    def acquire(self, n: int) -> torch.Tensor:
        """Returns a free float64 host buffer of exactly ``n`` elements (a view)."""
        with self._lock:
            for i, (buf, event) in enumerate(self._free):
                if buf.numel() >= n and (event is None or event.query()):  # type: ignore[no-untyped-call]  # unannotated in torch
                    del self._free[i]
                    return buf[:n]
        capacity = 1 << max(n - 1, 0).bit_length()
        self.allocations += 1
        return torch.empty(capacity, dtype=torch.float64, pin_memory=self.pin)[:n]

    def release(self, buf: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        """Returns a buffer from :meth:`acquire`; ``event`` guards its last copy."""
        base = buf._base if buf._base is not None else buf
        with self._lock:
            if len(self._free) < self.max_free:
                self._free.append((base, event))


_DEFAULT_POOL: PinnedPool | None = None
_DEFAULT_POOL_LOCK = threading.Lock()


def _default_pool() -> PinnedPool:
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None:
            _DEFAULT_POOL = PinnedPool()
        return _DEFAULT_POOL


#: What a segment holds once its values are read or discarded.
_NO_VALUES = torch.empty(0, dtype=torch.float64)


@dataclass
class _Segment:
    """One device's share of a pass: where its values land in the host array."""

    start: int
    device_values: torch.Tensor  # kept alive until the copy completes
    host: torch.Tensor | None  # pinned buffer (CUDA) or None (values already on host)
    event: torch.cuda.Event | None


class PendingPass:
    """A pass's values on their way to the host.

    Attributes:
        slices: Each key's slice of the array returned by :meth:`wait`.
    """

    def __init__(self, segments: list[_Segment], slices: dict[Hashable, slice], size: int,
                 pool: PinnedPool | None) -> None:
        self.slices = slices
        self._segments = segments
        self._size = size
        self._pool = pool
        self._values: np.ndarray | None = None
        self._discarded = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Host bytes of the pass's values, what the backlog's byte bound counts."""
        return self._size * 8

    def ready(self) -> bool:
        """Whether :meth:`wait` would return without blocking."""
        return all(s.event is None or s.event.query() for s in self._segments)  # type: ignore[no-untyped-call]  # unannotated in torch

    def wait(self) -> np.ndarray:
        """Blocks until the copies land; returns all values as one float64 array.

        The array is a private copy, so the pinned buffers go straight back to
        the pool. Safe to call more than once.

        Raises:
            RuntimeError: If the pass was discarded before it was read.
        """
        with self._lock:
            if self._values is None:
                if self._discarded:
                    raise RuntimeError("this pass was discarded; its values are gone")
                segments = self._segments
                if len(segments) == 1 and segments[0].host is None and segments[0].device_values.is_cpu:
                    # A CPU pass (the common case on a CPU host): its values, copied in one call. Why:
                    # this thread runs beside a model that streams its weights through the caches, so
                    # every extra call here costs tens of microseconds, and holds the GIL meanwhile.
                    self._values = segments[0].device_values.numpy().copy()
                else:
                    out = np.empty(self._size, dtype=np.float64)
                    for seg in segments:
                        if seg.event is not None:
                            seg.event.synchronize()
                        src = seg.host if seg.host is not None else seg.device_values
                        out[seg.start : seg.start + src.numel()] = src.numpy()
                    self._values = out
                self._release()
            return self._values

    def values_by_key(self) -> dict[Hashable, np.ndarray]:
        """Waits, then splits the values by key (views into one array)."""
        values = self.wait()
        return {key: values[sl] for key, sl in self.slices.items()}

    def discard(self) -> None:
        """Gives the host buffers back unread (a dropped pass); never blocks."""
        with self._lock:
            if self._values is None:
                self._discarded = True
            self._release()

    def _release(self) -> None:
        for seg in self._segments:
            if seg.host is not None and self._pool is not None:
                # The event keeps the pool from reusing memory a copy may still write.
                self._pool.release(seg.host, seg.event)
            seg.host = None
            seg.device_values = _NO_VALUES  # the pass's device memory goes now, not with the last reference to it


class PassBuffer:
    """Collects one pass's reducer outputs for a single device-to-host transfer.

    Args:
        pool: Host buffer pool shared across passes (one per server).
    """

    def __init__(self, pool: PinnedPool | None = None) -> None:
        self._pool = pool if pool is not None else _default_pool()
        #: What was added, in order: a 1-D tensor and its keys, or a 2-D block and each row's keys.
        self._entries: list[tuple[torch.Tensor, Sequence[Sequence[Hashable]]]] = []
        self._keys: set[Hashable] = set()
        #: A 1-D tensor added under several keys (a reduction taps share, ``taps.reuse``): its keys' list.
        self._shared: dict[int, list[Hashable]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable, values: torch.Tensor) -> None:
        """Adds a key's 1-D float64 values (on any device). The same tensor added again under another key
        (taps sharing a reduction) is copied once: both keys read one slice.

        Raises:
            ValueError: If the key was already added or the tensor is not 1-D float64.
        """
        if values.dtype != torch.float64 or values.dim() != 1:
            raise ValueError(f"expected a 1-D float64 tensor, got {values.dtype} of shape {list(values.shape)}")
        if key in self._keys:
            raise ValueError(f"key {key!r} was already added to this pass")
        self._keys.add(key)
        keys = self._shared.get(id(values))  # the entry holds the tensor, so its id is not reused meanwhile
        if keys is not None:
            keys.append(key)  # copied once: every key reads the same slice
            return
        keys = self._shared[id(values)] = [key]
        self._entries.append((values, (keys,)))

    def add_rows(self, keys: Sequence[Sequence[Hashable]], values: torch.Tensor) -> None:
        """Adds a ``(rows, width)`` float64 block: row ``i`` is the values of every key in ``keys[i]``.

        Why: a pass's batched statistics come out as one block; adding it whole
        spares a split into rows and the concatenation back at :meth:`finish`.

        Raises:
            ValueError: If a key was already added, the tensor is not 2-D
                float64, or ``keys`` does not give one entry per row.
        """
        if values.dtype != torch.float64 or values.dim() != 2 or values.shape[0] != len(keys):
            raise ValueError(f"expected a 2-D float64 tensor of {len(keys)} rows, got {values.dtype} of shape "
                             f"{list(values.shape)}")
        self._claim([k for row in keys for k in row])
        self._entries.append((values, keys))

    def _claim(self, keys: Sequence[Hashable]) -> None:
        taken = self._keys.intersection(keys)
        if taken or len(set(keys)) != len(keys):
            raise ValueError(f"key {next(iter(taken), keys)!r} was already added to this pass")
        self._keys.update(keys)

    def finish(self) -> PendingPass:
        """Starts the transfer and returns the pending pass; the buffer is emptied.

        Never blocks on the device: on CUDA the copy is ``non_blocking`` into
        pinned memory, followed by an event on the current stream.
        """
        entries, self._entries, self._keys, self._shared = self._entries, [], set(), {}
        by_device: dict[torch.device, list[tuple[torch.Tensor, Sequence[Sequence[Hashable]]]]] = {}
        for t, keys in entries:
            by_device.setdefault(t.device, []).append((t, keys))
        slices: dict[Hashable, slice] = {}
        segments: list[_Segment] = []
        start = 0
        for device, items in by_device.items():
            seg_start = start
            for t, keys in items:
                width = t.shape[-1]
                for row in keys:
                    for key in row:
                        slices[key] = slice(start, start + width)
                    start += width
            flat = torch.cat([t if t.dim() == 1 else t.reshape(-1) for t, _ in items]) if len(items) > 1 \
                else items[0][0].reshape(-1)
            host: torch.Tensor | None = None
            event: torch.cuda.Event | None = None
            if device.type == "cuda":
                host = self._pool.acquire(flat.numel())
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
                event.record(torch.cuda.current_stream(device))
            elif device.type != "cpu":
                # Other accelerators: a plain copy (may sync; no event API assumed).
                flat = flat.to("cpu")
            segments.append(_Segment(seg_start, flat, host, event))
        return PendingPass(segments, slices, start, self._pool)


@dataclass
class _Job:
    pending: PendingPass
    callback: ValuesCallback
    seq: int
    on_drop: Callable[[], None] | None = None


@dataclass(frozen=True)
class TransferStats:
    """Cumulative counts of a :class:`HostTransfer`, read at one instant."""

    #: Passes whose callback ran without raising.
    processed: int
    #: Passes pushed out of the full queue before the thread took them.
    dropped: int
    #: Passes whose callback raised.
    errors: int
    #: Host buffers the pinned pool has allocated (reuses are not counted).
    pinned_allocations: int
    #: Bytes of pass values queued or being handled now (a gauge, unlike the rest).
    held_bytes: int = 0


class HostTransfer:
    """A daemon thread that turns pending passes into callbacks, in order.

    The queue is bounded in passes and in bytes (:attr:`PendingPass.nbytes`)
    and never blocks the model thread: past either bound the oldest pending
    passes are dropped and counted. The bytes count the batch the thread is
    handling too, so the backlog holds at most ``max_bytes`` plus the newest
    pass, which is always kept. Callback errors are logged and counted, never
    raised into the submitter.

    Args:
        maxsize: Pending passes held at most.
        max_bytes: Bytes of pass values held at most (queued and in hand).
        name: Thread name.
        pool: The pool the submitted passes' buffers come from, for
            :meth:`stats`; defaults to the one :class:`PassBuffer` shares.
    """

    def __init__(self, maxsize: int = 256, name: str = "layertap-host-transfer",
                 pool: PinnedPool | None = None, max_bytes: int = DEFAULT_TRANSFER_BYTES) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        if max_bytes < 1:
            raise ValueError(f"--transfer-queue-bytes {max_bytes}: must be at least 1")
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._queued_bytes = 0
        self._busy_bytes = 0  # the batch the thread has in hand
        self._pool = pool
        self._queue: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._submitted = 0
        self._busy_seq: int | None = None  # job the thread is running
        self._closed = False
        self.processed = 0
        self.dropped = 0
        self.errors = 0
        self.last_error: str | None = None
        self._thread = telemetry_thread(self._run, name)  # yields the CPU to the model (see host.priority)
        self._thread.start()

    def __enter__(self) -> HostTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> TransferStats:
        """The counts so far, consistent with each other; never blocks on a callback."""
        pool = self._pool if self._pool is not None else _default_pool()
        with self._cond:
            return TransferStats(self.processed, self.dropped, self.errors, pool.allocations,
                                 self._queued_bytes + self._busy_bytes)

    def pending(self) -> int:
        """Passes queued and not yet taken by the thread."""
        with self._cond:
            return len(self._queue)

    def submit(self, pending: PendingPass, callback: ValuesCallback,
               on_drop: Callable[[], None] | None = None) -> bool:
        """Queues a pass; ``callback`` later gets its values by key on the transfer thread.

        ``on_drop`` is called (on the submitting thread) if this pass is later
        pushed out of a full queue before the thread takes it.

        Returns:
            False when older passes had to be dropped to make room.

        Raises:
            RuntimeError: After :meth:`close`.
        """
        dropped: list[_Job] = []
        nbytes = pending.nbytes
        with self._cond:
            if self._closed:
                raise RuntimeError("host-transfer thread is closed")
            while self._queue and (len(self._queue) >= self.maxsize
                                   or self._queued_bytes + self._busy_bytes + nbytes > self.max_bytes):
                old = self._queue.popleft()
                self._queued_bytes -= old.pending.nbytes
                dropped.append(old)
            self.dropped += len(dropped)
            self._submitted += 1
            self._queue.append(_Job(pending, callback, self._submitted, on_drop))
            self._queued_bytes += nbytes
            self._cond.notify_all()
        for old in dropped:
            old.pending.discard()
            if old.on_drop is not None:
                try:
                    old.on_drop()
                except Exception:  # noqa: BLE001 - accounting must not fail the model thread
                    _log.exception("host-transfer on_drop callback failed")
        return not dropped

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every pass submitted so far was handled (or dropped).

        Returns:
            True if done, False on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._submitted
            while not self._handled(target):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                if not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
            return True

    def _handled(self, seq: int) -> bool:
        # FIFO: every job up to `seq` is handled once none is queued or running.
        queued = bool(self._queue) and self._queue[0].seq <= seq
        running = self._busy_seq is not None and self._busy_seq <= seq
        return not queued and not running

    def close(self, timeout: float | None = None) -> None:
        """Stops accepting passes, drains the queue and joins the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                # Every pass queued so far, in one go: one lock round trip and
                # one flush notification per batch, not per pass.
                jobs = list(self._queue)
                self._queue.clear()
                self._busy_bytes, self._queued_bytes = self._queued_bytes, 0
                self._busy_seq = jobs[0].seq  # the oldest running: flush waits for the whole batch
            for job in jobs:
                self._handle(job)
            del jobs, job  # before the bytes are given back: nothing of the batch stays referenced
            with self._cond:
                self._busy_seq = None
                self._busy_bytes = 0
                self._cond.notify_all()

    def _handle(self, job: _Job) -> None:
        error: str | None = None
        try:
            job.callback(job.pending.values_by_key())
        except Exception as exc:  # noqa: BLE001 - the model thread must never see these
            _log.exception("host-transfer callback failed")
            error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            if error is None:
                self.processed += 1
            else:
                self.errors += 1
                self.last_error = error
