"""The client's one way to the server: channel, stubs, deadlines, error translation.

Every RPC the client makes goes through a :class:`Transport`, named by a
:class:`Unary` or :class:`Streaming` handle that the calling module declares
next to its method: the request and response types and the method's name. So
a new RPC adds its handle and method in one module and nothing here. The
:class:`~layertap.Client` and its sub-clients (``client.incidents``,
``client.baselines``) build requests and read responses; none of them holds a
stub or a channel, and none reads another object's private attributes.

What the transport owns, in one place each:

* the channel, with the bearer token on every call (:mod:`layertap._channel`);
* the deadline of a call: the client's default unless ``timeout=`` says
  otherwise, ``math.inf`` for none; subscriptions have none by default;
* error translation: a ``grpc.RpcError`` becomes a
  :class:`~layertap.LayertapError` (:func:`~layertap._errors.from_rpc_error`),
  or :class:`~layertap.ClientClosed` once the client was closed;
* the lifecycle: after :meth:`Transport.close`, every call raises
  :class:`~layertap.ClientClosed`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from ._channel import TlsOption, open_channel
from ._errors import ClientClosed, InvalidArgument, from_rpc_error
from .v1 import telemetry_pb2

__all__ = ["LIST_LAYERS", "ServerStream", "Streaming", "Transport", "Unary"]

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Resp_co = TypeVar("Resp_co", covariant=True)

#: The deadline of the ListLayers call behind a layer-not-found hint.
_LAYER_NAMES_TIMEOUT = 5.0


ReqMsg = TypeVar("ReqMsg", bound=Message)
RespMsg = TypeVar("RespMsg", bound=Message)


@dataclass(frozen=True)
class _Rpc(Generic[ReqMsg, Resp]):
    """An RPC by name (``/layertap.v1.<service>/<method>``), its request type and response parser."""

    service: str
    method: str
    request: type[ReqMsg]
    deserialize: Callable[[bytes], Resp]

    @property
    def path(self) -> str:
        return f"/layertap.v1.{self.service}/{self.method}"


class Unary(_Rpc[ReqMsg, Resp]):
    """A unary-unary RPC."""

    @classmethod
    def of(cls, service: str, method: str, request: type[ReqMsg], response: type[RespMsg]) -> Unary[ReqMsg, RespMsg]:
        """The handle of ``service.method`` taking ``request`` and answering ``response``."""
        return Unary(service, method, request, response.FromString)


class Streaming(_Rpc[ReqMsg, Resp]):
    """A unary-stream RPC."""

    @classmethod
    def of(cls, service: str, method: str, request: type[ReqMsg],
           response: type[RespMsg]) -> Streaming[ReqMsg, RespMsg]:
        """The handle of ``service.method`` taking ``request`` and streaming ``response``."""
        return Streaming(service, method, request, response.FromString)


class ServerStream(Protocol[Resp_co]):
    """An open server stream: iterate it for responses, cancel it to end it early."""

    def __iter__(self) -> Iterator[Resp_co]: ...

    def __next__(self) -> Resp_co: ...

    def cancel(self) -> bool: ...


#: Also the layer-not-found hint's call, so it lives here.
LIST_LAYERS = Unary.of("TelemetryService", "ListLayers", telemetry_pb2.ListLayersRequest,
                        telemetry_pb2.ListLayersResponse)


class Transport:
    """One channel to one server, and the rules every call on it follows.

    Args:
        target: A normalized gRPC target (``host:port``).
        timeout: Default deadline of a call, in seconds (> 0).
        options: gRPC channel options (message size limits).
        token: Bearer token; None reads ``$LAYERTAP_TOKEN``, "" sends none.
        tls: As for :class:`~layertap.Client`.
    """

    def __init__(self, target: str, *, timeout: float, options: list[tuple[str, Any]], token: str | None,
                 tls: TlsOption) -> None:
        self.target = target
        self.timeout = timeout
        self._channel, self._calls = open_channel(target, options, token, tls)
        #: Multi-callables by method path, made on first use (gRPC's stubs do the same at construction).
        self._unary: dict[str, grpc.UnaryUnaryMultiCallable[Any, Any]] = {}
        self._streaming: dict[str, grpc.UnaryStreamMultiCallable[Any, Any]] = {}
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Closes the channel and cancels its in-flight calls. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._channel.close()

    def check_open(self) -> None:
        """Raises :class:`~layertap.ClientClosed` once :meth:`close` was called."""
        if self._closed:
            raise ClientClosed(f"this layertap.Client for {self.target} is closed; create a new one")

    def deadline(self, timeout: float | None, *, open_ended: bool = False) -> float | None:
        """The gRPC deadline of a call given ``timeout=``: None waits forever.

        Args:
            timeout: Seconds; None takes the default (none when ``open_ended``),
                ``math.inf`` waits forever.
            open_ended: A subscription, which has no deadline unless given one.

        Raises:
            InvalidArgument: A timeout that is not > 0.
        """
        if open_ended and timeout is None:
            return None
        t = self.timeout if timeout is None else timeout
        if math.isinf(t):
            return None
        if not t > 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {t}")
        return t

    def _layer_names(self) -> list[str]:
        resp = self._unary_call(LIST_LAYERS)(telemetry_pb2.ListLayersRequest(),
                                                timeout=min(self.timeout, _LAYER_NAMES_TIMEOUT))
        return [layer.name for layer in resp.layers]

    @contextmanager
    def translating(self, *, layer_hint: bool = False) -> Iterator[None]:
        """The one place where gRPC errors become layertap errors.

        Wrap the reading of a stream in it; :meth:`unary` and :meth:`stream`
        wrap themselves.

        Args:
            layer_hint: A LAYER_NOT_FOUND without suggestions gets some, from
                the server's layer names.

        Raises:
            ClientClosed: The transport is closed, or was closed during the call.
            LayertapError: The call failed (see ``layertap._errors``).
        """
        self.check_open()
        try:
            yield
        except grpc.RpcError as exc:
            mapped = (
                ClientClosed(f"this layertap.Client for {self.target} was closed during the call")
                if self._closed
                else from_rpc_error(exc, layer_names=self._layer_names if layer_hint else None)
            )
            raise mapped from exc

    def unary(self, rpc: Unary[ReqMsg, Resp], request: ReqMsg, *, timeout: float | None = None,
              layer_hint: bool = False) -> Resp:
        """Makes a unary call with the default deadline unless ``timeout`` says otherwise.

        Raises:
            ClientClosed, InvalidArgument, LayertapError: As for :meth:`translating`
                and :meth:`deadline`.
        """
        with self.translating(layer_hint=layer_hint):
            return self._unary_call(rpc)(request, timeout=self.deadline(timeout))

    def stream(self, rpc: Streaming[ReqMsg, Resp], request: ReqMsg, *, timeout: float | None = None,
               open_ended: bool = False, layer_hint: bool = False) -> ServerStream[Resp]:
        """Opens a server stream; read it inside :meth:`translating`.

        Args:
            open_ended: A subscription: no deadline unless ``timeout`` gives one.
        """
        self.check_open()
        deadline = self.deadline(timeout, open_ended=open_ended)
        with self.translating(layer_hint=layer_hint):
            call: ServerStream[Resp] = self._stream_call(rpc)(request, timeout=deadline)
        return call

    def _unary_call(self, rpc: Unary[ReqMsg, Resp]) -> grpc.UnaryUnaryMultiCallable[ReqMsg, Resp]:
        call = self._unary.get(rpc.path)
        if call is None:
            call = self._unary[rpc.path] = self._calls.unary_unary(
                rpc.path, request_serializer=rpc.request.SerializeToString, response_deserializer=rpc.deserialize)
        return call

    def _stream_call(self, rpc: Streaming[ReqMsg, Resp]) -> grpc.UnaryStreamMultiCallable[ReqMsg, Resp]:
        call = self._streaming.get(rpc.path)
        if call is None:
            call = self._streaming[rpc.path] = self._calls.unary_stream(
                rpc.path, request_serializer=rpc.request.SerializeToString, response_deserializer=rpc.deserialize)
        return call
