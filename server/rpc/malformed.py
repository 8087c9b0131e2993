"""Requests whose bytes are not the method's message get INVALID_ARGUMENT naming ``request``.

grpc's Python server parses a request with the handler's deserializer
before any service code runs; bytes that do not parse end the call as
``INTERNAL: Exception deserializing request!``, a server-fault code for a
client's mistake. This interceptor, innermost of the server's, swaps each
unary-request handler's deserializer for one that returns a marker instead of
raising, and its behaviour answers the marker with ``INVALID_ARGUMENT`` and
the message type expected, the way every other bad input is answered.
Handlers that stream requests (reflection) or answer through callbacks
(``Health.Watch``) are left as grpc made them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_status import rpc_status

from layertap.server.errors import InvalidSpec, rich_status

__all__ = ["MalformedRequests"]


class _Unparsed:
    """What the safe deserializer returns for bytes that are not the expected message."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _safe(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    owner = getattr(deserialize, "__self__", None)
    name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request message")

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's bytes
            return _Unparsed(f"{len(data)} bytes that do not parse as {name} ({type(exc).__name__})")

    return parse


def _refuse(request: _Unparsed, context: grpc.ServicerContext) -> None:
    context.abort_with_status(rpc_status.to_status(rich_status(InvalidSpec("request", request.why))))


class MalformedRequests(grpc.ServerInterceptor):
    """Unparseable unary requests end ``INVALID_ARGUMENT`` (field ``request``), not ``INTERNAL``."""

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        inner = handler.unary_unary or handler.unary_stream
        if getattr(inner, "experimental_non_blocking", False):
            return handler
        behavior: Callable[..., Any]
        if handler.response_streaming:
            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                if isinstance(request, _Unparsed):
                    _refuse(request, context)
                yield from inner(request, context)
            behavior, make = stream, grpc.unary_stream_rpc_method_handler
        else:
            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Unparsed):
                    _refuse(request, context)
                return inner(request, context)
            behavior, make = unary, grpc.unary_unary_rpc_method_handler
        return make(behavior, request_deserializer=_safe(handler.request_deserializer),
                    response_serializer=handler.response_serializer)
