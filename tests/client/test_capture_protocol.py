"""The Capture wire contract, enforced by the client against a hostile server.

A scripted gRPC server replays hand-made Capture streams. Every breach of
the contract (chunks in order from offset 0, no gap, overlap or excess,
complete before the next header, a bounded and consistent size claim) must
end in ``ProtocolError``, and the allocation for a claim happens only after
the claim is checked.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from support.capture_script import CaptureScript

import layertap
from layertap import ProtocolError
from layertap import _capture as capture
from layertap import _codec as codec
from layertap.v1 import telemetry_pb2, tensor_pb2
from layertap.v1.telemetry_pb2 import CaptureResponse as Msg

pytestmark = pytest.mark.unit

DT = tensor_pb2.DataType
CHUNK = 1000


@pytest.fixture()
def served(grpc_server: Callable[..., str]) -> Iterator[tuple[CaptureScript, layertap.Client]]:
    script = CaptureScript()
    with layertap.Client(grpc_server(script), timeout=10) as client:
        yield script, client


def header(tid: int, arr: np.ndarray, layer: str = "fc", chunk: int = CHUNK, **kw: Any) -> Msg:
    return Msg(
        header=telemetry_pb2.CaptureHeader(
            tensor_id=tid,
            layer=layer,
            point=telemetry_pb2.POINT_OUTPUT,
            dtype=codec.encode_tensor(arr).dtype,
            shape=list(arr.shape),
            total_bytes=arr.nbytes,
            num_chunks=-(-arr.nbytes // chunk),
            output_count=1,
            **kw,
        )
    )


def chunks(tid: int, arr: np.ndarray, chunk: int = CHUNK) -> list[Msg]:
    raw = arr.tobytes()
    return [
        Msg(chunk=telemetry_pb2.CaptureChunk(tensor_id=tid, chunk_index=i, offset=off, data=raw[off : off + chunk]))
        for i, off in enumerate(range(0, len(raw), chunk))
    ]


def bare_header(shape: list[int], total: int, *, dtype: int = DT.DATA_TYPE_FLOAT32, num_chunks: int = 1) -> Msg:
    return Msg(
        header=telemetry_pb2.CaptureHeader(
            tensor_id=0, layer="fc", dtype=dtype, shape=shape, total_bytes=total,  # type: ignore[arg-type]
            num_chunks=num_chunks,
        )
    )


X = np.arange(1000, dtype=np.float32)  # 4000 bytes: 4 chunks of 1000
Y = np.arange(6, dtype=np.int64).reshape(2, 3)  # 48 bytes: 1 chunk


def _stream() -> list[Msg]:
    return [header(0, X), *chunks(0, X), header(1, Y, layer="head"), *chunks(1, Y)]


def test_happy_path_returns_the_exact_bytes(served: tuple[CaptureScript, layertap.Client]) -> None:
    script, client = served
    empty = np.zeros((0, 5), np.float16)
    script.responses = [*_stream(), header(2, empty, layer="gate")]
    out = client.capture(["fc", "head", "gate"])
    assert out["fc"].tobytes() == X.tobytes() and out["fc"].dtype == np.float32
    assert out["head"].tobytes() == Y.tobytes() and out["head"].shape == (2, 3)
    assert out["gate"].shape == (0, 5) and out["gate"].dtype == np.float16


def _edit(msgs: list[Msg], i: int, **fields: Any) -> list[Msg]:
    for key, value in fields.items():
        setattr(msgs[i].chunk, key, value)
    return msgs


def _grow_last_chunk(msgs: list[Msg]) -> list[Msg]:
    msgs[4].chunk.data += b"\0"  # the last chunk of X
    return msgs


def _extra_chunk(msgs: list[Msg]) -> list[Msg]:
    extra = Msg(chunk=telemetry_pb2.CaptureChunk(tensor_id=0, chunk_index=4, offset=4000, data=b"\0"))
    return [*msgs[:5], extra, *msgs[5:]]


def _claimed(msgs: list[Msg], **fields: Any) -> list[Msg]:
    for key, value in fields.items():
        if key == "shape":
            del msgs[0].header.shape[:]
            msgs[0].header.shape.extend(value)
        else:
            setattr(msgs[0].header, key, value)
    return msgs


# Each case turns the valid two-tensor stream into one that breaks the contract.
VIOLATIONS: dict[str, tuple[Callable[[list[Msg]], list[Msg]], str]] = {
    "gap": (lambda m: _edit(m, 2, offset=1001), r"starts at byte 1001, not at 1000 .*\(gap\)"),
    "overlap": (lambda m: _edit(m, 2, offset=999), r"starts at byte 999, not at 1000 .*\(overlap\)"),
    "out_of_order_index": (lambda m: [m[0], m[2], m[1], *m[3:]], "chunk 1 arrived where chunk 0 was due"),
    "index_skipped": (lambda m: _edit(m, 2, chunk_index=2), "chunk 2 arrived where chunk 1 was due"),
    "duplicate_chunk": (lambda m: [*m[:2], m[1], *m[2:]], "chunk 0 arrived where chunk 1 was due"),
    "chunk_before_header": (lambda m: [m[1], m[0], *m[2:]], "chunk for unannounced tensor 0"),
    "chunk_of_unknown_tensor": (lambda m: _edit(m, 1, tensor_id=9), "chunk for unannounced tensor 9"),
    "excess_bytes_in_last_chunk": (_grow_last_chunk, "overruns 4000 bytes"),
    "excess_chunk_after_complete": (_extra_chunk, "chunk for finished tensor 0"),
    "empty_chunk": (lambda m: _edit(m, 1, data=b""), "chunk 0 is empty"),
    "next_header_before_complete": (
        lambda m: [*m[:4], *m[5:]], r"header of layer 'head' tensor 1 before .*3000 of 4000"
    ),
    "truncated_stream": (lambda m: m[:-1], "ended early: layer 'head' got 0 of 48 bytes"),
    "truncated_mid_tensor": (lambda m: m[:3], "ended early: layer 'fc' got 2000 of 4000 bytes"),
    "repeated_header": (lambda m: [*m[:5], m[0], *m[1:5]], "repeated header of tensor 0"),
    "fewer_chunks_than_announced": (lambda m: _claimed(m, num_chunks=5), "4000 of 4000 bytes in 4 of 5 chunks"),
    "more_chunks_than_announced": (lambda m: _claimed(m, num_chunks=3), "3000 of 4000 bytes in 3 of 3 chunks"),
    "more_chunks_than_bytes": (lambda m: _claimed(m, num_chunks=4001), "4001 chunks for 4000 bytes"),
    "size_not_shape_product": (
        lambda m: _claimed(m, total_bytes=4004), r"total_bytes 4004 does not match float32 x \[1000\]"
    ),
    "size_with_wrong_itemsize": (lambda m: _claimed(m, dtype=DT.DATA_TYPE_FLOAT64), "does not match float64"),
    "negative_dim": (lambda m: _claimed(m, shape=[-1, -1000]), "negative dimension"),
    "too_many_dims": (lambda m: _claimed(m, shape=[1] * 33), "33 dimensions, at most 32"),
    "unknown_dtype": (lambda m: _claimed(m, dtype=99), "unsupported wire dtype 99"),
    "unspecified_dtype": (lambda m: _claimed(m, dtype=DT.DATA_TYPE_UNSPECIFIED), "unsupported wire dtype 0"),
}


@pytest.mark.parametrize("case", sorted(VIOLATIONS))
def test_contract_violation_is_a_protocol_error(served: tuple[CaptureScript, layertap.Client], case: str) -> None:
    script, client = served
    breach, match = VIOLATIONS[case]
    script.responses = breach(_stream())
    with pytest.raises(ProtocolError, match=match):
        client.capture(["fc", "head"])
    script.responses = _stream()  # the client is still usable afterwards
    assert client.capture(["fc", "head"])["fc"].tobytes() == X.tobytes()


# Claims that would need an absurd buffer: (shape, dtype, total_bytes, message).
ABSURD = {
    "2**62_bytes": ([1 << 62], DT.DATA_TYPE_UINT8, 1 << 62, "more than 281474976710656 elements"),
    "2**62_by_two_dims": ([1 << 31, 1 << 31], DT.DATA_TYPE_UINT8, 1 << 62, "more than"),
    "empty_with_huge_dims": ([0, 1 << 62, 1 << 62], DT.DATA_TYPE_FLOAT32, 0, "more than"),
    "over_client_cap": (
        [(1 << 33) + 1], DT.DATA_TYPE_FLOAT64, ((1 << 33) + 1) * 8, f"client's cap of {capture.MAX_CAPTURE_BYTES}"
    ),
}


@pytest.mark.parametrize("case", sorted(ABSURD))
def test_absurd_claim_fails_fast_without_allocating(
    served: tuple[CaptureScript, layertap.Client], case: str
) -> None:
    script, client = served
    shape, dtype, total, match = ABSURD[case]
    script.responses = [bare_header(shape, total, dtype=dtype)]
    tracemalloc.start()
    try:
        start = time.perf_counter()
        with pytest.raises(ProtocolError, match=match):
            client.capture("fc")
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 5.0  # refused at the header, not after the call's 10 s deadline
    assert peak < 16 << 20  # numpy reports its buffers to tracemalloc


def test_cap_counts_every_tensor_of_the_stream() -> None:
    cap = X.nbytes + Y.nbytes - 1
    asm = capture.CaptureAssembler(max_bytes=cap)
    for msg in [header(0, X), *chunks(0, X)]:
        asm.feed(msg)
    match = f"48 bytes on top of 4000 already announced exceed the client's cap of {cap}"
    with pytest.raises(ProtocolError, match=match):
        asm.feed(header(1, Y))
    exact = capture.CaptureAssembler(max_bytes=X.nbytes + Y.nbytes)
    for msg in _stream():
        exact.feed(msg)
    assert [t.layer for t in exact.finish()] == ["fc", "head"]


def test_infer_outputs_with_absurd_shapes_are_protocol_errors() -> None:
    # decode_tensor shares the shape checks: numpy's own ValueError never escapes.
    t = tensor_pb2.Tensor(name="out", dtype=DT.DATA_TYPE_FLOAT32, shape=[0, 1 << 40, 1 << 40])
    with pytest.raises(ProtocolError, match="more than"):
        codec.decode_tensor(t)
    t = tensor_pb2.Tensor(name="out", dtype=DT.DATA_TYPE_FLOAT32, shape=[1] * 40, raw_data=b"\0" * 4)
    with pytest.raises(ProtocolError, match="40 dimensions"):
        codec.decode_tensor(t)


def test_a_claim_this_machine_cannot_allocate_is_a_protocol_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the cap but over free memory (a 60 GiB claim on a 24 GiB host): ProtocolError, not MemoryError.

    The allocation failure is injected: really exhausting memory would take the test machine with it.
    """

    def no_memory(*_a: Any, **_k: Any) -> np.ndarray:
        raise MemoryError("injected")

    asm = capture.CaptureAssembler()
    monkeypatch.setattr(capture.np, "empty", no_memory)
    with pytest.raises(ProtocolError, match="more than this machine can allocate"):
        asm.feed(header(0, X))


class _Unusual:
    """A chunk message sent with an unknown field appended: valid protobuf the in-place reader hands to protobuf."""

    def __init__(self, msg: Msg) -> None:
        self.raw = msg.SerializeToString() + b"\xa0\x06\x01"  # field 100, varint 1

    def SerializeToString(self) -> bytes:  # the protobuf name CaptureScript calls
        return self.raw


def test_chunks_protobuf_parses_meet_the_same_contract(served: tuple[CaptureScript, layertap.Client]) -> None:
    script, client = served
    unusual = [m if m.WhichOneof("payload") == "header" else _Unusual(m) for m in _stream()]
    script.responses = unusual  # type: ignore[assignment]
    out = client.capture(["fc", "head"])
    assert out["fc"].tobytes() == X.tobytes() and out["head"].tobytes() == Y.tobytes()
    gap = [m if m.WhichOneof("payload") == "header" else _Unusual(m) for m in _edit(_stream(), 2, offset=1001)]
    script.responses = gap  # type: ignore[assignment]
    with pytest.raises(ProtocolError, match=r"starts at byte 1001, not at 1000 .*\(gap\)"):
        client.capture(["fc", "head"])
