"""Hand-framed Capture chunks are exactly the bytes protobuf writes, so every generated parser reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layertap.server.codec import host_bytes, tensor_to_bytes
from layertap.server.host.model_host import PassContext
from layertap.server.taps.capture import CapturedPass, CapturedTensor
from layertap.server.taps.capture_limits import CaptureBudget
from layertap.server.taps.capture_options import CaptureOptions
from layertap.server.taps.capture_wire import CHUNK_BYTES, chunk_message, encode_pass, varint
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import tensor_pb2

pytestmark = pytest.mark.unit

UINT32 = st.integers(0, (1 << 32) - 1)
UINT64 = st.integers(0, (1 << 64) - 1)


def reference(tensor_id: int, chunk_index: int, offset: int, data: bytes) -> bytes:
    return pb.CaptureResponse(chunk=pb.CaptureChunk(tensor_id=tensor_id, chunk_index=chunk_index, offset=offset,
                                                    data=data)).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(UINT32, UINT32, UINT64, st.binary(max_size=300))
def test_chunk_bytes_equal_serialize_to_string(tensor_id: int, chunk_index: int, offset: int, data: bytes) -> None:
    wire = chunk_message(tensor_id, chunk_index, offset, memoryview(data))
    assert wire == reference(tensor_id, chunk_index, offset, data)
    msg = pb.CaptureResponse.FromString(wire)
    assert msg.WhichOneof("payload") == "chunk"
    assert (msg.chunk.tensor_id, msg.chunk.chunk_index, msg.chunk.offset, msg.chunk.data) == (
        tensor_id, chunk_index, offset, data)


@pytest.mark.parametrize("size", [1, 127, 128, 16383, 16384, CHUNK_BYTES - 1, CHUNK_BYTES])
def test_full_size_chunks_of_a_tensor_view(size: int) -> None:
    """Length prefixes cross varint byte boundaries; the data comes from a view of an array's memory."""
    arr = np.random.default_rng(size).integers(0, 256, size + 7, dtype=np.uint8)
    view = arr.data[7:]
    wire = chunk_message(3, 5, (1 << 40) + 7, view)
    assert wire == reference(3, 5, (1 << 40) + 7, arr[7:].tobytes())
    assert pb.CaptureResponse.FromString(wire).chunk.data == arr[7:].tobytes()


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16384, (1 << 32) - 1, 1 << 35, (1 << 64) - 1])
def test_varint_matches_protobuf(n: int) -> None:
    # An offset alone is "0x18 varint": the message's bytes after the tags are the varint.
    ref = pb.CaptureChunk(offset=n).SerializeToString()
    assert (b"\x18" + varint(n) if n else b"") == ref


@pytest.mark.parametrize("step", [None, 0, 7, (1 << 40) + 3])
def test_a_header_carries_its_passs_training_step(step: int | None) -> None:
    """The header is the bytes protobuf writes for the pass's fields, step included; ``has_step`` only with one."""
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    rec = CapturedPass(PassContext(12, step=step), 1, CaptureBudget(1 << 20).reservation(),
                       [CapturedTensor("fc", 0, 0, "", 1, False, t)])
    opts = CaptureOptions(layers=("fc",), point=pb.POINT_OUTPUT, passes=2, max_batch=0, dtype=None)
    (header, _), (chunk, _) = encode_pass(rec, opts, iter([4]))
    want = pb.CaptureHeader(tensor_id=4, layer="fc", point=pb.POINT_OUTPUT, output_count=1,
                            dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=[2, 3], pass_index=12, pass_ordinal=1,
                            total_bytes=24, num_chunks=1, step=step or 0, has_step=step is not None)
    assert header == pb.CaptureResponse(header=want).SerializeToString()
    got = pb.CaptureResponse.FromString(header).header
    assert (got.has_step, got.step) == (step is not None, step or 0)
    assert pb.CaptureResponse.FromString(chunk).chunk.data == t.numpy().tobytes()


class _Recorder:
    """Stands in for grpc.Server: records what a registration adds, in order."""

    def __init__(self) -> None:
        self.generic: list = []
        self.registered: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:  # type: ignore[no-untyped-def]
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.registered.update({f"/{service}/{m}": h for m, h in handlers.items()})


def test_every_route_to_capture_sends_its_bytes_unserialized() -> None:
    """Registered and generic lookups both reach the Capture handler without a serializer; other methods keep theirs."""
    from types import SimpleNamespace

    from layertap.server.rpc.state import StateCell
    from layertap.server.rpc.telemetry import TelemetryService, add_to_server

    server = _Recorder()
    add_to_server(TelemetryService(StateCell()), server)  # type: ignore[arg-type]
    capture, listing = "/layertap.v1.TelemetryService/Capture", "/layertap.v1.TelemetryService/ListLayers"
    assert server.registered[capture].response_serializer is None
    assert server.registered[listing].response_serializer is not None

    def generic(method: str):  # type: ignore[no-untyped-def]
        details = SimpleNamespace(method=method, invocation_metadata=())
        return next(h for h in (g.service(details) for g in server.generic) if h is not None)

    assert generic(capture).response_serializer is None
    assert generic(listing).response_serializer is not None


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5, 7).t(),                                    # transposed
    lambda: torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1),              # a Permute module's output
    lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    lambda: torch.randn(4, 1).expand(4, 6),                           # stride 0
    lambda: torch.randn(30)[3:20:2],                                  # offset and step
    lambda: (torch.randn(6, 4) * 3).bfloat16().t(),
    lambda: torch.randn(6, 4).half()[:, 1:],
    lambda: torch.randint(-100, 100, (5, 6), dtype=torch.int8).t(),
    lambda: (torch.rand(5, 6) > 0.5).t(),
    lambda: torch.tensor(2.5),
    lambda: torch.zeros(0, 3),
    lambda: torch.randn(3, 4, dtype=torch.complex64).conj().imag.t(),  # a lazy negative bit
    lambda: torch.randn(3, 4, requires_grad=True).t(),
])
def test_tensor_bytes_are_torchs_row_major_bytes_for_any_layout(make) -> None:
    """host_bytes copies strided tensors with numpy (torch's parallel copy would start an OpenMP team
    on the calling RPC thread); the bytes must be exactly those of ``.contiguous()``."""
    t = make()
    want = t.detach().resolve_neg().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    assert tensor_to_bytes(t) == want
    assert host_bytes(t).tobytes() == want


@pytest.mark.parametrize("phase, positions, want_position", [(1, ((5,), (5, 5)), 5), (2, ((3,), (9, 9)), None), (0, (), None)])
def test_a_passive_capture_of_a_generate_pass_names_its_place(phase: int, positions: tuple, want_position) -> None:
    """A live Generate pass's headers carry its phase, position and request ids, in protobuf's own bytes."""
    from torch import nn

    from layertap.server.host.model_host import ModelHost, RequestRows
    from layertap.server.host.sources import InputSpec, LoadedModel
    from layertap.server.taps.capture import CaptureSession

    host = ModelHost(LoadedModel(nn.Sequential(nn.Linear(4, 4)).eval(), "m", "test",
                                 [InputSpec("input", torch.float32, (-1, -1, 4))]))
    opts = CaptureOptions(layers=("0",), point=pb.POINT_OUTPUT, passes=1, max_batch=0, dtype=None)
    requests = tuple(RequestRows(rid, slice(start, start + len(p)), p)
                     for rid, start, p in zip(("r1", "r2"), (0, 1), positions))
    x = torch.randn(3 if requests else 2, 6, 4)
    with CaptureSession(host, opts, max_bytes=1 << 20, active=False) as session:
        with host.pass_context(phase=phase, requests=requests, tokens=6 if phase else 0) as ctx, torch.inference_mode():
            out = host.module(x)
        rec = session.next_pass(5)
        assert rec is not None
        (header, _), (chunk, _) = encode_pass(rec, opts, iter([0]))
    want = pb.CaptureHeader(layer="0", point=pb.POINT_OUTPUT, output_count=1, dtype=tensor_pb2.DATA_TYPE_FLOAT32,
                            shape=list(out.shape), pass_index=ctx.index, total_bytes=out.numel() * 4, num_chunks=1,
                            phase=phase, position=want_position or 0, has_position=want_position is not None,
                            request_ids=[r.request_id for r in requests])
    assert header == pb.CaptureResponse(header=want).SerializeToString()
    assert pb.CaptureResponse.FromString(chunk).chunk.data == out.numpy().tobytes()
