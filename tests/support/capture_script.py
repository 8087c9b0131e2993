"""A scripted Capture endpoint: the fake server the client's capture tests replay streams from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from layertap.v1 import telemetry_pb2


class CaptureScript(grpc.GenericRpcHandler):
    """A Capture endpoint that replays ``responses`` as they are at call time and records the requests."""

    def __init__(self) -> None:
        self.responses: list[telemetry_pb2.CaptureResponse] = []
        self.requests: list[telemetry_pb2.CaptureRequest] = []

    def service(self, call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not call_details.method.endswith("/Capture"):  # type: ignore[attr-defined]
            return None

        def stream(request: telemetry_pb2.CaptureRequest, context: Any) -> Iterator[Any]:
            self.requests.append(request)
            yield from self.responses

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=telemetry_pb2.CaptureRequest.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )
