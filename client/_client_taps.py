"""The tap methods of :class:`~layertap.Client`: durable taps, inline stream taps, subscriptions.

A mixin, so ``Client`` keeps one class with every method while its tap
group (the longest docstrings) lives with its RPC handles; it needs only the
client's transport.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from . import _convert
from ._errors import NotFound
from ._results import RESULTS
from ._taps import DurableTapOptions, SummaryStream, TapHandle, TapOptions, Unpack, tap_spec
from ._transport import Streaming, Transport, Unary
from ._types import TapInfo, TapSpec
from .v1 import telemetry_pb2

__all__ = ["TapMethods"]

LIST_TAPS = Unary.of("TelemetryService", "ListTaps", telemetry_pb2.ListTapsRequest, telemetry_pb2.ListTapsResponse)
CREATE_TAP = Unary.of("TelemetryService", "CreateTap", telemetry_pb2.CreateTapRequest, telemetry_pb2.CreateTapResponse)
DELETE_TAP = Unary.of("TelemetryService", "DeleteTap", telemetry_pb2.DeleteTapRequest, telemetry_pb2.DeleteTapResponse)
SUBSCRIBE = Streaming.of("TelemetryService", "Subscribe", telemetry_pb2.SubscribeRequest, telemetry_pb2.SubscribeResponse)


class TapMethods:
    """``Client``'s taps: list, create, delete, the ``tap`` block, ``watch`` and ``subscribe``."""

    _transport: Transport

    def taps(self, *, timeout: float | None = None) -> list[TapInfo]:
        """Lists durable and stream taps with their kind, counters and expiry."""
        resp = self._transport.unary(LIST_TAPS, telemetry_pb2.ListTapsRequest(), timeout=timeout)
        return [_convert.tap_info_from_proto(t) for t in resp.taps]

    def create_tap(self, selector: str | TapSpec, **options: Unpack[DurableTapOptions]) -> TapInfo:
        """Registers a durable tap.

        Args:
            selector: Exact module name, glob (``layer*``, ``**``) or ``re:`` regex;
                or a whole :class:`TapSpec` (keyword arguments then override it).
            reducers: Names, one per result kind of ``layertap._results.RESULTS``
                ({kinds}), or one-key dicts with
                parameters, e.g. ``{"histogram": {"bins": 32, "min": -4, "max": 4}}``.
                Default: moments, minmax, nonfinite.
            point: ``"output"`` (default), ``"input"``, ``"grad_output"``,
                ``"grad_input"`` or ``"param_grad"``.
            every: Summarize every N-th live pass.
            probability: Summarize a pass with this probability; max_per_second: at most this many per second.
            phases: Only passes of these generation phases (see :class:`TapSpec`).
            keep_padding: Keep ``attention_mask`` padding in the statistics (default: left out).
            name: A label for the tap.
            ttl: Seconds to live (None: the server's default, 10 minutes).
            forever: Keep the tap until deleted.
            timeout: Deadline override in seconds.

        Raises:
            InvalidArgument: Unknown reducer or parameter (checked client-side), bad sampling.
            LayerNotFound: The selector matches no module.
        """
        ttl, forever = options.pop("ttl", None), options.pop("forever", False)
        timeout = options.pop("timeout", None)
        req = _convert.create_tap_request(tap_spec(selector, options), ttl=ttl, forever=forever)
        resp = self._transport.unary(CREATE_TAP, req, timeout=timeout, layer_hint=True)
        return _convert.tap_info_from_proto(resp.tap)

    def delete_tap(self, tap: str | TapInfo | TapHandle, *, timeout: float | None = None) -> None:
        """Removes a durable tap and its hooks.

        Raises:
            NotFound: No tap has this id (it may have expired).
        """
        tap_id = tap if isinstance(tap, str) else tap.id
        self._transport.unary(DELETE_TAP, telemetry_pb2.DeleteTapRequest(id=tap_id), timeout=timeout)

    @contextmanager
    def tap(self, selector: str | TapSpec, **options: Unpack[DurableTapOptions]) -> Iterator[TapHandle]:
        """Creates a durable tap for the duration of a ``with`` block.

        Takes the arguments of :meth:`create_tap`. On exit, however the block
        ends, open subscriptions are cancelled and the tap is deleted (a tap
        that already expired is fine).

        Example:
            >>> with client.tap("layer*", reducers=["moments"], ttl=60) as t:
            ...     for s in t.summaries():
            ...         print(s.layer, s.results["moments"].mean)
        """
        timeout = options.get("timeout")
        info = self.create_tap(selector, **options)
        handle = TapHandle(self, info)
        try:
            yield handle
        finally:
            handle.close()
            if not self._transport.closed:
                try:
                    self.delete_tap(info.id, timeout=timeout)
                except NotFound:
                    pass  # Expired already: the goal is reached.

    def watch(self, selector: str | TapSpec, *, queue_size: int | None = None, timeout: float | None = None,
              **options: Unpack[TapOptions]) -> SummaryStream:
        """Streams summaries from an inline stream tap that lives as long as the stream.

        Args:
            selector: As for :meth:`create_tap`.
            reducers: As for :meth:`create_tap` (default moments, minmax, nonfinite).
            phases: Only passes of these phases (``TapSpec.phases``), e.g. ``["decode"]``.
            keep_padding: Keep padded positions in the statistics (``TapSpec.keep_padding``).
            every: Summarize every N-th live pass.
            point: Where to read the tensor (default ``"output"``).
            probability: Summarize a pass with this probability.
            max_per_second: At most this many summaries per second.
            queue_size: Server-side queue length; a slow reader loses the oldest
                messages, counted in ``stream.dropped``.
            timeout: Deadline in seconds (None: until closed).

        Returns:
            A :class:`SummaryStream`; close it (or use ``with``) to remove the tap.
            A bad selector raises when iteration starts.
        """
        req = _convert.subscribe_request(stream_taps=[tap_spec(selector, options)], queue_size=queue_size)
        return self._subscribe(req, timeout)

    def subscribe(self, tap_ids: str | Sequence[str] = (), *, queue_size: int | None = None,
                  timeout: float | None = None) -> SummaryStream:
        """Follows durable taps (all of them when ``tap_ids`` is empty).

        Args:
            tap_ids: The id of a durable tap to follow, or a list of ids.
            queue_size: Server-side queue length for this subscriber.
            timeout: Deadline in seconds (None: until closed).
        """
        ids = ([tap_ids] if tap_ids else []) if isinstance(tap_ids, str) else tap_ids  # a str is one id; "" is all
        req = _convert.subscribe_request(tap_ids=ids, queue_size=queue_size)
        return self._subscribe(req, timeout)

    def _subscribe(self, req: telemetry_pb2.SubscribeRequest, timeout: float | None) -> SummaryStream:
        t = self._transport
        return SummaryStream(t.stream(SUBSCRIBE, req, timeout=timeout, open_ended=True),
                             lambda: t.translating(layer_hint=True))


# The kinds, from the table: adding a reducer never edits this docstring.
TapMethods.create_tap.__doc__ = (TapMethods.create_tap.__doc__ or "").replace("{kinds}", ", ".join(r.field for r in RESULTS))
