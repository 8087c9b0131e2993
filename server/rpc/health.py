"""``grpc.health.v1.Health`` with ``List`` answered.

grpcio-health-checking's servicer leaves ``List`` unimplemented: each call
answers UNIMPLEMENTED through an exception that grpc logs with a traceback,
and Health is open without a token, so anyone could flood the log. Here
``List`` returns a snapshot of the statuses ``set`` has recorded.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

#: google.golang.org/grpc's health server also caps List (RESOURCE_EXHAUSTED past it).
MAX_LISTED = 100
#: Longest service name Check and Watch accept. Health needs no token, and the
#: library keeps a Watch's name for the whole stream: unbounded, 48 streams of
#: 256 MiB names would pin 12 GiB.
MAX_SERVICE_NAME = 256


def _check_name(request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> None:
    if len(request.service) > MAX_SERVICE_NAME:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"service: at most {MAX_SERVICE_NAME} characters, got {len(request.service)}")


class HealthServicer(health.HealthServicer):
    """The library servicer, plus a ``List`` built from what ``set`` recorded."""

    def __init__(self) -> None:
        super().__init__()
        self._listed_lock = threading.Lock()
        self._listed: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType] = {
            "": health_pb2.HealthCheckResponse.SERVING,
        }
        self._frozen = False

    def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        # Same rule as the library: after a graceful shutdown began, sets are ignored.
        with self._listed_lock:
            if not self._frozen:
                self._listed[service] = status
        super().set(service, status)

    def Check(self, request: health_pb2.HealthCheckRequest,
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        _check_name(request, context)
        return super().Check(request, context)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              send_response_callback: Any = None) -> Any:
        _check_name(request, context)
        return super().Watch(request, context, send_response_callback)

    def enter_graceful_shutdown(self) -> None:
        with self._listed_lock:
            if not self._frozen:
                self._listed = dict.fromkeys(self._listed, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._frozen = True
        super().enter_graceful_shutdown()

    def List(self, request: health_pb2.HealthListRequest,
             context: grpc.ServicerContext) -> health_pb2.HealthListResponse:
        with self._listed_lock:
            snapshot = dict(self._listed)
        if len(snapshot) > MAX_LISTED:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {MAX_LISTED} services")
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in snapshot.items()})
