"""Capture responses as protobuf wire bytes, framed by hand around the tensor's memory.

Building a chunk through protobuf copied its bytes three times before gRPC
made its own copy: out of the tensor (``tobytes``), into the message, and out
of it again (``SerializeToString``). Here the few bytes of framing are written
by hand and joined with a view of the tensor, so each byte is copied once
before gRPC takes it, as when a raw gRPC server streams ``bytes``.

The result is ordinary protobuf encoding, the same bytes ``SerializeToString``
writes (fields in number order, zero values left out; a test compares them),
so clients in any language keep parsing it with their generated code. The
Capture method is registered without a response serializer
(``layertap.server.rpc.telemetry.add_to_server``): its handler yields bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from layertap.server.codec import host_bytes, wire_dtype
from layertap.server.protowire import varint
from layertap.server.stream.summary_wire import Place
from layertap.v1 import telemetry_pb2 as pb

if TYPE_CHECKING:
    from layertap.server.taps.capture import CapturedPass
    from layertap.server.taps.capture_options import CaptureOptions

__all__ = ["CHUNK_BYTES", "chunk_message", "encode_pass"]

#: Tensor bytes per chunk message (the .proto promises at most 1 MiB).
CHUNK_BYTES = 1 << 20

# Field numbers and wire types from telemetry.proto: a tag is (number << 3) | type.
_VARINT, _LEN = 0, 2
_RESPONSE_CHUNK = bytes([(2 << 3) | _LEN])  # CaptureResponse.chunk = 2
_TENSOR_ID, _CHUNK_INDEX, _OFFSET = 1, 2, 3  # CaptureChunk varint fields
_DATA = bytes([(4 << 3) | _LEN])  # CaptureChunk.data = 4


def _varint_field(number: int, value: int) -> bytes:
    # proto3 leaves a zero scalar out, as SerializeToString does.
    return bytes([(number << 3) | _VARINT]) + varint(value) if value else b""


def chunk_message(tensor_id: int, chunk_index: int, offset: int, data: memoryview) -> bytes:
    """A serialized ``CaptureResponse{chunk: {...}}`` whose ``data`` is ``data``, copied once."""
    inner = b"".join((_varint_field(_TENSOR_ID, tensor_id), _varint_field(_CHUNK_INDEX, chunk_index),
                      _varint_field(_OFFSET, offset), _DATA + varint(data.nbytes) if data.nbytes else b""))
    size = len(inner) + data.nbytes
    return b"".join((_RESPONSE_CHUNK, varint(size), inner, data))


def encode_pass(rec: CapturedPass, opts: CaptureOptions, tensor_ids: Iterator[int]) -> Iterator[tuple[bytes, int]]:
    """``(serialized CaptureResponse, tensor bytes in it)``: a header, then <= 1 MiB chunks,
    for every tensor of a pass, in request order."""
    rank = {name: i for i, name in enumerate(opts.layers)}
    point = opts.point
    order = sorted(rec.tensors, key=lambda c: (rank[c.layer], c.call_index, c.output_index))
    place = Place.of_pass(rec.ctx)
    for cap in order:
        host_t = cap.tensor.to("cpu")
        # A byte view of the tensor itself (numpy's copy first when it is a
        # strided view): chunk_message copies each byte once.
        data = host_bytes(host_t).data
        nbytes = data.nbytes
        tid = next(tensor_ids)
        nchunks = (nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES
        header = pb.CaptureHeader(
            tensor_id=tid, layer=cap.layer, point=point, output_index=cap.output_index,
            output_key=cap.output_key, output_count=cap.output_count, dtype=wire_dtype(host_t.dtype),
            shape=list(host_t.shape), pass_index=rec.ctx.index, pass_ordinal=rec.ordinal,
            total_bytes=nbytes, num_chunks=nchunks, active=rec.ctx.active,
            is_container=cap.is_container, call_index=cap.call_index,
        )
        if rec.ctx.step is not None:  # has_step tells step 0 from a pass without one
            header.step, header.has_step = rec.ctx.step, True
        if place is not None:  # a Generate pass: the whole batch's phase, position and requests
            place.stamp(header)
        yield pb.CaptureResponse(header=header).SerializeToString(), 0
        for i in range(nchunks):
            off = i * CHUNK_BYTES
            piece = data[off:off + CHUNK_BYTES]
            yield chunk_message(tid, i, off, piece), piece.nbytes
