"""Capture responses parsed without protobuf copying their tensor bytes.

The Capture call uses :func:`parse_response` as its response deserializer.
Parsing a chunk with protobuf copied its bytes twice (into the message, and
out again on each read of ``data``) before the assembler copied them a third
time into the tensor. A chunk message as the server writes it (one ``chunk``
field holding ``tensor_id``, ``chunk_index``, ``offset`` and ``data``, each at
most once, in any order) becomes a :class:`WireChunk` whose ``data`` is a view
of the received bytes, so the assembler's copy into the tensor's buffer is
the only one. Anything else, headers or a chunk encoded in another valid way
(a field repeated, an unknown field, an out-of-range value), goes to the
generated parser: the fields come out as ``CaptureResponse.FromString`` reads
them, and what it refuses is refused as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .v1 import telemetry_pb2

__all__ = ["CaptureMessage", "WireChunk", "parse_response"]

#: Field number -> largest value of the CaptureChunk varint fields (uint32, uint32, uint64).
_VARINT_FIELDS = {1: (1 << 32) - 1, 2: (1 << 32) - 1, 3: (1 << 64) - 1}
_DATA_FIELD = 4
_RESPONSE_CHUNK_TAG = (2 << 3) | 2  # CaptureResponse.chunk, length-delimited
_MAX_VARINT_BYTES = 10


@dataclass(frozen=True, slots=True)
class WireChunk:
    """A ``CaptureChunk`` read in place: ``data`` views the message's bytes."""

    tensor_id: int
    chunk_index: int
    offset: int
    data: memoryview


#: What the Capture call yields: a chunk read in place, or any message parsed by protobuf.
CaptureMessage = Union[WireChunk, telemetry_pb2.CaptureResponse, telemetry_pb2.GetIncidentResponse]


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(value, position after it), or None when no valid varint ends before ``end``."""
    value = shift = 0
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    return None


def _chunk_in_place(raw: bytes) -> WireChunk | None:
    """The chunk that ``raw`` holds in the server's layout, or None to let protobuf parse it."""
    end = len(raw)
    if end < 2 or raw[0] != _RESPONSE_CHUNK_TAG:
        return None
    size = _varint(raw, 1, end)
    if size is None or size[1] + size[0] != end:  # exactly one field, the chunk, spanning the message
        return None
    pos = size[1]
    values = {1: 0, 2: 0, 3: 0}
    seen: set[int] = set()
    data = (pos, pos)
    while pos < end:
        tag = _varint(raw, pos, end)
        if tag is None:
            return None
        number, wire_type = tag[0] >> 3, tag[0] & 7
        read = _varint(raw, tag[1], end)
        if number in seen or read is None:
            return None
        seen.add(number)
        if wire_type == 0 and number in _VARINT_FIELDS and read[0] <= _VARINT_FIELDS[number]:
            values[number], pos = read
        elif wire_type == 2 and number == _DATA_FIELD and read[1] + read[0] <= end:
            data = (read[1], read[1] + read[0])
            pos = data[1]
        else:
            return None
    return WireChunk(values[1], values[2], values[3], memoryview(raw)[data[0]:data[1]])


def parse_response(raw: bytes) -> CaptureMessage:
    """The Capture call's response deserializer (see the module docstring)."""
    chunk = _chunk_in_place(raw)
    return chunk if chunk is not None else telemetry_pb2.CaptureResponse.FromString(raw)
