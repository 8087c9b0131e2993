"""The client's one way to the server: channel, stubs, deadlines, error translation.

Every RPC the client makes goes through a :class:`Transport`, named by one of
the descriptors below (the table of every call the client makes). The
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
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import grpc

from ._capture_wire import CaptureMessage, capture_method
from ._channel import TlsOption, open_channel
from ._errors import ClientClosed, InvalidArgument, from_rpc_error
from .v1 import inference_pb2, inference_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc

__all__ = ["Transport", "Unary", "Streaming", "ServerStream"]

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Resp_co = TypeVar("Resp_co", covariant=True)

#: The deadline of the ListLayers call behind a layer-not-found hint.
_LAYER_NAMES_TIMEOUT = 5.0


class _Stubs(NamedTuple):
    inference: inference_pb2_grpc.InferenceServiceStub
    telemetry: telemetry_pb2_grpc.TelemetryServiceStub
    #: TelemetryService.Capture with its chunks read in place, not through protobuf.
    capture: grpc.UnaryStreamMultiCallable[telemetry_pb2.CaptureRequest, CaptureMessage]


@dataclass(frozen=True)
class Unary(Generic[Req, Resp]):
    """A unary-unary RPC: which stub method serves it."""

    pick: Callable[[_Stubs], grpc.UnaryUnaryMultiCallable[Req, Resp]]


@dataclass(frozen=True)
class Streaming(Generic[Req, Resp]):
    """A unary-stream RPC: which stub method serves it."""

    pick: Callable[[_Stubs], grpc.UnaryStreamMultiCallable[Req, Resp]]


class ServerStream(Protocol[Resp_co]):
    """An open server stream: iterate it for responses, cancel it to end it early."""

    def __iter__(self) -> Iterator[Resp_co]: ...

    def __next__(self) -> Resp_co: ...

    def cancel(self) -> bool: ...


# Every RPC the client makes.
GET_MODEL_METADATA: Unary[inference_pb2.GetModelMetadataRequest, inference_pb2.GetModelMetadataResponse] = Unary(
    lambda s: s.inference.GetModelMetadata)
INFER: Unary[inference_pb2.InferRequest, inference_pb2.InferResponse] = Unary(lambda s: s.inference.Infer)
LIST_LAYERS: Unary[telemetry_pb2.ListLayersRequest, telemetry_pb2.ListLayersResponse] = Unary(
    lambda s: s.telemetry.ListLayers)
GET_SERVER_STATS: Unary[telemetry_pb2.GetServerStatsRequest, telemetry_pb2.GetServerStatsResponse] = Unary(
    lambda s: s.telemetry.GetServerStats)
CAPTURE: Streaming[telemetry_pb2.CaptureRequest, CaptureMessage] = Streaming(lambda s: s.capture)
EXPLAIN: Unary[telemetry_pb2.ExplainRequest, telemetry_pb2.ExplainResponse] = Unary(lambda s: s.telemetry.Explain)
LIST_TAPS: Unary[telemetry_pb2.ListTapsRequest, telemetry_pb2.ListTapsResponse] = Unary(
    lambda s: s.telemetry.ListTaps)
CREATE_TAP: Unary[telemetry_pb2.CreateTapRequest, telemetry_pb2.CreateTapResponse] = Unary(
    lambda s: s.telemetry.CreateTap)
DELETE_TAP: Unary[telemetry_pb2.DeleteTapRequest, telemetry_pb2.DeleteTapResponse] = Unary(
    lambda s: s.telemetry.DeleteTap)
SUBSCRIBE: Streaming[telemetry_pb2.SubscribeRequest, telemetry_pb2.SubscribeResponse] = Streaming(
    lambda s: s.telemetry.Subscribe)
SET_BASELINE: Unary[telemetry_pb2.SetBaselineRequest, telemetry_pb2.SetBaselineResponse] = Unary(
    lambda s: s.telemetry.SetBaseline)
GET_DRIFT: Unary[telemetry_pb2.GetDriftRequest, telemetry_pb2.GetDriftResponse] = Unary(
    lambda s: s.telemetry.GetDrift)
EXPORT_BASELINE: Unary[telemetry_pb2.ExportBaselineRequest, telemetry_pb2.ExportBaselineResponse] = Unary(
    lambda s: s.telemetry.ExportBaseline)
INSTALL_BASELINE: Unary[telemetry_pb2.InstallBaselineRequest, telemetry_pb2.InstallBaselineResponse] = Unary(
    lambda s: s.telemetry.InstallBaseline)
LIST_INCIDENTS: Unary[telemetry_pb2.ListIncidentsRequest, telemetry_pb2.ListIncidentsResponse] = Unary(
    lambda s: s.telemetry.ListIncidents)
GET_INCIDENT: Streaming[telemetry_pb2.GetIncidentRequest, telemetry_pb2.GetIncidentResponse] = Streaming(
    lambda s: s.telemetry.GetIncident)
DELETE_INCIDENT: Unary[telemetry_pb2.DeleteIncidentRequest, telemetry_pb2.DeleteIncidentResponse] = Unary(
    lambda s: s.telemetry.DeleteIncident)


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
        self._channel, calls = open_channel(target, options, token, tls)
        self._stubs = _Stubs(
            inference_pb2_grpc.InferenceServiceStub(calls),
            telemetry_pb2_grpc.TelemetryServiceStub(calls),
            capture_method(calls),
        )
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
        resp = self._stubs.telemetry.ListLayers(
            telemetry_pb2.ListLayersRequest(), timeout=min(self.timeout, _LAYER_NAMES_TIMEOUT)
        )
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

    def unary(self, rpc: Unary[Req, Resp], request: Req, *, timeout: float | None = None,
              layer_hint: bool = False) -> Resp:
        """Makes a unary call with the default deadline unless ``timeout`` says otherwise.

        Raises:
            ClientClosed, InvalidArgument, LayertapError: As for :meth:`translating`
                and :meth:`deadline`.
        """
        with self.translating(layer_hint=layer_hint):
            return rpc.pick(self._stubs)(request, timeout=self.deadline(timeout))

    def stream(self, rpc: Streaming[Req, Resp], request: Req, *, timeout: float | None = None,
               open_ended: bool = False, layer_hint: bool = False) -> ServerStream[Resp]:
        """Opens a server stream; read it inside :meth:`translating`.

        Args:
            open_ended: A subscription: no deadline unless ``timeout`` gives one.
        """
        self.check_open()
        deadline = self.deadline(timeout, open_ended=open_ended)
        with self.translating(layer_hint=layer_hint):
            call: ServerStream[Resp] = rpc.pick(self._stubs)(request, timeout=deadline)
        return call
