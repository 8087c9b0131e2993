"""Status codes become the right LayertapError, through a real gRPC server."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.any_pb2 import Any as Any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

import layertap
from layertap import (
    AlreadyExists,
    CaptureTooLarge,
    ClientClosed,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LayerNotFound,
    LayertapError,
    NotFound,
    ResourceExhausted,
    ServerUnavailable,
)
from layertap.v1 import telemetry_pb2

pytestmark = pytest.mark.unit

UNKNOWN_LAYER = (
    "unknown layer 'layer5'; did you mean: layer4, layer3? "
    "Hint: list layers with ListLayers / client.layers()"
)


class AbortingHandler(grpc.GenericRpcHandler):
    """Answers every method by aborting with the configured status.

    With a ``reason``, the status carries the details a layertap server sends:
    an ErrorInfo (domain layertap.dev) and, given a ``violation``, a BadRequest.
    """

    def __init__(self) -> None:
        self.code = grpc.StatusCode.INTERNAL
        self.details = "boom"
        self.reason: str | None = None
        self.metadata: dict[str, str] = {}
        self.violation: tuple[str, str] | None = None
        self.delay = 0.0
        self.layer_names: list[str] | None = None

    def rich_status(self) -> grpc.Status:
        info = Any_pb2()
        info.Pack(error_details_pb2.ErrorInfo(reason=self.reason, domain="layertap.dev", metadata=self.metadata))
        details = [info]
        if self.violation is not None:
            bad = Any_pb2()
            field, description = self.violation
            bad.Pack(error_details_pb2.BadRequest(
                field_violations=[error_details_pb2.BadRequest.FieldViolation(field=field, description=description)]
            ))
            details.append(bad)
        status = status_pb2.Status(code=self.code.value[0], message=self.details, details=details)
        return rpc_status.to_status(status)

    def service(self, call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = call_details.method.rsplit("/", 1)[-1]  # type: ignore[attr-defined]
        if method == "ListLayers" and self.layer_names is not None:
            resp = telemetry_pb2.ListLayersResponse(
                layers=[telemetry_pb2.LayerInfo(name=n) for n in self.layer_names]
            )
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: resp, response_serializer=lambda m: m.SerializeToString()
            )

        def abort(request: bytes, context: grpc.ServicerContext) -> Any:
            if self.delay:
                time.sleep(self.delay)
            if self.reason is not None:
                context.abort_with_status(self.rich_status())
            context.abort(self.code, self.details)

        if method in ("Capture", "Subscribe"):

            def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                abort(request, context)
                yield b""

            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(abort)


@pytest.fixture()
def server(grpc_server: Callable[..., str]) -> tuple[AbortingHandler, str]:
    handler = AbortingHandler()
    return handler, grpc_server(handler)


#: (code, details, expected class, ErrorInfo reason and metadata the server attaches, or None)
CASES = [
    (grpc.StatusCode.NOT_FOUND, "unknown tap 'abc'", NotFound, None),
    (grpc.StatusCode.NOT_FOUND, "no tap 'layer4-stats'; list taps with ListTaps", NotFound, ("NOT_FOUND", {})),
    (grpc.StatusCode.NOT_FOUND, UNKNOWN_LAYER, LayerNotFound, ("LAYER_NOT_FOUND", {"layer": "layer5"})),
    # The class comes from the reason, never from the message text.
    (grpc.StatusCode.NOT_FOUND, UNKNOWN_LAYER, NotFound, None),
    (grpc.StatusCode.INVALID_ARGUMENT, "expected 602112 bytes, got 12", InvalidArgument, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent captures (limit 4)", ResourceExhausted, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Capture too large: 300 MiB over the 256 MiB cap", CaptureTooLarge,
     ("CAPTURE_TOO_LARGE", {"max_bytes": "268435456"})),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "capture too large (no details)", ResourceExhausted, None),
    (grpc.StatusCode.FAILED_PRECONDITION, "TorchScript modules refuse hooks", FailedPrecondition, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "server gave up", DeadlineExceeded, None),
    (grpc.StatusCode.UNAVAILABLE, "shutting down", ServerUnavailable, None),
    (grpc.StatusCode.CANCELLED, "cancelled", LayertapError, None),
    (grpc.StatusCode.UNKNOWN, "what", LayertapError, None),
    (grpc.StatusCode.ALREADY_EXISTS, "dup", AlreadyExists, ("ALREADY_EXISTS", {})),
    (grpc.StatusCode.ALREADY_EXISTS, "dup", AlreadyExists, None),
    (grpc.StatusCode.PERMISSION_DENIED, "no", layertap.PermissionDenied, None),
    (grpc.StatusCode.PERMISSION_DENIED, "no", layertap.PermissionDenied, ("PERMISSION_DENIED", {"scope": "capture"})),
    (grpc.StatusCode.ABORTED, "aborted", LayertapError, None),
    (grpc.StatusCode.OUT_OF_RANGE, "range", LayertapError, None),
    (grpc.StatusCode.UNIMPLEMENTED, "not yet", LayertapError, None),
    (grpc.StatusCode.INTERNAL, "bug", LayertapError, ("INTERNAL", {})),
    (grpc.StatusCode.DATA_LOSS, "lost", LayertapError, None),
    (grpc.StatusCode.UNAUTHENTICATED, "who", layertap.Unauthenticated, None),
    (grpc.StatusCode.UNAUTHENTICATED, "who", layertap.Unauthenticated, ("UNAUTHENTICATED", {"method": "/x/Y"})),
]

CALLS: dict[str, Callable[[layertap.Client], object]] = {
    "unary": lambda c: c.stats(),
    "capture": lambda c: c.capture("layer5"),
    "watch": lambda c: next(c.watch("layer5")),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(
    ("code", "details", "expected", "info"), CASES, ids=lambda v: getattr(v, "name", None)
)
def test_status_code_maps_to_error_class(
    server: tuple[AbortingHandler, str],
    call: str,
    code: grpc.StatusCode,
    details: str,
    expected: type[LayertapError],
    info: tuple[str, dict[str, str]] | None,
) -> None:
    handler, target = server
    handler.code, handler.details = code, details
    if info is not None:
        handler.reason, handler.metadata = info
    with layertap.Client(target, timeout=5) as client, pytest.raises(LayertapError) as raised:
        CALLS[call](client)
    err = raised.value
    assert type(err) is expected
    assert err.code == code.name
    assert err.details == details
    assert isinstance(err.__cause__, grpc.RpcError)
    assert err.reason == (info[0] if info else "")
    assert err.metadata == (info[1] if info else {})


def test_invalid_argument_names_its_field(server: tuple[AbortingHandler, str]) -> None:
    handler, target = server
    handler.code, handler.details = grpc.StatusCode.INVALID_ARGUMENT, "spec.reducers[0]: unknown reducer 'mean'"
    handler.reason, handler.metadata = "INVALID_ARGUMENT", {"field": "spec.reducers[0]"}
    handler.violation = ("spec.reducers[0]", "unknown reducer 'mean'")
    with layertap.Client(target) as client, pytest.raises(InvalidArgument) as raised:
        client.create_tap("layer1")
    assert raised.value.field == "spec.reducers[0]"
    assert raised.value.reason == "INVALID_ARGUMENT"
    # A BadRequest alone (no field in the ErrorInfo) names the field too.
    handler.metadata = {}
    with layertap.Client(target) as client, pytest.raises(InvalidArgument) as raised:
        client.create_tap("layer1")
    assert raised.value.field == "spec.reducers[0]"


def test_layer_not_found_keeps_server_suggestions(server: tuple[AbortingHandler, str]) -> None:
    handler, target = server
    handler.code, handler.details = grpc.StatusCode.NOT_FOUND, UNKNOWN_LAYER
    handler.reason = "LAYER_NOT_FOUND"
    handler.metadata = {"layer": "layer5", "suggestions": "layer4,layer3"}
    with layertap.Client(target) as client, pytest.raises(LayerNotFound) as info:
        client.capture("layer5")
    err = info.value
    assert err.layer == "layer5"
    assert err.suggestions == ["layer4", "layer3"]
    assert "layer4" in str(err) and "client.layers()" in str(err)
    assert isinstance(err, LookupError) and isinstance(err, NotFound)


def test_layer_not_found_computes_suggestions_when_server_gives_none(
    server: tuple[AbortingHandler, str],
) -> None:
    handler, target = server
    handler.code, handler.details = grpc.StatusCode.NOT_FOUND, "unknown layer 'layr4'"
    handler.reason, handler.metadata = "LAYER_NOT_FOUND", {"layer": "layr4"}
    handler.layer_names = ["conv1", "layer1", "layer4", "fc"]
    with layertap.Client(target) as client, pytest.raises(LayerNotFound) as info:
        client.capture("layr4")
    assert info.value.suggestions[0] == "layer4"
    assert "did you mean: layer4" in str(info.value)
    assert "client.layers()" in str(info.value)


def test_client_deadline_raises_deadline_exceeded(server: tuple[AbortingHandler, str]) -> None:
    handler, target = server
    handler.delay = 10.0
    with layertap.Client(target, timeout=30) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.stats(timeout=0.3)
        assert time.monotonic() - start < 5.0  # the call's own 0.3 s deadline, not the handler's 10 s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_server_down_raises_unavailable_within_deadline() -> None:
    start = time.monotonic()
    with layertap.Client(f"127.0.0.1:{_closed_port()}", timeout=30) as client:
        with pytest.raises(ServerUnavailable) as info:
            client.metadata()
    assert info.value.code == "UNAVAILABLE"
    assert time.monotonic() - start < 15.0  # refused at connect, not after the 30 s deadline


def test_use_after_close_raises_client_closed(server: tuple[AbortingHandler, str]) -> None:
    _, target = server
    client = layertap.Client(target)
    client.close()
    client.close()  # idempotent
    assert client.closed
    with pytest.raises(ClientClosed) as info:
        client.layers()
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ClientClosed):
        client.watch("layer1")
    with pytest.raises(ClientClosed):
        with client:
            pass


def test_client_side_validation_is_invalid_argument(server: tuple[AbortingHandler, str]) -> None:
    _, target = server
    with layertap.Client(target) as client:
        with pytest.raises(InvalidArgument, match="valid reducers: moments"):
            client.create_tap("layer1", reducers=["mean"])
        with pytest.raises(InvalidArgument):
            client.capture("layer1", n=0)
        with pytest.raises(InvalidArgument):
            client.capture("layer1", dtype="int8")
        with pytest.raises(ValueError):  # InvalidArgument is a ValueError
            client.capture("layer1", point="gradient")  # no such point (grad points go to the server)
