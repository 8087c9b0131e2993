"""GetIncident streams are reassembled under the capture framing's checks: never zeros for missing bytes."""

from __future__ import annotations

import numpy as np
import pytest

from layertap import ProtocolError
from layertap._incidents import assemble
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import tensor_pb2

pytestmark = pytest.mark.unit

RECORD = pb.GetIncidentResponse(incident=pb.Incident(id="inc-1700000000000-0123abcd", tap="t", pass_index=7))
DATA = np.arange(1, 9, dtype=np.float32)
RAW = DATA.tobytes()


def _header(tensor_id: int = 0, *, layer: str = "fc", point: int = pb.POINT_OUTPUT, total: int = 32,
            chunks: int = 2, shape: tuple[int, ...] = (8,), call_index: int = 0) -> pb.GetIncidentResponse:
    return pb.GetIncidentResponse(header=pb.CaptureHeader(
        tensor_id=tensor_id, layer=layer, point=point, dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(shape),
        total_bytes=total, num_chunks=chunks, call_index=call_index))


def _chunk(index: int, offset: int, data: bytes, tensor_id: int = 0) -> pb.GetIncidentResponse:
    return pb.GetIncidentResponse(chunk=pb.CaptureChunk(tensor_id=tensor_id, chunk_index=index, offset=offset, data=data))


def test_a_whole_stream_gives_inputs_layers_and_the_record() -> None:
    got = assemble([RECORD,
                    _header(0, layer="", point=pb.POINT_INPUT), _chunk(0, 0, RAW[:16]), _chunk(1, 16, RAW[16:]),
                    _header(1, call_index=1, chunks=1), _chunk(0, 0, RAW, tensor_id=1)])
    assert got.info.pass_index == 7
    np.testing.assert_array_equal(got.inputs[0], DATA)
    assert list(got.layers) == ["fc#1.0"]
    np.testing.assert_array_equal(got.layers["fc#1.0"], DATA)


@pytest.mark.parametrize("messages, match", [
    ([_header(), _chunk(0, 0, RAW[:16])], "got 16 of 32 bytes"),  # the last chunk never came
    ([_header(), _chunk(0, 0, RAW[:16]), _chunk(1, 20, RAW[20:])], "gap"),
    ([_header(), _chunk(1, 0, RAW[:16])], "chunk 1 arrived where chunk 0 was due"),
    ([_header(total=64)], "does not match"),  # a claim its dtype and shape do not back
    ([_header(shape=(1 << 20, 1 << 20), total=4 << 40)], "exceed"),  # announced before any allocation
    ([_header(), _chunk(0, 0, RAW[:16]), _chunk(1, 16, RAW[16:]), RECORD], "second incident record"),
    ([_chunk(0, 0, RAW)], "unannounced"),
    ([_header(0, chunks=1), _chunk(0, 0, RAW), _header(1, chunks=1), _chunk(0, 0, RAW, tensor_id=1)],
     "two tensors for 'fc'"),  # the second would silently replace the first
])
def test_a_stream_that_breaks_the_framing_raises(messages: list[pb.GetIncidentResponse], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        assemble([RECORD, *messages])


def test_no_record_first_raises() -> None:
    with pytest.raises(ProtocolError, match="incident record"):
        assemble([_header(), _chunk(0, 0, RAW[:16]), _chunk(1, 16, RAW[16:])])
