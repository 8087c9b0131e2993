"""Sinks: everything downstream of the taps that is not a subscriber stream.

The app assembles one :class:`Sinks` and hands it to the publisher (which
the tap engine talks to) and the broker; each consumer (Prometheus export,
drift, the flight recorder) is a :class:`Sink` that overrides only the events
it needs, so the wiring is visible in one place (``layertap.server.app``) and
a new consumer is one ``sinks.add(...)``.

Sinks also answer :meth:`Sink.check_name` and :meth:`Sink.check_spec` before a
tap is created: a stage downstream (drift's reserved names first, then the
recorder's triggers) refuses a spec it cannot serve without the tap engine
importing that stage. The assembler adds the sinks that answer: an engine with
no ``TriggerCheck`` or ``Recorder`` among its sinks does not validate triggers.

Threads: ``on_summaries`` runs on the host-transfer thread, ``on_hook_time``
and ``on_pass_skipped`` on the model thread, the checks and the tap events
on whichever thread changed the tap, and ``on_delivery`` and ``on_budget`` on
the publishing (or unsubscribing) thread. None may block; an event handler that
raises is logged and the others still run, so a broken consumer never stalls
a pass. ``check_spec`` is the exception: its error is the caller's answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

import numpy as np

from layertap.server.host.model_host import PassContext
from layertap.server.reducers.plan import ReducerPlan
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["BasicPiece", "Sink", "Sinks", "TapView"]

log = logging.getLogger(__name__)


class TapView(Protocol):
    """What a sink may read of a tap (``taps.tap.Tap`` is one); stream/ names no type from taps/."""

    @property
    def id(self) -> str: ...

    @property
    def spec(self) -> pb.TapSpec: ...

    @property
    def owner(self) -> str: ...

    @property
    def durable(self) -> bool: ...


class BasicPiece(Protocol):
    """One tensor's basic-only statistics in a pass, as :meth:`Sink.on_basic` reads it (the publisher's ``Piece``)."""

    @property
    def tap(self) -> TapView: ...
    @property
    def layer(self) -> str: ...
    @property
    def output_index(self) -> int: ...
    @property
    def call_index(self) -> int: ...
    @property
    def sampled(self) -> bool: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def plan(self) -> ReducerPlan: ...


class Sink:
    """A consumer of pipeline events; every method is a no-op by default."""

    def check_name(self, name: str, *, owner: str, field: str) -> None:
        """Refuse a tap name for ``owner`` by raising (naming ``field``); runs before anything else is checked."""

    def check_spec(self, spec: pb.TapSpec, *, durable: bool, field_prefix: str) -> None:
        """Refuse ``spec`` by raising (an error naming the field); runs once the spec's own fields are valid."""

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        """All summaries of one finished pass (published to the broker already)."""

    def wants_summaries(self, tap_id: str) -> bool:
        """Whether :meth:`on_summaries` must see this tap's basic pieces as messages now.

        A sink that reads summaries sees every one (the safe default) unless
        the class that reads them also folds :meth:`on_basic` (or a subclass of
        it does): then it says no, so a tap that only it reads costs no
        messages. A subclass that overrides only ``on_summaries`` below one
        that folds ``on_basic`` is sent every summary again.
        """
        reads, folds = _definer(type(self), "on_summaries"), _definer(type(self), "on_basic")
        return reads is not Sink and not issubclass(folds, reads)

    def on_basic(self, ctx: PassContext, pieces: Sequence[tuple[BasicPiece, np.ndarray]]) -> None:
        """A pass's basic-only pieces that no subscriber or sink wanted as messages, with their
        statistics slots (``plan.basic_layout``); published after :meth:`on_summaries`."""

    def on_pass_skipped(self, ctx: PassContext) -> None:
        """A finished pass publishes nothing: no tap fired, or its forward raised."""

    def on_tap_created(self, tap: TapView) -> None:
        """A tap was created (durable or stream)."""

    def on_tap_removed(self, tap: TapView, reason: str) -> None:
        """A tap was deleted, expired or its stream ended."""

    def on_tap_error(self, tap: TapView) -> None:
        """A reducer raised; ``tap`` is now disabled."""

    def on_hook_time(self, seconds: float) -> None:
        """Time the model thread spent in tap hooks during one pass."""

    def on_overhead(self, share: float, floor: float, budget: float, throttled: int) -> None:
        """A budget window ended (``taps.budget``): taps took ``share`` of pass time, ``floor`` of it beyond
        any stride's reach, against ``budget``; ``throttled`` taps are thinned."""

    def on_delivery(self, dropped: int) -> None:
        """One message was queued for a subscriber, ``dropped`` older ones lost."""

    def on_budget(self, dropped: int, held_bytes: int) -> None:
        """The subscribers' byte budget dropped ``dropped`` oldest messages; all queues hold ``held_bytes``."""


def _definer(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose own body defines ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


_S = TypeVar("_S", bound=Sink)


class Sinks(Sink):
    """The assembled set of sinks; dispatches each event to every member."""

    def __init__(self) -> None:
        self._members: tuple[Sink, ...] = ()

    def add(self, sink: _S) -> _S:
        """Add ``sink`` (copy-on-write, so dispatch never takes a lock)."""
        self._members = (*self._members, sink)
        return sink

    def __iter__(self) -> Iterator[Sink]:
        return iter(self._members)

    def _each(self, call: Callable[[Sink], None]) -> None:
        for sink in self._members:
            try:
                call(sink)
            except Exception:  # one broken consumer must not stop the others
                log.exception("sink %s failed", type(sink).__name__)

    def check_name(self, name: str, *, owner: str, field: str) -> None:
        for sink in self._members:  # not _each: a refusal is the answer, not a failure
            sink.check_name(name, owner=owner, field=field)

    def check_spec(self, spec: pb.TapSpec, *, durable: bool, field_prefix: str) -> None:
        for sink in self._members:
            sink.check_spec(spec, durable=durable, field_prefix=field_prefix)

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        self._each(lambda s: s.on_summaries(ctx, summaries))

    def wants_summaries(self, tap_id: str) -> bool:
        for sink in self._members:
            try:
                if sink.wants_summaries(tap_id):
                    return True
            except Exception:  # a broken sink is sent messages: the safe answer, and the pass goes on
                log.exception("sink %s failed", type(sink).__name__)
                return True
        return False

    def on_basic(self, ctx: PassContext, pieces: Sequence[tuple[BasicPiece, np.ndarray]]) -> None:
        """Every sink hears it; then the first failure is raised, so the host-transfer thread counts
        the pass as an error, as it did when a bad value failed the summary that carried it."""
        first: Exception | None = None
        for sink in self._members:
            try:
                sink.on_basic(ctx, pieces)
            except Exception as exc:  # one broken consumer must not stop the others
                log.exception("sink %s failed", type(sink).__name__)
                first = first or exc
        if first is not None:
            raise first

    def on_pass_skipped(self, ctx: PassContext) -> None:
        self._each(lambda s: s.on_pass_skipped(ctx))

    def on_tap_created(self, tap: TapView) -> None:
        self._each(lambda s: s.on_tap_created(tap))

    def on_tap_removed(self, tap: TapView, reason: str) -> None:
        self._each(lambda s: s.on_tap_removed(tap, reason))

    def on_tap_error(self, tap: TapView) -> None:
        self._each(lambda s: s.on_tap_error(tap))

    def on_hook_time(self, seconds: float) -> None:
        self._each(lambda s: s.on_hook_time(seconds))

    def on_overhead(self, share: float, floor: float, budget: float, throttled: int) -> None:
        self._each(lambda s: s.on_overhead(share, floor, budget, throttled))

    def on_delivery(self, dropped: int) -> None:
        self._each(lambda s: s.on_delivery(dropped))

    def on_budget(self, dropped: int, held_bytes: int) -> None:
        self._each(lambda s: s.on_budget(dropped, held_bytes))
