"""Fixtures of the client tests: throwaway gRPC servers that play a scripted part."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from layertap.v1 import telemetry_pb2_grpc

StartServer = Callable[..., str]


@pytest.fixture()
def grpc_server() -> Iterator[StartServer]:
    """Starts gRPC servers on loopback ports; all of them stop after the test.

    Call it with generic handlers and/or ``telemetry=`` a TelemetryService
    servicer; it returns the ``"127.0.0.1:port"`` target to give a Client.
    """
    servers: list[grpc.Server] = []

    def start(
        *handlers: grpc.GenericRpcHandler,
        telemetry: telemetry_pb2_grpc.TelemetryServiceServicer | None = None,
    ) -> str:
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if handlers:
            srv.add_generic_rpc_handlers(handlers)
        if telemetry is not None:
            telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server(telemetry, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return f"127.0.0.1:{port}"

    yield start
    for srv in servers:
        srv.stop(0)
