"""Review (issue 25): a backlog of stalled Health calls, queued FIFO ahead of a probe, fails every probe.

OpenPool cancels a stalled read only once it holds a thread and has waited PATIENCE (1 s), so
it drains stalled calls at about ``workers`` per second; a probe queues behind all of them in
the executor's FIFO queue. A stranger with no token opens a burst of stalled Checks (HEADERS and
2 prefix bytes) and every probe with kubelet's 1 s deadline fails for ~backlog/workers seconds;
reopening ``workers`` calls a second keeps it so indefinitely.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.h2abuse import HEALTH_CHECK, H2Client

from layertap.server.app import OPEN_WORKERS
from layertap.server.rpc.health_listener import HEALTH_WORKERS

PROBE_DEADLINE = 1.0


def _probe(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=PROBE_DEADLINE).status
            return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"


def _stall(port: int, calls: int, per_connection: int) -> list[H2Client]:
    clients = []
    while calls > 0:
        c = H2Client(port)
        n = min(calls, per_connection)
        for _ in range(n):
            c.start(HEALTH_CHECK, b"\x00\x00", end=False)
        c.flush()
        clients.append(c)
        calls -= n
    for c in clients:
        c.pump(0.05)
    return clients


@pytest.mark.timeout(90)
@pytest.mark.parametrize("listener", ["main port", "health listener"])
def test_a_backlog_of_stalled_checks_fails_no_probe(make_server, listener):
    srv = make_server(workers=8, max_streams=4, health_address="127.0.0.1:0")
    port, threads, per_conn = ((srv.port, OPEN_WORKERS, 100) if listener == "main port"
                               else (srv.health_port, HEALTH_WORKERS, 8))
    backlog = 6 * threads  # well under either pool's limit (256 / 64)
    attackers = _stall(port, backlog, per_conn)
    try:
        time.sleep(0.3)
        answers = []
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            answers.append(_probe(port))
            for c in attackers:
                c.pump(0)
        failed = [a for a in answers if a != "SERVING"]
        assert failed == [], f"{len(failed)}/{len(answers)} probes failed: {failed[:3]}"
    finally:
        for c in attackers:
            c.close()
