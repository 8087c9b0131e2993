"""``rpc.malformed`` on every handler shape grpc has, including non-blocking (callback) ones.

The server's own services cover unary, server-streaming, ``Health.Watch`` and
reflection (tests/e2e/test_malformed_bytes.py); these handlers cover the
shapes none of them has, on a real grpc server over loopback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from layertap.server.rpc.malformed import MalformedRequests

pytestmark = pytest.mark.unit

GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x0f" + b"\x07garbage" * 100
REQ, REPLY = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
SERVING = REPLY(status=REPLY.SERVING)


def _bidi_callback(requests: Iterator[Any], context: grpc.ServicerContext,
                   send_response_callback: Callable[[Any], None]) -> None:
    for request in requests:
        assert isinstance(request, REQ)  # never a marker
        send_response_callback(SERVING)
    send_response_callback(None)


_bidi_callback.experimental_non_blocking = True  # type: ignore[attr-defined]


def _unary_flagged(request: Any, context: grpc.ServicerContext) -> Any:
    assert isinstance(request, REQ)
    return SERVING


_unary_flagged.experimental_non_blocking = True  # type: ignore[attr-defined]  # grpc ignores it on unary replies


def _stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
    return REPLY(status=REPLY.SERVING if all(isinstance(r, REQ) for r in requests) else REPLY.UNKNOWN)


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    handlers = grpc.method_handlers_generic_handler("t.T", {
        "Bidi": grpc.stream_stream_rpc_method_handler(_bidi_callback, REQ.FromString, REPLY.SerializeToString),
        "Unary": grpc.unary_unary_rpc_method_handler(_unary_flagged, REQ.FromString, REPLY.SerializeToString),
        "Upload": grpc.stream_unary_rpc_method_handler(_stream_unary, REQ.FromString, REPLY.SerializeToString),
    })
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[MalformedRequests()])
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    server.stop(0)


def _good() -> bytes:
    return REQ(service="x").SerializeToString()


def test_well_formed_calls_reach_every_shape(channel: grpc.Channel) -> None:
    assert REPLY.FromString(channel.unary_unary("/t.T/Unary")(_good(), timeout=5)) == SERVING
    replies = list(channel.stream_stream("/t.T/Bidi")(iter([_good(), _good()]), timeout=5))
    assert [REPLY.FromString(r) for r in replies] == [SERVING, SERVING]
    assert REPLY.FromString(channel.stream_unary("/t.T/Upload")(iter([_good()] * 3), timeout=5)) == SERVING


@pytest.mark.parametrize("method", ["Unary", "Bidi", "Upload"])
def test_garbage_is_invalid_argument_on_every_shape(channel: grpc.Channel, method: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        if method == "Unary":
            channel.unary_unary("/t.T/Unary")(GARBAGE, timeout=5)
        elif method == "Bidi":
            list(channel.stream_stream("/t.T/Bidi")(iter([_good(), GARBAGE]), timeout=5))
        else:
            channel.stream_unary("/t.T/Upload")(iter([_good(), GARBAGE]), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    assert info.value.details().startswith("request: ")
