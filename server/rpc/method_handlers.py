"""grpc method handlers: their four kinds, and a service's handler table built from its descriptor.

A handler's kind, ``(request streaming, response streaming)``, decides which
of its four behaviour attributes grpc calls and which
``grpc.*_rpc_method_handler`` builds it. The interceptors that wrap a handler
(admission, malformed requests) read and rebuild kinds here, so the four
cases are spelled out once.

:func:`service_handlers` serves one proto service from several servicer
objects, one per resource: the table is the descriptor's methods, each bound
to the one servicer that defines it, with the serializers of the descriptor's
message classes (the generated ``add_*Servicer_to_server`` uses the same). A
method no servicer defines, or two do, fails at start-up, not as
UNIMPLEMENTED on the first call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

__all__ = ["KINDS", "Kind", "add_service", "behavior_of", "kind_of", "make_handler", "rebuild", "sends_wire_bytes",
           "service_handlers"]

#: ``(request streaming, response streaming)``.
Kind = tuple[bool, bool]
#: Each kind's behaviour attribute on a handler, and grpc's maker of a handler of that kind.
KINDS: dict[Kind, tuple[str, Callable[..., grpc.RpcMethodHandler]]] = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}

_F = TypeVar("_F", bound=Callable[..., Any])
#: Set by :func:`sends_wire_bytes` on a servicer method.
_WIRE_BYTES = "sends_wire_bytes"


def kind_of(handler: grpc.RpcMethodHandler) -> Kind:
    return bool(handler.request_streaming), bool(handler.response_streaming)


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The one behaviour grpc calls for this handler."""
    behavior: Callable[..., Any] = getattr(handler, KINDS[kind_of(handler)][0])
    return behavior


def make_handler(kind: Kind, behavior: Callable[..., Any], request_deserializer: Callable[[bytes], Any] | None,
                 response_serializer: Callable[[Any], bytes] | None) -> grpc.RpcMethodHandler:
    return KINDS[kind][1](behavior, request_deserializer=request_deserializer,
                          response_serializer=response_serializer)


def rebuild(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any], *,
            request_deserializer: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    """A handler of the same kind and serializer running ``behavior``; same deserializer unless given."""
    return make_handler(kind_of(handler), behavior, request_deserializer or handler.request_deserializer,
                        handler.response_serializer)


def sends_wire_bytes(method: _F) -> _F:
    """Mark a response-streaming servicer method that yields responses already serialized.

    Its handler gets no response serializer, so the bytes go out as they are.
    """
    setattr(method, _WIRE_BYTES, True)
    return method


def _rpc_names(servicer: object) -> list[str]:
    """The servicer's public methods named like RPCs (``CamelCase``)."""
    return [name for name in dir(type(servicer)) if name[:1].isupper() and callable(getattr(type(servicer), name))]


def _handler(method: MethodDescriptor, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    request = message_factory.GetMessageClass(method.input_type)
    response = message_factory.GetMessageClass(method.output_type)
    raw = getattr(behavior, _WIRE_BYTES, False)
    if raw and not method.server_streaming:
        raise ValueError(f"{method.full_name}: only a response stream can send wire bytes")
    return make_handler((method.client_streaming, method.server_streaming), behavior, request.FromString,
                        None if raw else response.SerializeToString)


def service_handlers(service: ServiceDescriptor, servicers: Iterable[object]) -> dict[str, grpc.RpcMethodHandler]:
    """Method name -> handler for every method of ``service``, each served by the one servicer defining it.

    Raises:
        ValueError: A method that no servicer, or more than one, defines; or a
            servicer method named like an RPC that the service lacks.
    """
    owners: dict[str, list[object]] = {m.name: [] for m in service.methods}
    for servicer in servicers:
        for name in _rpc_names(servicer):
            if name not in owners:
                raise ValueError(f"{type(servicer).__name__}.{name}: {service.full_name} has no method {name}")
            owners[name].append(servicer)
    missing = [name for name, found in owners.items() if not found]
    if missing:
        raise ValueError(f"{service.full_name}: no servicer defines {', '.join(missing)}")
    twice = {name: found for name, found in owners.items() if len(found) > 1}
    if twice:
        raise ValueError(f"{service.full_name}: more than one servicer defines "
                         + "; ".join(f"{n} ({', '.join(type(s).__name__ for s in f)})" for n, f in twice.items()))
    return {m.name: _handler(m, getattr(owners[m.name][0], m.name)) for m in service.methods}


def add_service(server: grpc.Server, service: ServiceDescriptor, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Register ``handlers`` as the generated ``add_*Servicer_to_server`` does: one generic handler, and by path."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
