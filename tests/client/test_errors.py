"""Status codes become the right LayertapError, through a real gRPC server."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

import layertap
from layertap import (
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

UNKNOWN_LAYER = (
    "unknown layer 'layer5'; did you mean: layer4, layer3? "
    "Hint: list layers with ListLayers / client.layers()"
)


class AbortingHandler(grpc.GenericRpcHandler):
    """Answers every method by aborting with the configured status."""

    def __init__(self) -> None:
        self.code = grpc.StatusCode.INTERNAL
        self.details = "boom"
        self.delay = 0.0
        self.layer_names: list[str] | None = None

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
            context.abort(self.code, self.details)

        if method in ("Capture", "Subscribe"):

            def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                abort(request, context)
                yield b""

            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(abort)


@pytest.fixture()
def server() -> Iterator[tuple[AbortingHandler, str]]:
    handler = AbortingHandler()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield handler, f"127.0.0.1:{port}"
    finally:
        srv.stop(0)


CASES = [
    (grpc.StatusCode.NOT_FOUND, "unknown tap 'abc'", NotFound),
    (grpc.StatusCode.NOT_FOUND, "no tap 'layer4-stats'; list taps with ListTaps", NotFound),
    (grpc.StatusCode.NOT_FOUND, UNKNOWN_LAYER, LayerNotFound),
    (grpc.StatusCode.INVALID_ARGUMENT, "expected 602112 bytes, got 12", InvalidArgument),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent captures (limit 4)", ResourceExhausted),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Capture too large: 300 MiB over the 256 MiB cap", CaptureTooLarge),
    (grpc.StatusCode.FAILED_PRECONDITION, "TorchScript modules refuse hooks", FailedPrecondition),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "server gave up", DeadlineExceeded),
    (grpc.StatusCode.UNAVAILABLE, "shutting down", ServerUnavailable),
    (grpc.StatusCode.CANCELLED, "cancelled", LayertapError),
    (grpc.StatusCode.UNKNOWN, "what", LayertapError),
    (grpc.StatusCode.ALREADY_EXISTS, "dup", LayertapError),
    (grpc.StatusCode.PERMISSION_DENIED, "no", LayertapError),
    (grpc.StatusCode.ABORTED, "aborted", LayertapError),
    (grpc.StatusCode.OUT_OF_RANGE, "range", LayertapError),
    (grpc.StatusCode.UNIMPLEMENTED, "not yet", LayertapError),
    (grpc.StatusCode.INTERNAL, "bug", LayertapError),
    (grpc.StatusCode.DATA_LOSS, "lost", LayertapError),
    (grpc.StatusCode.UNAUTHENTICATED, "who", LayertapError),
]

CALLS: dict[str, Callable[[layertap.Client], object]] = {
    "unary": lambda c: c.stats(),
    "capture": lambda c: c.capture("layer5"),
    "watch": lambda c: next(c.watch("layer5")),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(("code", "details", "expected"), CASES, ids=lambda v: getattr(v, "name", None))
def test_status_code_maps_to_error_class(
    server: tuple[AbortingHandler, str],
    call: str,
    code: grpc.StatusCode,
    details: str,
    expected: type[LayertapError],
) -> None:
    handler, target = server
    handler.code, handler.details = code, details
    with layertap.Client(target, timeout=5) as client, pytest.raises(LayertapError) as info:
        CALLS[call](client)
    err = info.value
    assert type(err) is expected
    assert err.code == code.name
    assert err.details == details
    assert isinstance(err.__cause__, grpc.RpcError)


def test_layer_not_found_keeps_server_suggestions(server: tuple[AbortingHandler, str]) -> None:
    handler, target = server
    handler.code, handler.details = grpc.StatusCode.NOT_FOUND, UNKNOWN_LAYER
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
    handler.layer_names = ["conv1", "layer1", "layer4", "fc"]
    with layertap.Client(target) as client, pytest.raises(LayerNotFound) as info:
        client.capture("layr4")
    assert info.value.suggestions[0] == "layer4"
    assert "did you mean: layer4" in str(info.value)
    assert "client.layers()" in str(info.value)


def test_client_deadline_raises_deadline_exceeded(server: tuple[AbortingHandler, str]) -> None:
    handler, target = server
    handler.delay = 3.0
    with layertap.Client(target, timeout=10) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.stats(timeout=0.3)
        assert time.monotonic() - start < 2.0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_server_down_raises_unavailable_within_deadline() -> None:
    start = time.monotonic()
    with layertap.Client(f"127.0.0.1:{_closed_port()}", timeout=3) as client:
        with pytest.raises(ServerUnavailable) as info:
            client.metadata()
    assert info.value.code == "UNAVAILABLE"
    assert time.monotonic() - start < 3.5


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
            client.capture("layer1", point="grad_output")
