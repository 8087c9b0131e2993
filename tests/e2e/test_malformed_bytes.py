"""Bytes that do not parse as the method's request: INVALID_ARGUMENT naming ``request``, at once, for every method.

grpc alone answers them ``INTERNAL`` (a server fault); ``rpc.malformed`` makes them a client error like any other.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from grpc_status import rpc_status

from layertap import Client
from layertap.v1 import telemetry_pb2

pytestmark = pytest.mark.e2e

#: A varint that never ends, then a field of wire type 7 (there is none): no message parses from it.
GARBAGE = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x0f" + b"\x07garbage" * 100
METHODS = {
    "/layertap.v1.InferenceService/Infer": False,
    "/layertap.v1.InferenceService/GetModelMetadata": False,
    "/layertap.v1.TelemetryService/CreateTap": False,
    "/layertap.v1.TelemetryService/Capture": True,
    "/layertap.v1.TelemetryService/Subscribe": True,
    "/layertap.v1.TelemetryService/Explain": False,
    "/grpc.health.v1.Health/Check": False,
    "/grpc.health.v1.Health/Watch": True,  # grpc's non-blocking (callback) handler
    # A request stream (reflection): the call ends at the first unparseable message.
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": None,
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_unparseable_bytes_are_invalid_argument_naming_request(demo_server, method: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{demo_server.port}") as channel:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            if METHODS[method] is None:
                list(channel.stream_stream(method)(iter([GARBAGE]), timeout=10))
            elif METHODS[method]:
                list(channel.unary_stream(method)(GARBAGE, timeout=10))
            else:
                channel.unary_unary(method)(GARBAGE, timeout=10)
        assert time.monotonic() - start < 5
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert err.details().startswith("request: ") and "do not parse as" in err.details()
    status = rpc_status.from_call(err)
    assert status is not None and status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # The server is unharmed: it answers, with no hook, tap or subscriber left behind.
    with Client(f"127.0.0.1:{demo_server.port}") as client:
        client.infer(np.zeros((1, 3, 32, 32), np.float32))
        stats = client.stats()
        assert (stats.active_hooks, stats.taps, stats.subscribers) == (0, 0, 0)


def test_well_formed_bytes_still_reach_the_service(demo_server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{demo_server.port}") as channel:
        raw = channel.unary_unary("/layertap.v1.TelemetryService/ListTaps")
        assert telemetry_pb2.ListTapsResponse.FromString(
            raw(telemetry_pb2.ListTapsRequest().SerializeToString(), timeout=10)).taps == []
