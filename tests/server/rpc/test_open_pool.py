"""OpenPool on a bare grpc server: its read deadline without pressure, and its limit."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import h2.events
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.h2abuse import HEALTH_CHECK, H2Client

from layertap.server.rpc.health import HealthServicer
from layertap.server.rpc.open_pool import READ_TIMEOUT, OpenPool, OpenServices

pytestmark = pytest.mark.unit

HEALTH = frozenset({"grpc.health.v1.Health"})


@pytest.fixture
def serve():
    started: list[tuple[grpc.Server, OpenPool, HealthServicer]] = []

    def make(pool: OpenPool) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), interceptors=[OpenServices(pool, HEALTH)],
                             maximum_concurrent_rpcs=None)
        servicer = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append((server, pool, servicer))
        return port

    yield make
    for server, pool, servicer in started:
        server.stop(0).wait()
        pool.close()
        servicer.close()


def _reset(client: H2Client, sid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        client.pump(0.05)
        if any(isinstance(e, h2.events.StreamReset) and e.stream_id == sid for e in client.events):
            return True
    return False


@pytest.mark.timeout(30)
def test_a_stalled_call_is_cancelled_at_the_read_deadline_without_pressure(serve):
    pool = OpenPool(2, limit=8, read_timeout=0.5)
    port = serve(pool)
    client = H2Client(port)
    try:
        sid = client.start(HEALTH_CHECK, b"\x00\x00", end=False)
        client.flush()
        start = time.monotonic()
        assert _reset(client, sid, 8.0), "the stalled call was never cancelled"
        # At its 0.5 s, not at the default READ_TIMEOUT (10 s): half of that is room for a busy machine.
        assert 0.4 < time.monotonic() - start < READ_TIMEOUT / 2
        assert pool.cancelled == 1
        end = time.monotonic() + 15  # the cancelled call's thread wakes and leaves the pool
        while pool.pool() != (0, 1) and time.monotonic() < end:
            time.sleep(0.02)
        assert pool.pool() == (0, 1)
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_past_the_limit_a_call_is_refused_at_once_and_reads_nothing(serve):
    pool = OpenPool(2, limit=2, read_timeout=30)
    port = serve(pool)
    client = H2Client(port)
    try:
        held = [client.start(HEALTH_CHECK, b"\x00\x00", end=False) for _ in range(2)]
        client.flush()
        end = time.monotonic() + 15  # both held calls admitted (a busy machine may take a while)
        while pool.pool()[0] < 2 and time.monotonic() < end:
            client.pump(0.05)
        assert pool.pool() == (2, 0), "the two held calls never reached the pool"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 calls are in flight, the limit is 2" in refused.value.details()
        assert pool.refused == 1 and pool.pool() == (2, 1)
        assert not any(_reset(client, sid, 0.1) for sid in held)  # no pressure, not yet due: still held
    finally:
        client.close()
