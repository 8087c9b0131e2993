"""numpy/torch <-> wire tensors, capture reassembly and spec conversion."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from support.capture_script import CaptureScript

import layertap
from layertap import InvalidArgument, ProtocolError
from layertap import _capture as capture
from layertap import _codec as codec
from layertap import _convert as convert
from layertap._taps import tap_spec
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc, tensor_pb2

pytestmark = pytest.mark.unit

DT = tensor_pb2.DataType
MiB = 1 << 20

NUMPY_CASES = [
    (DT.DATA_TYPE_FLOAT32, np.float32),
    (DT.DATA_TYPE_FLOAT16, np.float16),
    (DT.DATA_TYPE_FLOAT64, np.float64),
    (DT.DATA_TYPE_INT8, np.int8),
    (DT.DATA_TYPE_INT16, np.int16),
    (DT.DATA_TYPE_INT32, np.int32),
    (DT.DATA_TYPE_INT64, np.int64),
    (DT.DATA_TYPE_UINT8, np.uint8),
    (DT.DATA_TYPE_BOOL, np.bool_),
]


def test_every_wire_dtype_is_covered() -> None:
    covered = {code for code, _ in NUMPY_CASES} | {DT.DATA_TYPE_BFLOAT16}
    assert covered == set(DT.values()) - {DT.DATA_TYPE_UNSPECIFIED}


@pytest.mark.parametrize(("code", "np_dtype"), NUMPY_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", [(2, 3, 4), (), (0, 5), (7,)])
def test_numpy_round_trip(code: int, np_dtype: Any, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 100).astype(np_dtype)
    t = codec.encode_tensor(x)
    assert t.dtype == code
    assert tuple(t.shape) == shape
    assert t.raw_data == x.astype(np.dtype(np_dtype).newbyteorder("<")).tobytes()
    y = codec.decode_tensor(t)
    assert y.dtype == np.dtype(np_dtype) and y.shape == shape
    np.testing.assert_array_equal(y, x)
    assert y.flags.writeable


def test_big_endian_and_non_contiguous_inputs_are_normalized() -> None:
    x = np.arange(24, dtype=">i4").reshape(4, 6)[:, ::2]
    t = codec.encode_tensor(x)
    assert t.dtype == DT.DATA_TYPE_INT32
    assert t.raw_data == np.ascontiguousarray(x, dtype="<i4").tobytes()
    np.testing.assert_array_equal(codec.decode_tensor(t), x)


def test_python_lists_encode_via_numpy() -> None:
    t = codec.encode_tensor([[1.5, 2.5]])
    assert t.dtype == DT.DATA_TYPE_FLOAT64 and list(t.shape) == [1, 2]


@pytest.mark.parametrize("bad", [np.zeros(3, np.complex64), np.zeros(3, np.uint16), np.array(["a"])])
def test_unsupported_dtypes_are_rejected(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match="cannot send"):
        codec.encode_tensor(bad)


def test_bf16_widening_is_exact_for_every_bit_pattern() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    t = tensor_pb2.Tensor(dtype=DT.DATA_TYPE_BFLOAT16, shape=[1 << 16], raw_data=bits.tobytes())
    y = codec.decode_tensor(t)
    assert y.dtype == np.float32
    widened = y.view(np.uint32)
    np.testing.assert_array_equal(widened >> 16, bits)
    np.testing.assert_array_equal(widened & 0xFFFF, 0)
    # Spot-check values: 1.0 is 0x3F80 in bf16; -2.0 is 0xC000.
    assert y[0x3F80] == 1.0 and y[0xC000] == -2.0
    assert np.isinf(y[0x7F80]) and np.isnan(y[0x7FC0])


def test_bf16_torch_round_trip() -> None:
    torch = pytest.importorskip("torch")
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).reshape(256, 256)
    t = codec.encode_tensor(x)
    assert t.dtype == DT.DATA_TYPE_BFLOAT16 and list(t.shape) == [256, 256]
    assert t.raw_data == bits.numpy().astype("<i2").tobytes()
    back = codec.decode_tensor(t, as_torch=True)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))
    as_np = codec.decode_tensor(t)
    finite = torch.isfinite(x)
    np.testing.assert_array_equal(as_np[finite.numpy()], x.float()[finite].numpy())


def test_torch_tensors_encode_like_numpy() -> None:
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.float16).reshape(3, 4).t()  # non-contiguous
    t = codec.encode_tensor(x)
    assert t.dtype == DT.DATA_TYPE_FLOAT16
    np.testing.assert_array_equal(codec.decode_tensor(t), x.numpy())
    y = codec.decode_tensor(t, as_torch=True)
    assert torch.equal(y, x)


@pytest.mark.parametrize(
    ("raw", "shape", "dtype", "match"),
    [
        (b"\0" * 12, [2, 2], DT.DATA_TYPE_FLOAT32, "16 bytes expected"),
        (b"\0" * 16, [2, 2], DT.DATA_TYPE_FLOAT64, "32 bytes expected"),
        (b"", [-1], DT.DATA_TYPE_FLOAT32, "negative dimension"),
        (b"\0" * 4, [1], 99, "unsupported wire dtype"),
        (b"\0" * 4, [1], DT.DATA_TYPE_UNSPECIFIED, "unsupported wire dtype"),
    ],
)
def test_decode_validates_bytes_shape_and_dtype(
    raw: bytes, shape: list[int], dtype: int, match: str
) -> None:
    t = tensor_pb2.Tensor(name="out", dtype=dtype, shape=shape, raw_data=raw)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=match):
        codec.decode_tensor(t)


def test_dtype_names_and_aliases() -> None:
    assert codec.dtype_code("bf16") == DT.DATA_TYPE_BFLOAT16
    assert codec.dtype_code("torch.float16") == DT.DATA_TYPE_FLOAT16
    assert codec.dtype_name(DT.DATA_TYPE_INT64) == "int64"
    with pytest.raises(InvalidArgument, match="expected one of"):
        codec.dtype_code("float8")


# --------------------------------------------------------------------------- capture


def _header(tid: int, layer: str, arr: np.ndarray, chunk: int = MiB, **kw: Any) -> telemetry_pb2.CaptureResponse:
    code = codec.encode_tensor(arr).dtype
    total = arr.nbytes
    return telemetry_pb2.CaptureResponse(
        header=telemetry_pb2.CaptureHeader(
            tensor_id=tid,
            layer=layer,
            point=telemetry_pb2.POINT_OUTPUT,
            dtype=code,
            shape=list(arr.shape),
            total_bytes=total,
            num_chunks=-(-total // chunk),
            output_count=kw.pop("output_count", 1),
            **kw,
        )
    )


def _chunks(tid: int, arr: np.ndarray, chunk: int = MiB) -> list[telemetry_pb2.CaptureResponse]:
    raw = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
    return [
        telemetry_pb2.CaptureResponse(
            chunk=telemetry_pb2.CaptureChunk(tensor_id=tid, chunk_index=i, offset=off, data=raw[off : off + chunk])
        )
        for i, off in enumerate(range(0, len(raw), chunk))
    ]


def test_assembler_writes_chunks_in_order() -> None:
    x = np.random.default_rng(1).standard_normal((3, 1000)).astype(np.float32)
    seen: list[tuple[int, int]] = []
    asm = capture.CaptureAssembler(progress=lambda r, t: seen.append((r, t)))
    asm.feed(_header(7, "layer4", x, chunk=1000))
    for msg in _chunks(7, x, chunk=1000):  # out of order is a ProtocolError: test_capture_protocol
        asm.feed(msg)
    (out,) = asm.finish()
    assert out.layer == "layer4" and out.dtype == "float32"
    np.testing.assert_array_equal(out.value, x)
    assert seen[-1] == (x.nbytes, x.nbytes)
    assert [r for r, _ in seen] == sorted(r for r, _ in seen)


def test_assembler_detects_missing_bytes() -> None:
    x = np.ones(1000, np.float64)
    asm = capture.CaptureAssembler()
    asm.feed(_header(1, "fc", x, chunk=1024))
    for msg in _chunks(1, x, chunk=1024)[:-1]:
        asm.feed(msg)
    with pytest.raises(ProtocolError, match="ended early"):
        asm.finish()


@pytest.mark.parametrize("fault", ["overrun", "duplicate", "unknown_id", "bad_total", "empty"])
def test_assembler_rejects_malformed_streams(fault: str) -> None:
    x = np.ones(256, np.float32)
    asm = capture.CaptureAssembler()
    header = _header(1, "fc", x, chunk=512)
    chunks = _chunks(1, x, chunk=512)
    with pytest.raises(ProtocolError):
        if fault == "bad_total":
            header.header.total_bytes += 4
            asm.feed(header)
        asm.feed(header)
        if fault == "overrun":
            chunks[0].chunk.offset = 800
            asm.feed(chunks[0])
        elif fault == "duplicate":
            asm.feed(chunks[0])
            asm.feed(chunks[0])
        elif fault == "unknown_id":
            chunks[0].chunk.tensor_id = 2
            asm.feed(chunks[0])
        elif fault == "empty":
            asm.feed(telemetry_pb2.CaptureResponse())


@pytest.fixture()
def capture_server(grpc_server: Callable[..., str]) -> tuple[CaptureScript, str]:
    script = CaptureScript()
    return script, grpc_server(script)


def _send(script: CaptureScript, tensors: Sequence[tuple[str, np.ndarray, dict[str, Any]]]) -> None:
    script.responses = []
    for tid, (layer, arr, kw) in enumerate(tensors):
        script.responses.append(_header(tid, layer, arr, **kw))
        script.responses.extend(_chunks(tid, arr))


def test_capture_one_large_tensor_bit_exact(capture_server: tuple[CaptureScript, str]) -> None:
    script, target = capture_server
    x = np.random.default_rng(2).standard_normal((4, 1 << 20)).astype(np.float32)  # 16 MiB
    _send(script, [("layer4", x, {})])
    progress: list[tuple[int, int]] = []
    with layertap.Client(target) as client:
        y = client.capture("layer4", progress=lambda r, t: progress.append((r, t)))
    assert y.tobytes() == x.tobytes()
    assert progress[-1] == (x.nbytes, x.nbytes)
    req = script.requests[0]
    assert list(req.layers) == ["layer4"] and req.passes == 1 and req.point == telemetry_pb2.POINT_OUTPUT


def test_capture_return_shapes(capture_server: tuple[CaptureScript, str]) -> None:
    script, target = capture_server
    a, b, c = np.zeros((2, 3), np.float32), np.ones(4, np.int64), np.full(2, 7, np.float16)
    _send(
        script,
        [
            ("layer4", a, {"pass_ordinal": 0}),
            ("lstm", c, {"pass_ordinal": 0, "is_container": True, "output_index": 1, "output_count": 2}),
            ("lstm", b, {"pass_ordinal": 0, "is_container": True, "output_index": 0, "output_count": 2}),
            ("heads", a, {"pass_ordinal": 0, "is_container": True, "output_key": "box"}),
            ("layer4", a + 1, {"pass_ordinal": 1}),
        ],
    )
    with layertap.Client(target) as client:
        several = client.capture(["layer4", "lstm", "heads"], n=2, input=np.zeros((1, 3)), max_batch=1, dtype="float16")
        req = script.requests[-1]
        assert req.passes == 2 and req.max_batch == 1 and req.dtype == DT.DATA_TYPE_FLOAT16
        assert len(req.inputs) == 1
        assert isinstance(several, list) and len(several) == 2
        first = several[0]
        assert list(first) == ["layer4", "lstm", "heads"]
        np.testing.assert_array_equal(first["layer4"], a)
        assert [v.dtype for v in first["lstm"]] == [np.int64, np.float16]  # ordered by output_index
        assert list(first["heads"]) == ["box"]
        np.testing.assert_array_equal(several[1]["layer4"], a + 1)

        _send(script, [("layer4", a, {})])
        as_dict = client.capture(["layer4"], input=(np.zeros(1), np.ones(1)))
        assert list(as_dict) == ["layer4"]
        assert len(script.requests[-1].inputs) == 2


def test_capture_bf16_arrives_as_float32_or_torch_bf16(capture_server: tuple[CaptureScript, str]) -> None:
    torch = pytest.importorskip("torch")
    script, target = capture_server
    x = torch.randn(3, 5).to(torch.bfloat16)
    bits = x.view(torch.int16).numpy()
    header = _header(0, "layer4", bits)
    header.header.dtype = DT.DATA_TYPE_BFLOAT16
    script.responses = [header, *_chunks(0, bits)]
    with layertap.Client(target) as client:
        y = client.capture("layer4")
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, x.float().numpy())
        z = client.capture("layer4", as_torch=True)
        assert z.dtype == torch.bfloat16 and torch.equal(z, x)


def test_incomplete_capture_stream_raises(capture_server: tuple[CaptureScript, str]) -> None:
    script, target = capture_server
    x = np.ones(3 * MiB, np.uint8)
    script.responses = [_header(0, "layer4", x), *_chunks(0, x)[:2]]
    with layertap.Client(target) as client, pytest.raises(ProtocolError, match="ended early"):
        client.capture("layer4")


# --------------------------------------------------------------------------- taps, summaries, drift


def test_reducer_specs() -> None:
    assert convert.reducer_to_proto("moments").kind == telemetry_pb2.REDUCER_KIND_MOMENTS
    hist = convert.reducer_to_proto({"histogram": {"bins": 32, "min": -4, "max": 4}})
    assert (hist.histogram.bins, hist.histogram.min, hist.histogram.max) == (32, -4.0, 4.0)
    q = convert.reducer_to_proto({"quantiles": {"probabilities": [0.5, 0.9]}})
    assert list(q.quantiles.probabilities) == [0.5, 0.9]
    assert convert.reducer_from_proto(hist) == {"histogram": {"bins": 32, "min": -4.0, "max": 4.0}}
    assert convert.reducer_from_proto(convert.reducer_to_proto("abs_max")) == "abs_max"
    with pytest.raises(InvalidArgument, match="valid reducers: moments, minmax"):
        convert.reducer_to_proto("mean")
    with pytest.raises(InvalidArgument, match="valid: bins, edges, max, min, sample_size"):
        convert.reducer_to_proto({"histogram": {"bucket": 3}})
    with pytest.raises(InvalidArgument):
        convert.reducer_to_proto({"moments": {}, "minmax": {}})


def test_tap_spec_round_trip_and_validation() -> None:
    spec = layertap.TapSpec(
        "layer*", reducers=("moments", {"per_channel": {"dim": 1}}), point="input", every=10, name="t"
    )
    wire = convert.tap_spec_to_proto(spec)
    assert wire.sampling.every_n == 10 and wire.point == telemetry_pb2.POINT_INPUT
    assert convert.tap_spec_from_proto(wire) == spec
    assert not wire.keep_padding  # padding is left out unless the tap keeps it
    kept = layertap.TapSpec("x", keep_padding=True)
    assert convert.tap_spec_to_proto(kept).keep_padding
    assert convert.tap_spec_from_proto(convert.tap_spec_to_proto(kept)) == kept
    assert tap_spec("x", {"keep_padding": True}) == kept and tap_spec(kept, {"keep_padding": None}) == kept
    for bad in (
        layertap.TapSpec("x", every=0),
        layertap.TapSpec("x", probability=1.5),
        layertap.TapSpec("x", reducers=()),
        layertap.TapSpec("", reducers=("moments",)),
        layertap.TapSpec("x", point="middle"),
    ):
        with pytest.raises(InvalidArgument):
            convert.tap_spec_to_proto(bad)
    req = convert.create_tap_request(spec, ttl=1.5, forever=False)
    assert req.ttl.seconds == 1 and req.ttl.nanos == 500_000_000
    with pytest.raises(InvalidArgument):
        convert.create_tap_request(spec, ttl=5, forever=True)


def test_summary_and_tap_info_conversion() -> None:
    s = telemetry_pb2.Summary(tap="t1", layer="layer1", point=telemetry_pb2.POINT_OUTPUT, pass_index=9)
    s.wall_time.FromNanoseconds(1_500_000_000)
    s.results.add().moments.CopyFrom(telemetry_pb2.Moments(count=4, mean=0.5, std=2.0))
    s.results.add().nonfinite.CopyFrom(telemetry_pb2.Nonfinite(nan_count=1))
    s.results.add().histogram.CopyFrom(telemetry_pb2.Histogram(edges=[0.0], counts=[1, 2]))
    out = convert.summary_from_proto(s)
    assert out.step is None and out.wall_time == 1.5 and out.pass_index == 9
    assert out.results["moments"] == layertap.Moments(4, 0.5, 2.0)
    assert out.results["nonfinite"] == layertap.Nonfinite(1, 0)
    assert out.results["histogram"] == layertap.Histogram([0.0], [1, 2], 0, 0)
    s.has_step, s.step = True, 42
    assert convert.summary_from_proto(s).step == 42

    info = telemetry_pb2.TapInfo(id="t1", kind=telemetry_pb2.TAP_KIND_DURABLE, layers=["a"])
    info.created_at.FromSeconds(100)
    tap = convert.tap_info_from_proto(info)
    assert tap.kind == "durable" and tap.expires_at is None
    assert tap.created_at is not None and tap.created_at.timestamp() == 100


def _filled(msg: Any, seed: int) -> Any:
    """Sets every scalar and repeated scalar field of ``msg`` to a distinct non-default value."""
    from google.protobuf.descriptor import FieldDescriptor

    for i, fd in enumerate(msg.DESCRIPTOR.fields, start=seed):
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            continue
        value: Any = i + 0.25 if fd.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT) else (
            f"s{i}" if fd.type == FieldDescriptor.TYPE_STRING else True if fd.type == FieldDescriptor.TYPE_BOOL else i)
        if fd.is_repeated:
            getattr(msg, fd.name).extend([value, value])
        else:
            setattr(msg, fd.name, value)
    return msg


def test_summary_conversion_matches_the_generic_field_copy() -> None:
    """summary_from_proto is written out for speed: it must agree with _from_fields on every field and kind."""
    s = _filled(telemetry_pb2.Summary(), 1)
    s.point = telemetry_pb2.POINT_GRAD_OUTPUT
    s.phase = telemetry_pb2.PHASE_DECODE
    s.wall_time.FromNanoseconds(2_250_000_000)
    for n, kind in enumerate(convert._RESULT_TYPES):
        _filled(getattr(s.results.add(), kind), 10 * n + 3)
    s.results.add()  # an empty oneof (a reducer newer than this client): skipped
    out = convert.summary_from_proto(s)
    generic = convert._from_fields(
        layertap.Summary, s, point="grad_output", step=s.step, rank=s.rank, wall_time=2.25, phase="decode",
        position=s.position, request_ids=tuple(s.request_ids),
        results={kind: convert._from_fields(cls, getattr(r, kind))
                 for r, (kind, cls) in zip(s.results, convert._RESULT_TYPES.items())})
    assert out == generic
    assert set(out.results) == set(convert._RESULT_TYPES)
    s.has_step = s.has_rank = s.has_position = False
    plain = convert.summary_from_proto(s)
    assert plain.step is None and plain.rank is None and plain.position is None
    s.phase = telemetry_pb2.PHASE_UNSPECIFIED
    assert convert.summary_from_proto(s).phase == ""


def test_drift_conversion() -> None:
    resp = telemetry_pb2.GetDriftResponse()
    d = resp.layers.add(layer="layer3", state=telemetry_pb2.BASELINE_STATE_READY, psi=0.3, drifted=True)
    d.channel_drift_fraction = -1
    d.thresholds.psi = 0.2
    (out,) = convert.drift_from_proto(resp)
    assert out.state == "ready" and out.drifted and out.channel_drift_fraction is None
    assert out.thresholds.psi == 0.2
    req = convert.set_baseline_request("layer*", passes=10, window=5, point="output", thresholds={"psi": 0.25})
    assert req.thresholds.psi == 0.25 and req.thresholds.js == 0.0
    with pytest.raises(InvalidArgument, match="unknown drift threshold"):
        convert.set_baseline_request("x", passes=1, window=1, point="output", thresholds={"kl": 1})


# --------------------------------------------------------------------------- streams through a scripted server


class ScriptedTelemetry(telemetry_pb2_grpc.TelemetryServiceServicer):
    """Just enough TelemetryService to drive taps and subscriptions."""

    def __init__(self) -> None:
        self.batches: list[telemetry_pb2.SubscribeResponse] = []
        self.subscribe_requests: list[telemetry_pb2.SubscribeRequest] = []
        self.created: list[telemetry_pb2.CreateTapRequest] = []
        self.deleted: list[str] = []
        self.hold_open = threading.Event()

    def Subscribe(self, request: Any, context: Any) -> Iterator[telemetry_pb2.SubscribeResponse]:
        self.subscribe_requests.append(request)
        yield from self.batches
        self.hold_open.wait(10)  # Like a live stream: open until cancelled.

    def CreateTap(self, request: Any, context: Any) -> telemetry_pb2.CreateTapResponse:
        self.created.append(request)
        info = telemetry_pb2.TapInfo(id=f"tap-{len(self.created)}", spec=request.spec, kind=telemetry_pb2.TAP_KIND_DURABLE)
        return telemetry_pb2.CreateTapResponse(tap=info)

    def DeleteTap(self, request: Any, context: Any) -> telemetry_pb2.DeleteTapResponse:
        self.deleted.append(request.id)
        return telemetry_pb2.DeleteTapResponse()


@pytest.fixture()
def telemetry(grpc_server: Callable[..., str]) -> Iterator[tuple[ScriptedTelemetry, str]]:
    servicer = ScriptedTelemetry()
    yield servicer, grpc_server(telemetry=servicer)
    servicer.hold_open.set()  # before the server stops (a later teardown)


def _batch(layers: Sequence[str], pass_index: int, dropped: int = 0) -> telemetry_pb2.SubscribeResponse:
    msg = telemetry_pb2.SubscribeResponse(dropped=dropped)
    for layer in layers:
        s = msg.summaries.add(tap="s1", layer=layer, pass_index=pass_index)
        s.results.add().moments.CopyFrom(telemetry_pb2.Moments(count=1, mean=float(pass_index)))
    return msg


def test_watch_flattens_batches_and_tracks_drops_and_events(telemetry: tuple[ScriptedTelemetry, str]) -> None:
    servicer, target = telemetry
    first = _batch(["layer1", "layer2"], 0)
    first.stream_tap_ids.append("s1")
    events_only = telemetry_pb2.SubscribeResponse(dropped=3)
    events_only.events.add(tap="s1", kind="disabled", message="reducer failed")
    servicer.batches = [first, events_only, _batch(["layer1"], 1, dropped=3)]
    with layertap.Client(target) as client:
        with client.watch("layer*", reducers="moments,nonfinite", every=5, queue_size=8) as stream:
            got = [next(stream) for _ in range(3)]
            assert [(s.layer, s.pass_index) for s in got] == [("layer1", 0), ("layer2", 0), ("layer1", 1)]
            assert got[2].results["moments"].mean == 1.0  # type: ignore[union-attr]
            assert stream.dropped == 3 and stream.stream_tap_ids == ["s1"]
            assert [e.kind for e in stream.events] == ["disabled"]
        assert list(stream) == []  # closed: iteration ends cleanly
    (req,) = servicer.subscribe_requests
    (tap,) = req.stream_taps
    assert tap.selector == "layer*" and tap.sampling.every_n == 5 and req.queue_size == 8
    assert [r.kind for r in tap.reducers] == [telemetry_pb2.REDUCER_KIND_MOMENTS, telemetry_pb2.REDUCER_KIND_NONFINITE]


def test_tap_context_manager_deletes_tap_even_on_error(telemetry: tuple[ScriptedTelemetry, str]) -> None:
    servicer, target = telemetry
    servicer.batches = [_batch(["layer4"], 7)]
    with layertap.Client(target) as client:
        with pytest.raises(KeyError):
            with client.tap("layer4", reducers=[{"histogram": {"bins": 8}}], ttl=30) as handle:
                assert handle.id == "tap-1"
                assert handle.info.spec.reducers == ({"histogram": {"bins": 8}},)
                summary = next(handle.summaries())
                assert summary.pass_index == 7
                raise KeyError("user code failed")
    assert servicer.deleted == ["tap-1"]
    assert servicer.created[0].ttl.seconds == 30
    assert list(servicer.subscribe_requests[0].tap_ids) == ["tap-1"]


def test_numpy_input_while_torch_is_half_imported(monkeypatch):
    """Another thread importing torch leaves a partial module in sys.modules."""
    import sys
    import types

    partial = types.ModuleType("torch")  # no Tensor attribute yet
    monkeypatch.setitem(sys.modules, "torch", partial)
    msg = codec.encode_tensor(np.zeros((2, 3), np.float32))
    assert list(msg.shape) == [2, 3]
