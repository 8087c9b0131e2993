"""``Summary`` messages written as protobuf wire bytes and parsed once.

Why: the host-transfer thread builds every summary of every pass, and it shares
the GIL with the model thread, so its Python time lands on the forward.
Building a summary of four basic reducers from message constructors costs
~10 us (eight messages); writing its bytes from cached pieces and parsing
them with upb costs a few. Field numbers and types come from the generated
descriptors, so nothing here restates the schema. The result is an ordinary
``pb.Summary``: consumers cannot tell the paths apart (a test compares them
byte for byte after a round trip).

A pass's place in a generation (:class:`Place`: phase, position, request
ids) is written once per pass, or once per request for a request's inline
taps, and appended to every summary of it; a plain forward has none and
writes nothing.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.timestamp_pb2 import Timestamp

from layertap.server.host.model_host import PHASE_NONE, PassContext, RequestRows
from layertap.server.protowire import uint64, varint
from layertap.server.reducers.plan import BasicLayout as Layout
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["Place", "SummaryWire", "message_results_bytes", "results_bytes"]

_VARINT, _FIXED64, _LENGTH = 0, 1, 2
_SUMMARY = pb.Summary.DESCRIPTOR.fields_by_name
_RESULTS = pb.ReducerResult.DESCRIPTOR.fields_by_name
_double = struct.Struct("<d").pack
#: Header entries kept at most (one per tap, layer, output, call, sampling and keyword path): thirty
#: subscribers of every layer of a 67-layer model, sampled and not, need 4,020.
MAX_HEADERS = 16384


def timestamp(seconds: float) -> Timestamp:
    """Unix seconds as a ``google.protobuf.Timestamp``."""
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def _unsigned(value: float) -> bytes:
    """A count as a varint; out of range raises (:func:`uint64`)."""
    return varint(uint64(value))


def _key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def _scalar(field: FieldDescriptor, value: float) -> bytes:
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return _key(field.number, _FIXED64) + _double(value)
    return _key(field.number, _VARINT) + varint(int(value))


def _nested(number: int, body: bytes) -> bytes:
    return _key(number, _LENGTH) + varint(len(body)) + body


def _summary_field(name: str, value: object) -> bytes:
    field = _SUMMARY[name]
    if field.type == FieldDescriptor.TYPE_STRING:
        return _nested(field.number, str(value).encode())
    return _scalar(field, value)  # type: ignore[arg-type]


_RESULTS_KEY = _key(_SUMMARY["results"].number, _LENGTH)


@dataclass(frozen=True)
class Place:
    """Where a pass stands in a generation, as ``Summary`` and ``CaptureHeader`` carry it.

    Both messages name the fields alike (``phase``, ``position``,
    ``has_position``, ``request_ids``), so one stamp serves both.
    """

    phase: int
    #: The one position its rows produce, or None.
    position: int | None
    request_ids: tuple[str, ...]

    @classmethod
    def of_pass(cls, ctx: PassContext) -> Place | None:
        """The whole pass's place; None for a plain forward (nothing to write)."""
        if ctx.phase == PHASE_NONE and not ctx.requests:
            return None
        return cls(ctx.phase, ctx.position, tuple(r.request_id for r in ctx.requests))

    @classmethod
    def of_request(cls, ctx: PassContext, rows: RequestRows) -> Place:
        """One request's place in the pass: its own id and, when its rows share one, its position."""
        return cls(ctx.phase, rows.position, (rows.request_id,))

    def stamp(self, msg: pb.Summary | pb.CaptureHeader) -> None:
        msg.phase = pb.Phase.ValueType(self.phase)
        if self.position is not None:
            msg.position, msg.has_position = self.position, True
        msg.request_ids.extend(self.request_ids)

    def wire(self) -> bytes:
        """The fields as ``Summary`` wire bytes, zero values left out as proto3 does."""
        out = _summary_field("phase", self.phase) if self.phase else b""
        if self.position is not None:
            if self.position:
                out += _summary_field("position", self.position)
            out += _summary_field("has_position", 1)
        return out + b"".join([_summary_field("request_ids", r) for r in self.request_ids])


@functools.cache
def _encoder(result_field: str) -> Callable[[Sequence[float]], bytes]:
    """Writes one ``Summary.results`` entry of this oneof field from its field values.

    Every field number here is below 16, so each key is one byte: the doubles
    of a message go out in one ``struct`` call with their keys interleaved,
    counts as varints, and the two length prefixes come from a table (the
    body is never longer than 127 bytes).
    """
    oneof = _RESULTS[result_field]
    assert oneof.message_type is not None, f"{result_field} is not a message field"
    fields = list(oneof.message_type.fields)
    doubles = [f.type == FieldDescriptor.TYPE_DOUBLE for f in fields]
    keys = [f.number << 3 | (_FIXED64 if d else _VARINT) for f, d in zip(fields, doubles)]
    if max(keys) >= 0x80:
        raise ValueError(f"{result_field}: field numbers past 15 need multi-byte keys")
    key = _key(oneof.number, _LENGTH)
    prefix = [_RESULTS_KEY + varint(len(key) + 1 + n) + key + bytes((n,)) for n in range(0x80)]
    if all(doubles):
        pack = struct.Struct("<" + "Bd" * len(fields)).pack
        if len(fields) == 1:
            k0 = keys[0]
            return lambda numbers: prefix[9] + pack(k0, numbers[0])
        if len(fields) == 2:
            k0, k1 = keys
            return lambda numbers: prefix[18] + pack(k0, numbers[0], k1, numbers[1])
    heads = [bytes((k,)) for k in keys]
    if doubles == [False, True, True]:  # moments: count, mean, std
        h0, k1, k2, pack2 = heads[0], keys[1], keys[2], struct.Struct("<BdBd").pack
        return lambda numbers: prefix[19 + len(c := _unsigned(numbers[0]))] + h0 + c + pack2(
            k1, numbers[1], k2, numbers[2])
    if doubles == [True, False]:  # zero_fraction: fraction, count
        k0, h1, pack1 = keys[0], heads[1], struct.Struct("<Bd").pack
        return lambda numbers: prefix[10 + len(c := _unsigned(numbers[1]))] + pack1(k0, numbers[0]) + h1 + c
    if doubles == [False, False]:  # nonfinite: two counts
        h0, h1 = heads

        def counts(numbers: Sequence[float]) -> bytes:
            body = h0 + _unsigned(numbers[0]) + h1 + _unsigned(numbers[1])
            return prefix[len(body)] + body

        return counts

    def encode(numbers: Sequence[float]) -> bytes:
        body = b"".join([h + (_double(v) if d else _unsigned(v)) for h, d, v in zip(heads, doubles, numbers)])
        return prefix[len(body)] + body

    return encode


@functools.lru_cache(maxsize=1024)  # one entry per live plan; bounded as taps come and go
def _plan_encoders(layout: Layout) -> tuple[tuple[Callable[..., tuple[float, ...]], Callable[[Sequence[float]], bytes],
                                                  int, int], ...]:
    return tuple((r.numbers, _encoder(r.result_field), a, b) for r, a, b in layout)


def results_bytes(layout: Layout, slots: Sequence[float], shape: Sequence[int]) -> bytes:
    """Every ``Summary.results`` entry of a basic-only plan (its ``basic_layout``), joined."""
    return b"".join([encode(numbers(slots[a:b], shape)) for numbers, encode, a, b in _plan_encoders(layout)])


def message_results_bytes(results: Sequence[pb.ReducerResult]) -> bytes:
    """``Summary.results`` entries from decoded messages, serialized once: a reduction that thirty taps share
    is written once and its bytes go into each tap's summary."""
    return b"".join([_RESULTS_KEY + varint(len(b)) + b for b in (r.SerializeToString() for r in results)])


class SummaryWire:
    """Writes summaries from cached per-piece headers; one per engine (the host-transfer thread's)."""

    def __init__(self) -> None:
        self._headers: dict[tuple[object, ...], tuple[bytes, bytes]] = {}

    @staticmethod
    def pass_part(pass_index: int, step: int | None, seconds: int, nanos: int) -> bytes:
        """The fields every summary of one pass shares: index, step and wall time."""
        out = _summary_field("pass_index", pass_index)
        if step is not None:
            out += _summary_field("step", step) + _summary_field("has_step", 1)
        ts = pb.Summary.DESCRIPTOR.fields_by_name["wall_time"]
        body = (_key(1, _VARINT) + varint(seconds) if seconds else b"") + (
            _key(2, _VARINT) + varint(nanos) if nanos else b"")
        return out + _nested(ts.number, body)

    @staticmethod
    def rank_part(rank: int | None) -> bytes:
        """The host's rank fields (a training agent's), or nothing."""
        return b"" if rank is None else _summary_field("rank", rank) + _summary_field("has_rank", 1)

    def summary(self, tap: str, layer: str, point: int, output_index: int, call_index: int, unsampled: bool,
                pass_part: bytes, results: bytes, rank_part: bytes = b"", output_key: str = "",
                throttle: int = 1) -> bytes:
        """A ``Summary``'s wire bytes; ``results`` is :func:`results_bytes` of its plan (or
        :func:`message_results_bytes`).

        ``rank_part`` is the summary's tail: a :meth:`Place.wire` (fields 13-16),
        if any, then :meth:`rank_part`'s (20-21); ``throttle`` (22) follows it.
        """
        # Not keyed by the stride: the overhead budget revises it every window, and a key with it missed
        # every header of thirty wide subscribers at once.
        key = (tap, layer, point, output_index, call_index, unsampled, output_key)
        header = self._headers.get(key)
        if header is None:
            if len(self._headers) >= MAX_HEADERS:
                self._headers.clear()
            head = (_summary_field("tap", tap) + _summary_field("layer", layer) + _summary_field("point", point)
                    + _summary_field("output_index", output_index))
            rest = _summary_field("unsampled", unsampled) + _summary_field("call_index", call_index)
            if output_key:  # proto3 writes no empty string: nor do we
                rest += _summary_field("output_key", output_key)
            header = self._headers[key] = (head, rest)
        return header[0] + pass_part + results + header[1] + rank_part + (
            _throttle_part(throttle) if throttle > 1 else b"")


@functools.lru_cache(maxsize=1024)
def _throttle_part(throttle: int) -> bytes:
    return _summary_field("throttle", throttle)
