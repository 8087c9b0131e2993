"""The Capture deserializer reads what ``CaptureResponse.FromString`` reads, chunk data in place.

Whatever the bytes (the server's layout, another valid encoding, garbage),
``parse_response`` must give the same fields as the generated parser, or
fail where it fails; and the assembler must land each chunk in its tensor's
buffer with a single copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from layertap import _capture as capture
from layertap._capture_wire import WireChunk, parse_response
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

UINT32 = st.integers(0, (1 << 32) - 1)
UINT64 = st.integers(0, (1 << 64) - 1)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint((number << 3) | wire_type) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _fields(msg: Any) -> Any:
    """Comparable content of a parse result, whichever parser made it."""
    if isinstance(msg, WireChunk):
        return ("chunk", msg.tensor_id, msg.chunk_index, msg.offset, bytes(msg.data))
    kind = msg.WhichOneof("payload")
    if kind == "chunk":
        c = msg.chunk
        return ("chunk", c.tensor_id, c.chunk_index, c.offset, c.data)
    return (kind, msg.SerializeToString(deterministic=True))


def _same_as_protobuf(raw: bytes) -> None:
    try:
        want = _fields(pb.CaptureResponse.FromString(raw))
    except DecodeError:
        with pytest.raises(DecodeError):
            parse_response(raw)
        return
    assert _fields(parse_response(raw)) == want


# Chunk fields in any order, some repeated, some left out, unknown ones mixed in, odd widths.
_chunk_field = st.one_of(
    st.tuples(st.sampled_from([1, 2]), st.integers(0, (1 << 33))).map(lambda f: _field(f[0], 0, _varint(f[1]))),
    st.integers(0, (1 << 64) + 5).map(lambda v: _field(3, 0, _varint(v))),
    st.binary(max_size=40).map(lambda d: _field(4, 2, _varint(len(d)) + d)),
    st.binary(max_size=8).map(lambda d: _field(9, 2, _varint(len(d)) + d)),  # unknown field
    st.integers(0, 1000).map(lambda v: _field(4, 0, _varint(v))),  # data with the wrong wire type
    st.just(_field(1, 5, b"\0\0\0\0")),  # fixed32 where a varint belongs
)


@st.composite
def _messages(draw: st.DrawFn) -> bytes:
    inner = b"".join(draw(st.lists(_chunk_field, max_size=6)))
    chunk = _field(2, 2, _varint(len(inner)) + inner)
    header = pb.CaptureResponse(header=pb.CaptureHeader(tensor_id=draw(UINT32), layer="x")).SerializeToString()
    parts = draw(st.lists(st.sampled_from([chunk, header, _field(7, 0, b"\x01")]), min_size=0, max_size=3))
    raw = b"".join(parts) or chunk
    cut = draw(st.integers(0, len(raw)))
    return raw if draw(st.booleans()) else raw[:cut]  # truncated: protobuf refuses most of these


@settings(max_examples=600, deadline=None)
@given(_messages())
def test_any_encoding_parses_as_protobuf_parses_it(raw: bytes) -> None:
    _same_as_protobuf(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_parse_as_protobuf_parses_them(raw: bytes) -> None:
    _same_as_protobuf(raw)


@settings(max_examples=200, deadline=None)
@given(UINT32, UINT32, UINT64, st.binary(min_size=1, max_size=200))
def test_the_servers_layout_is_read_in_place(tensor_id: int, index: int, offset: int, data: bytes) -> None:
    raw = pb.CaptureResponse(chunk=pb.CaptureChunk(tensor_id=tensor_id, chunk_index=index, offset=offset,
                                                   data=data)).SerializeToString()
    got = parse_response(raw)
    assert isinstance(got, WireChunk)
    assert (got.tensor_id, got.chunk_index, got.offset, bytes(got.data)) == (tensor_id, index, offset, data)
    assert got.data.obj is raw  # a view of the received bytes, not a copy


def test_fields_in_another_order_are_read_in_place_too() -> None:
    inner = _field(4, 2, b"\x03abc") + _field(3, 0, _varint(1 << 40)) + _field(1, 0, b"\x07")
    got = parse_response(_field(2, 2, _varint(len(inner)) + inner))
    assert isinstance(got, WireChunk) and (got.tensor_id, got.chunk_index, got.offset, bytes(got.data)) == (
        7, 0, 1 << 40, b"abc")


def test_a_repeated_field_goes_to_protobuf_last_one_wins() -> None:
    inner = _field(1, 0, b"\x01") + _field(4, 2, b"\x01a") + _field(1, 0, b"\x02")
    got = parse_response(_field(2, 2, _varint(len(inner)) + inner))
    assert isinstance(got, pb.CaptureResponse) and got.chunk.tensor_id == 2 and got.chunk.data == b"a"


def test_assembler_copies_each_chunk_once_into_the_tensor_buffer() -> None:
    x = np.arange(3000, dtype=np.float32)
    raw = x.tobytes()
    asm = capture.CaptureAssembler()
    asm.feed(pb.CaptureResponse(header=pb.CaptureHeader(
        tensor_id=0, layer="fc", dtype=1, shape=[3000], total_bytes=len(raw), num_chunks=3, output_count=1)))
    pending = asm._open
    assert pending is not None
    buffer = pending.buffer
    for i, off in enumerate(range(0, len(raw), 4000)):
        wire = pb.CaptureResponse(chunk=pb.CaptureChunk(tensor_id=0, chunk_index=i, offset=off,
                                                         data=raw[off:off + 4000])).SerializeToString()
        asm.feed(parse_response(wire))
    (tensor,) = asm.finish()
    # The result is the buffer the bytes were written into: no copy after the chunks landed.
    assert np.shares_memory(tensor.value, buffer)
    np.testing.assert_array_equal(tensor.value, x)
    assert tensor.value.flags.writeable
