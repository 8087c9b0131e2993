"""Requests whose bytes are not the method's message get INVALID_ARGUMENT naming ``request``.

grpc's Python server parses a request with the handler's deserializer
before any service code runs; bytes that do not parse end the call as
``INTERNAL: Exception deserializing request!``, a server-fault code for a
client's mistake. This interceptor, innermost of the server's, swaps each
handler's deserializer for one that returns a marker instead of raising, and
its behaviour answers the marker with ``INVALID_ARGUMENT`` and the message
type expected, the way every other bad input is answered: before the service
runs for a single request (also ``Health.Watch``, which answers through a
callback), or when the service reads the marker from a request stream
(reflection).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_status import rpc_status

from layertap.server.errors import InvalidField, rich_status
from layertap.server.rpc.method_handlers import behavior_of, rebuild

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
    context.abort_with_status(rpc_status.to_status(rich_status(InvalidField("request", request.why))))


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    """A request stream that ends the call at its first unparseable message."""
    for request in requests:
        yield _parsed(request, context)


def _parsed(request: Any, context: grpc.ServicerContext) -> Any:
    """``request``, or the call ended ``INVALID_ARGUMENT`` when it did not parse."""
    if isinstance(request, _Unparsed):
        _refuse(request, context)
    return request


def _wrap(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The handler's behaviour, refusing unparsed requests first; grpc's attributes kept."""
    streaming_in, streaming_out = handler.request_streaming, handler.response_streaming
    inner = behavior_of(handler)
    admit = _checked if streaming_in else _parsed
    behavior: Callable[..., Any]
    # grpc hands a callback only to response-streaming behaviours marked non-blocking.
    if streaming_out and getattr(inner, "experimental_non_blocking", False):
        def callback(request: Any, context: grpc.ServicerContext,
                     send_response_callback: Callable[[Any], None]) -> Any:  # grpc passes it by name
            return inner(admit(request, context), context, send_response_callback)
        behavior = callback
        behavior.experimental_non_blocking = True  # type: ignore[attr-defined]
    else:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            return inner(admit(request, context), context)
        behavior = call
    pool = getattr(inner, "experimental_thread_pool", None)
    if pool is not None:
        behavior.experimental_thread_pool = pool  # type: ignore[union-attr]
    return behavior


class MalformedRequests(grpc.ServerInterceptor):
    """Unparseable requests end ``INVALID_ARGUMENT`` (field ``request``), not ``INTERNAL``."""

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return rebuild(handler, _wrap(handler), request_deserializer=_safe(handler.request_deserializer))
