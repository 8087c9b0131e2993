"""Summaries off the wire: reducer results, Summary, and one SubscribeResponse at a time.

Kept apart from the tap specs because it is the hot path: a stream converts
every summary of every pass it follows, so each result kind gets a converter
built once (:func:`_result_converter`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._convert_base import field_plan, from_fields, phase_name, point_name
from ._results import RESULTS, ReducerResult
from ._types import Summary, TapEvent
from .v1 import telemetry_pb2

#: ReducerResult oneof field -> result dataclass; each dataclass has the fields of its message.
_RESULT_TYPES: dict[str, type[ReducerResult]] = {r.field: r.type for r in RESULTS}


@functools.cache
def _result_converter(kind: str) -> Callable[[Any], ReducerResult] | None:
    """Builds one kind's result dataclass from its message; None for a kind this client does not know.

    Fields without repeated values are read in one ``attrgetter`` call and
    passed by position (the dataclass and the message share field names).
    """
    found = _RESULT_TYPES.get(kind)
    if found is None:
        return None
    cls: Callable[..., ReducerResult] = found
    descriptor = getattr(telemetry_pb2.ReducerResult(), kind).DESCRIPTOR
    plan = field_plan(cls, descriptor)
    if any(repeated for _, repeated in plan):
        return lambda msg: from_fields(found, msg)
    if len(plan) == 1:
        name = plan[0][0]
        return lambda msg: cls(getattr(msg, name))
    get = operator.attrgetter(*(name for name, _ in plan))
    return lambda msg: cls(*get(msg))


def summary_from_proto(s: telemetry_pb2.Summary) -> Summary:
    """Converts a wire Summary.

    Written out field by field: a stream converts every summary of every pass
    it follows, and this costs a third of the generic :func:`from_fields`
    path (a test compares the two on every field).
    """
    results: dict[str, ReducerResult] = {}
    for r in s.results:
        kind: str | None = r.WhichOneof("value")
        convert = _result_converter(kind) if kind is not None else None
        if kind is not None and convert is not None:  # None: a reducer newer than this client, skipped
            results[kind] = convert(getattr(r, kind))
    wall = s.wall_time
    return Summary(
        tap=s.tap, layer=s.layer, point=point_name(s.point), output_index=s.output_index,
        pass_index=s.pass_index, step=s.step if s.has_step else None,
        wall_time=wall.seconds + wall.nanos / 1e9, unsampled=s.unsampled, results=results,
        call_index=s.call_index, rank=s.rank if s.has_rank else None, output_key=s.output_key,
        phase=phase_name(s.phase), position=s.position if s.has_position else None,
        request_ids=tuple(s.request_ids), throttle=max(1, s.throttle),
    )


@dataclass(frozen=True)
class SubscribeBatch:
    """One decoded SubscribeResponse."""

    summaries: list[Summary]
    events: list[TapEvent]
    dropped: int
    stream_tap_ids: list[str]


def subscribe_batch_from_proto(m: telemetry_pb2.SubscribeResponse) -> SubscribeBatch:
    """Converts a SubscribeResponse."""
    return SubscribeBatch(
        summaries=[summary_from_proto(s) for s in m.summaries],
        events=[from_fields(TapEvent, e) for e in m.events],
        dropped=m.dropped,
        stream_tap_ids=list(m.stream_tap_ids),
    )
