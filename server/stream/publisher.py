"""The one place a pass's host values become summaries for subscribers and sinks.

The tap engine hands over what its hooks left in a pass buffer (the pieces
and, on the host-transfer thread, their values) and tap events; it never gets
summaries back. The publisher builds the ``Summary`` messages, gives them to
the broker (subscribers) and then to every sink (metrics, drift, recorder),
in that order, so a stream never lags the metrics it explains.

Every summary carries its pass's place in a generation (``phase``,
``position``, ``request_ids``): the whole pass's for a tap that sees the
whole batch, its own request's for a request's inline tap (a piece with
``request``). A plain forward has no place and pays nothing for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from layertap.server.host.model_host import PassContext, RequestRows
from layertap.server.reducers.latency import Lap, fill_latency
from layertap.server.reducers.plan import ReducerPlan
from layertap.server.stream.broker import Broker
from layertap.server.stream.sinks import Sinks, TapView
from layertap.server.stream.summary_wire import Place, SummaryWire, message_results_bytes, results_bytes, timestamp
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["Piece", "PublishedTap", "Publisher"]


class PublishedTap(TapView, Protocol):
    """A tap as the publisher sees it: read, plus its hit counter and disabled flag."""

    hits: int

    @property
    def disabled(self) -> bool: ...

    @property
    def throttle(self) -> int:
        """The overhead budget's stride (``taps.budget``): 1 in this many of its sampled passes."""

    #: Host-transfer-thread seconds spent publishing its sampled pieces and its unsampled ones (the
    #: overhead budget's figures; this thread is their only writer). It holds the GIL the model thread
    #: needs, so it counts against the budget.
    published_seconds: float
    published_always_seconds: float


#: The tap type of a :class:`Piece`: the engine's own ``Tap``, read here as a :class:`PublishedTap`.
_TapT = TypeVar("_TapT", bound=PublishedTap, covariant=True)


@dataclass(slots=True)  # one per tensor per pass, built on the model thread
class Piece(Generic[_TapT]):
    """One tensor a hook reduced in a pass: where it came from and how to read its values."""

    tap: _TapT
    layer: str
    output_index: int
    call_index: int
    shape: tuple[int, ...]
    plan: ReducerPlan
    sampled: bool
    lap: Lap | None = None
    #: The keyword path of a keyword argument's tensor (``position_embeddings.0``), else "".
    output_key: str = ""
    #: A request's inline tap reduced only these rows of the pass: its summary names that request alone.
    request: RequestRows | None = None


def _charge(pieces: Sequence[Piece[PublishedTap]], built: Mapping[tuple[int, bool], float], seconds: float) -> None:
    """Books a pass's publishing time to its taps, sampled pieces and unsampled apart: what building
    their messages took, and the rest (the broker's fan-out, the sinks) in proportion to their pieces."""
    counts: dict[tuple[int, bool], tuple[PublishedTap, int]] = {}
    for p in pieces:
        key = (id(p.tap), p.sampled)
        tap, n = counts.get(key, (p.tap, 0))
        counts[key] = (tap, n + 1)
    rest = max(0.0, seconds - sum(built.values())) / max(1, len(pieces))
    for key, (tap, n) in counts.items():
        if key[1]:
            tap.published_seconds += built.get(key, 0.0) + rest * n
        else:
            tap.published_always_seconds += built.get(key, 0.0) + rest * n


class Publisher:
    """Turns pass values into summaries; hands them and tap events to the broker and the sinks.

    Args:
        broker: The subscribers' fan-out.
        sinks: Every other consumer; the app assembles them.
    """

    def __init__(self, broker: Broker | None = None, sinks: Sinks | None = None) -> None:
        self.broker = broker if broker is not None else Broker()
        self.sinks = sinks if sinks is not None else Sinks()
        self._wire = SummaryWire()

    # -- host-transfer thread ----------------------------------------------------
    def publish(self, ctx: PassContext, pieces: Sequence[Piece[PublishedTap]], values: Mapping[Hashable, np.ndarray],
                durable: Callable[[], Mapping[str, bool]], rank: int | None) -> None:
        """Publish one pass: ``values[i]`` is the host copy of ``pieces[i]``'s reducer vector.

        A basic-only piece (the common case) becomes a ``Summary`` only when a
        subscriber or a sink reads its tap's messages; otherwise the sinks
        get its values (:meth:`Sink.on_basic`), which is what a durable tap
        that only feeds ``/metrics`` costs per pass.

        Args:
            durable: The live taps' durability, read now: a tap deleted since the
                pass is no longer "durable" to all-durable subscribers.
            rank: The training rank stamped on every summary, or None.
        """
        live = dict(durable())
        # Basic pieces of taps no one reads as messages: the sinks fold their values themselves.
        basic: list[tuple[Piece[PublishedTap], np.ndarray]] = []
        build: list[int] = []
        wanted: dict[str, bool] = {}
        seen: set[str] = set()
        for i, p in enumerate(pieces):
            tap = p.tap
            if tap.disabled:
                continue  # its pieces in this pass are partial
            if p.sampled and tap.id not in seen:
                seen.add(tap.id)
                tap.hits += 1
            if p.plan.basic_layout is not None and p.lap is None:
                want = wanted.get(tap.id)
                if want is None:
                    want = wanted[tap.id] = (self.broker.wants(tap.id, live.get(tap.id, False))
                                             or self.sinks.wants_summaries(tap.id))
                if not want:
                    basic.append((p, values[i]))
                    continue
            build.append(i)
        start = time.perf_counter()
        built: dict[tuple[int, bool], float] = {}  # seconds building messages, by (id(tap), sampled)
        summaries, wires = self._summaries(ctx, [pieces[i] for i in build], [values[i] for i in build], rank,
                                           built) if build else ([], [])
        try:
            self.broker.publish(summaries, live, wires=wires)
            self.sinks.on_summaries(ctx, summaries)
            if basic:
                self.sinks.on_basic(ctx, basic)
        finally:
            _charge(pieces, built, time.perf_counter() - start)

    def _summaries(self, ctx: PassContext, pieces: Sequence[Piece[PublishedTap]], values: Sequence[np.ndarray],
                   rank: int | None, built: dict[tuple[int, bool], float]) -> tuple[list[pb.Summary], list[bytes]]:
        """The messages of these pieces of one pass and their wire bytes, with the pass's fields written once;
        the seconds spent on each tap's go to ``built`` (by ``(id(tap), sampled)``).

        The bytes go to the subscribers' streams as they are (``Broker.publish``): a reduction that thirty
        taps share is decoded and serialized once, and each tap's summary only adds its own header.
        """
        wall = timestamp(ctx.wall_time)
        pass_part = SummaryWire.pass_part(ctx.index, ctx.step, wall.seconds, wall.nanos)
        rank_part = SummaryWire.rank_part(rank)
        place = Place.of_pass(ctx)
        # The tail after a summary's own fields: its place in a generation, then the rank.
        tail = rank_part if place is None else place.wire() + rank_part
        # A request's place and tail, made once per pass for its inline taps' pieces.
        own: dict[str, tuple[Place, bytes]] = {}
        summaries, wires = [], []
        # Results decoded and serialized once per shared reduction (taps.reuse: one slice of the pass for
        # every tap that shares it, reducers.transfer), so thirty identical subscribers cost what one does.
        decoded: dict[Hashable, bytes] = {}
        clock = time.perf_counter
        last = clock()
        for p, vec in zip(pieces, values):
            piece_tail = tail
            if p.request is not None:
                mine = own.get(p.request.request_id)
                if mine is None:
                    at = Place.of_request(ctx, p.request)
                    mine = own[p.request.request_id] = (at, at.wire() + rank_part)
                piece_tail = mine[1]
            layout = p.plan.basic_layout
            if p.lap is not None:  # timed: its own results, built as messages
                summary = self._summary(ctx, p, wall, p.plan.decode(vec, p.shape), rank,
                                        place if p.request is None else own[p.request.request_id][0])
                wire = summary.SerializeToString()
            else:
                if layout is not None:  # the common case: see summary_wire
                    results = results_bytes(layout, vec.tolist(), p.shape)
                else:
                    # Only here: decoding costs many times what keying it does, and basic pieces' bytes
                    # cost no more.
                    shared = None if p.plan.reuse_key is None else \
                        (vec.__array_interface__["data"][0], vec.size, p.shape, p.plan.reuse_key)
                    once = None if shared is None else decoded.get(shared)
                    if once is None:
                        once = message_results_bytes(p.plan.decode(vec, p.shape))
                        if shared is not None:
                            decoded[shared] = once
                    results = once
                wire = self._wire.summary(p.tap.id, p.layer, p.tap.spec.point, p.output_index, p.call_index,
                                          not p.sampled, pass_part, results, piece_tail, p.output_key,
                                          p.tap.throttle)
                summary = pb.Summary.FromString(wire)
            summaries.append(summary)
            wires.append(wire)
            now = clock()
            key = (id(p.tap), p.sampled)
            built[key] = built.get(key, 0.0) + now - last
            last = now
        return summaries, wires

    @staticmethod
    def _summary(ctx: PassContext, p: Piece[PublishedTap], wall: Timestamp, results: list[pb.ReducerResult],
                 rank: int | None, place: Place | None = None) -> pb.Summary:
        """A summary built from messages (``results``, the piece's decoded values): plans with distribution
        or latency reducers."""
        if p.lap is not None:
            fill_latency(results, p.lap)
        summary = pb.Summary(
            tap=p.tap.id, layer=p.layer, point=p.tap.spec.point, output_index=p.output_index,
            pass_index=ctx.index, wall_time=wall, results=results,
            unsampled=not p.sampled, call_index=p.call_index, output_key=p.output_key,
        )
        if ctx.step is not None:
            summary.step = ctx.step
            summary.has_step = True
        if place is not None:
            place.stamp(summary)
        if rank is not None:
            summary.rank, summary.has_rank = rank, True
        if p.tap.throttle > 1:
            summary.throttle = p.tap.throttle
        return summary

    # -- tap events (any thread) ---------------------------------------------------
    def event(self, tap: TapView, kind: str, message: str) -> None:
        """Tell the tap's subscribers now (the broker never blocks)."""
        self.broker.publish([], {tap.id: tap.durable}, [pb.TapEvent(tap=tap.id, kind=kind, message=message)])

    def tap_created(self, tap: TapView) -> None:
        self.sinks.on_tap_created(tap)

    def tap_removed(self, tap: TapView, reason: str) -> None:
        """Sinks first, then the subscribers' event, then their streams of it end."""
        self.sinks.on_tap_removed(tap, reason)
        self.event(tap, reason, f"tap {reason}")
        self.broker.tap_gone(tap.id)

    def tap_failed(self, tap: TapView, message: str) -> None:
        self.sinks.on_tap_error(tap)
        self.event(tap, "disabled", message)
