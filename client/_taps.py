"""Taps from the client's side: the keyword options, live summary streams, handles.

The keywords that describe a tap are declared once, as :class:`TapOptions`
(and :class:`DurableTapOptions` for the durable-tap methods), and turned into a
:class:`~layertap.TapSpec` in one place, :func:`tap_spec`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypedDict

from . import _convert
from ._errors import NotFound
from ._types import ReducerSpec, Summary, TapEvent, TapInfo, TapSpec, Triggers

if sys.version_info >= (3, 11):
    from typing import Unpack as Unpack
else:  # pragma: no cover - a dependency on Python 3.10 (pyproject.toml)
    from typing_extensions import Unpack as Unpack

__all__ = ["DurableTapOptions", "SummaryStream", "TapHandle", "TapOptions", "tap_spec"]


class TapOptions(TypedDict, total=False):
    """What a tap reads and how often: keywords of ``watch``, ``create_tap`` and ``tap``.

    Each replaces the same-named field of the :class:`~layertap.TapSpec`
    (None keeps it); see :meth:`layertap.Client.create_tap` for their meaning.
    ``reducers`` also takes the CLI's comma-separated form; ``phases`` takes
    one name as a str.
    """

    reducers: Sequence[ReducerSpec] | str | None
    point: str | None
    every: int | None
    probability: float | None
    max_per_second: float | None
    triggers: Triggers | None
    phases: Sequence[str] | str | None
    keep_padding: bool | None
    derive: str | None


class DurableTapOptions(TapOptions, total=False):
    """:class:`TapOptions` plus the keywords of ``create_tap`` and ``tap``."""

    name: str | None
    ttl: float | None
    forever: bool
    timeout: float | None


_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(TapSpec))


def tap_spec(selector: str | TapSpec, options: Mapping[str, Any]) -> TapSpec:
    """The TapSpec of a selector (or a whole spec) with keyword ``options`` applied.

    Raises:
        TypeError: An option that is not a TapSpec field, as for a bad keyword.
    """
    unknown = sorted(set(options) - _SPEC_FIELDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    spec = TapSpec(selector=selector) if isinstance(selector, str) else selector
    changes = {key: value for key, value in options.items() if value is not None}
    reducers = changes.get("reducers")
    if isinstance(reducers, str):
        # Accept the CLI's "moments,nonfinite" form, and avoid iterating characters.
        changes["reducers"] = [r.strip() for r in reducers.split(",") if r.strip()]
    if "reducers" in changes:
        changes["reducers"] = tuple(changes["reducers"])
    phases = changes.get("phases")
    if phases is not None:
        changes["phases"] = (phases,) if isinstance(phases, str) else tuple(phases)
    return dataclasses.replace(spec, **changes)


class SummaryStream(Iterator[Summary]):
    """A live subscription: iterate it for :class:`Summary` objects.

    The server batches summaries (about one message per pass); iterating
    flattens them. Use :meth:`batches` to see message boundaries, e.g. to
    refresh a display after each. The stream runs until :meth:`close`, the end
    of a ``with`` block, the client's close, or its deadline (which raises
    :class:`~layertap.DeadlineExceeded`).

    Attributes:
        dropped: Messages this subscriber lost so far to its full server-side queue.
        events: The most recent tap events (reducer errors, expiry), oldest first.
        stream_tap_ids: Ids the server gave this subscription's inline taps.
    """

    def __init__(
        self, call: Any, translating: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self._call = call
        self._translating = translating
        self._buffer: deque[Summary] = deque()
        self._closed = False
        self.dropped = 0
        self.events: deque[TapEvent] = deque(maxlen=1000)
        self.stream_tap_ids: list[str] = []

    def __iter__(self) -> SummaryStream:
        return self

    def __next__(self) -> Summary:
        while not self._buffer:
            self._buffer.extend(self._next_message())
        return self._buffer.popleft()

    def batches(self) -> Iterator[list[Summary]]:
        """Yields each stream message's summaries (possibly empty, when only events came)."""
        while True:
            if self._buffer:
                pending = list(self._buffer)
                self._buffer.clear()
                yield pending
            try:
                yield self._next_message()
            except StopIteration:
                return

    def _next_message(self) -> list[Summary]:
        if self._closed:
            raise StopIteration
        try:
            with self._translating():
                msg = next(self._call)
        except StopIteration:
            self._closed = True
            raise
        except Exception:
            if self._closed:  # Our own cancel() surfaces as CANCELLED: a clean end.
                raise StopIteration from None
            self.close()
            raise
        batch = _convert.subscribe_batch_from_proto(msg)
        self.dropped = batch.dropped
        self.events.extend(batch.events)
        if batch.stream_tap_ids:
            self.stream_tap_ids = batch.stream_tap_ids
        return batch.summaries

    def close(self) -> None:
        """Cancels the subscription; the server removes its stream taps."""
        if not self._closed:
            self._closed = True
            self._call.cancel()

    def __enter__(self) -> SummaryStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TapOwner(Protocol):
    """What a :class:`TapHandle` uses of its :class:`~layertap.Client`."""

    def taps(self, *, timeout: float | None = None) -> list[TapInfo]: ...

    def subscribe(
        self, tap_ids: Sequence[str] = (), *, queue_size: int | None = None, timeout: float | None = None
    ) -> SummaryStream: ...


class TapHandle:
    """A durable tap created by :meth:`Client.tap`; deleted when the block exits.

    Attributes:
        info: The tap as the server reported it at creation.
    """

    def __init__(self, client: TapOwner, info: TapInfo) -> None:
        self._client = client
        self.info = info
        self._streams: list[SummaryStream] = []

    @property
    def id(self) -> str:
        """The tap's server-assigned id."""
        return self.info.id

    def summaries(
        self, *, timeout: float | None = None, queue_size: int | None = None
    ) -> SummaryStream:
        """Subscribes to this tap.

        Args:
            timeout: Seconds until the stream's deadline (None: no deadline).
            queue_size: Server-side queue length for this subscriber.
        """
        stream = self._client.subscribe([self.id], queue_size=queue_size, timeout=timeout)
        self._streams.append(stream)
        return stream

    def refresh(self) -> TapInfo:
        """Fetches the tap's current counters (hits, drops, errors).

        Raises:
            NotFound: The tap expired or was deleted.
        """
        for info in self._client.taps():
            if info.id == self.id:
                self.info = info
                return info
        raise NotFound(f"tap {self.id!r} no longer exists (expired or deleted)")

    def close(self) -> None:
        """Cancels every subscription opened through this handle."""
        for stream in self._streams:
            stream.close()
        self._streams.clear()


