"""``Summary`` messages of basic-only plans, written as protobuf wire bytes and parsed once.

Why: the collector thread builds every summary of every pass, and it shares
the GIL with the model thread, so its Python time lands on the forward.
Building a summary of four basic reducers from message constructors costs
~10 us (eight messages); writing its bytes from cached pieces and parsing
them with upb costs a few. Field numbers and types come from the generated
descriptors, so nothing here restates the schema. The result is an ordinary
``pb.Summary``: consumers cannot tell the paths apart (a test compares them
byte for byte after a round trip).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence

from google.protobuf.descriptor import FieldDescriptor

from layertap.server.reducers.basic import BasicReducer
from layertap.server.taps.capture_wire import varint
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["SummaryWire", "result_bytes"]

_VARINT, _FIXED64, _LENGTH = 0, 1, 2
_SUMMARY = pb.Summary.DESCRIPTOR.fields_by_name
_RESULTS = pb.ReducerResult.DESCRIPTOR.fields_by_name
_double = struct.Struct("<d").pack
#: Header entries kept at most (one per tap, layer, output, call and sampling).
MAX_HEADERS = 4096


def _unsigned(value: float) -> bytes:
    """A count as a varint; out of range raises, as the message constructors do (never wraps)."""
    n = int(value)
    if not 0 <= n < 1 << 64:
        raise ValueError(f"count out of range for uint64: {n}")
    return varint(n)


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


@functools.cache
def _encoder(result_field: str) -> Callable[[Sequence[float]], bytes]:
    """Writes one ``Summary.results`` entry of this oneof field from its field values."""
    oneof = _RESULTS[result_field]
    key = _key(oneof.number, _LENGTH)
    fields = [(_key(f.number, _FIXED64 if f.type == FieldDescriptor.TYPE_DOUBLE else _VARINT),
               f.type == FieldDescriptor.TYPE_DOUBLE) for f in oneof.message_type.fields]

    def encode(numbers: Sequence[float]) -> bytes:
        body = b"".join([k + (_double(v) if double else _unsigned(v)) for (k, double), v in zip(fields, numbers)])
        inner = key + varint(len(body)) + body
        return _RESULTS_KEY + varint(len(inner)) + inner

    return encode


def result_bytes(reducer: BasicReducer, values: Sequence[float], shape: Sequence[int]) -> bytes:
    """One ``Summary.results`` entry, as wire bytes, from the reducer's host slots."""
    return _encoder(reducer.result_field)(reducer.numbers(values, shape))


class SummaryWire:
    """Writes summaries from cached per-piece headers; one per engine (the collector thread's)."""

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
                pass_part: bytes, results: bytes, rank_part: bytes = b"") -> pb.Summary:
        """A parsed ``Summary``; ``results`` is :func:`result_bytes` of each reducer, joined."""
        key = (tap, layer, point, output_index, call_index, unsampled)
        header = self._headers.get(key)
        if header is None:
            if len(self._headers) >= MAX_HEADERS:
                self._headers.clear()
            head = (_summary_field("tap", tap) + _summary_field("layer", layer) + _summary_field("point", point)
                    + _summary_field("output_index", output_index))
            rest = _summary_field("unsampled", unsampled) + _summary_field("call_index", call_index)
            header = self._headers[key] = (head, rest)
        return pb.Summary.FromString(header[0] + pass_part + results + header[1] + rank_part)
