"""``FleetStream``: the members' summary streams merged into one, a thread per member.

Each member's stream is read on its own thread into one bounded queue, so a
member that fails (or is down at the start) ends alone and a slow reader
pushes back on the members instead of growing memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from ._client import Client
from ._errors import LayertapError
from ._fleet_result import FleetError, FleetItem
from ._taps import SummaryStream
from ._types import Summary

__all__ = ["STREAM_BUFFER", "FleetStream"]

#: Batches of summaries the merged stream buffers before its readers push back
#: on the members (each member's server then drops its oldest, counted).
STREAM_BUFFER = 256


class _End:
    """A member stream ended (cleanly or with an error)."""


class FleetStream(Iterator[FleetItem[Summary]]):
    """Every member's summaries, merged in arrival order; iterate for :class:`FleetItem` objects.

    Iteration ends when every member's stream has ended. Close it (or use
    ``with``) to cancel every member's subscription: their stream taps go.

    Attributes:
        errors: Members whose stream failed (down at the start, or later).
    """

    def __init__(self, members: Sequence[tuple[Client, Callable[[], SummaryStream]]],
                 errors: Sequence[FleetError] = ()) -> None:
        self.errors: list[FleetError] = list(errors)
        self._queue: queue.Queue[list[FleetItem[Summary]] | _End] = queue.Queue(STREAM_BUFFER)
        self._buffer: list[FleetItem[Summary]] = []
        self._open = len(members)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._streams: list[SummaryStream] = []
        self._threads = [threading.Thread(target=self._pump, args=m, daemon=True, name=f"layertap-fleet-{m[0].target}")
                         for m in members]
        for t in self._threads:
            t.start()

    @property
    def dropped(self) -> int:
        """Messages the members' servers dropped for this stream so far, all together."""
        with self._lock:
            return sum(s.dropped for s in self._streams)

    def _put(self, item: list[FleetItem[Summary]] | _End) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pump(self, client: Client, start: Callable[[], SummaryStream]) -> None:
        rank: int | None = None
        try:
            stream = start()
            with self._lock:
                self._streams.append(stream)
                if self._closed.is_set():
                    stream.close()
            for batch in stream.batches():
                if batch:
                    rank = batch[0].rank
                    if not self._put([FleetItem(client.target, s.rank, s) for s in batch]):
                        break
        except LayertapError as exc:
            if not self._closed.is_set():
                self.errors.append(FleetError(client.target, rank, exc))
        finally:
            self._put(_End())

    def __iter__(self) -> FleetStream:
        return self

    def __next__(self) -> FleetItem[Summary]:
        while not self._buffer:
            if self._open == 0 or self._closed.is_set():
                raise StopIteration
            try:
                got = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue  # look at _closed again: close() may come from another thread
            if isinstance(got, _End):
                self._open -= 1
            else:
                self._buffer = got[::-1]
        return self._buffer.pop()

    def close(self) -> None:
        """Cancels every member's subscription; idempotent."""
        with self._lock:
            self._closed.set()
            streams = list(self._streams)
        for s in streams:
            s.close()

    def __enter__(self) -> FleetStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
