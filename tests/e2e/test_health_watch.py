"""Health.Watch: cancelled watches never wedge the server, limits hold, statuses arrive in order.

grpcio-health-checking's servicer sent under the lock its close callback
needs on grpc's serving thread: 10-30 cancelled watches stopped every RPC
for good (issue 25). These run the attack on real servers, on the main port
and on the plaintext health listener.
"""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from support.e2e import batch, wait_for

import layertap

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: Each channel its own connection (grpc Python shares one per target otherwise).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def _watch_and_cancel(address: str, n: int, read: int) -> list[grpc.StatusCode | None]:
    """Open ``n`` watches on ``n`` connections, read the first status of ``read`` of them, cancel all at once."""
    channels = [grpc.insecure_channel(address, options=OWN_CONNECTION) for _ in range(n)]
    calls = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30) for ch in channels]
    outcomes: list[grpc.StatusCode | None] = []
    for call in calls[:read]:
        try:
            assert next(call).status == SERVING
            outcomes.append(None)
        except grpc.RpcError as exc:
            outcomes.append(exc.code())
    for call in calls:
        call.cancel()
    for ch in channels:
        ch.close()
    return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listener", ["main", "health-listener"])
def test_thirty_cancelled_watches_leave_every_port_answering(make_server, listener):
    srv = make_server(health_address="127.0.0.1:0")
    old = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        client.infer(batch(), timeout=10)  # a channel opened before the storm
        port = srv.port if listener == "main" else srv.health_port
        servicer = srv.health if listener == "main" else srv.listener_health
        for _ in range(3):
            outcomes = _watch_and_cancel(f"127.0.0.1:{port}", 30, read=10)
            if servicer.max_watches >= 30:
                assert outcomes == [None] * 10
            else:  # past the listener's limit: refused, never hung
                assert set(outcomes) <= {None, grpc.StatusCode.RESOURCE_EXHAUSTED}
        # What the wedge stopped: a new channel's Check on both ports, Infer on the old channel.
        for p in (srv.port, srv.health_port):
            with grpc.insecure_channel(f"127.0.0.1:{p}") as ch:
                assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
        assert client.infer(batch(), timeout=5).shape[0] == 4
        assert health_pb2_grpc.HealthStub(old).Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
    assert wait_for(lambda: servicer.open_watches == 0, 10)
    old.close()


def test_watch_streams_every_change_in_order_and_shutdown(make_server):
    srv = make_server(health_address="127.0.0.1:0")
    calls = []
    for port in (srv.port, srv.health_port):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        calls.append((ch, health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="x"), timeout=30)))
    for _, call in calls:
        assert next(call).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    # Each change reaches both watches (the listener's servicer follows the main one).
    for change in (lambda: srv.health.set("x", SERVING), lambda: srv.health.set("x", NOT_SERVING),
                   lambda: srv.health.set("x", SERVING), srv.health.enter_graceful_shutdown):
        change()
        assert {next(call).status for _, call in calls} == {srv.health._status["x"]}
    assert srv.health._status["x"] == srv.listener_health._status["x"] == NOT_SERVING
    for ch, call in calls:
        call.cancel()
        ch.close()


def test_watches_are_bounded_per_connection_and_in_total(make_server):
    srv = make_server(metrics_port=0)
    srv.health.max_watches = 12
    address = f"127.0.0.1:{srv.port}"
    shared = grpc.insecure_channel(address)  # one connection
    per = srv.health.max_watches_per_connection
    on_one = [health_pb2_grpc.HealthStub(shared).Watch(health_pb2.HealthCheckRequest(), timeout=30)
              for _ in range(per + 3)]
    codes = []
    for call in on_one:
        try:
            next(call)
            codes.append(None)
        except grpc.RpcError as exc:
            codes.append(exc.code())
            assert f"the limit is {per}" in (exc.details() or "")
    # Calls on one connection start on several workers: which ones are refused is not fixed, how many is.
    assert sorted(codes, key=str) == sorted([None] * per + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3, key=str)
    others = [grpc.insecure_channel(address, options=OWN_CONNECTION) for _ in range(8)]
    more = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30) for ch in others]
    admitted = 0
    for call in more:
        try:
            next(call)
            admitted += 1
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the limit is 12" in (exc.details() or "")
    assert admitted == 12 - per and srv.health.open_watches == 12
    assert srv.health.refused == {"connection": 3, "total": 8 - (12 - per)}
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pool = {(s.name, s.labels.get("pool")): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert pool[("layertap_streams_open", "health_watches")] == 12
    assert pool[("layertap_streams_refused_total", "health_watches")] == 3 + 8 - (12 - per)
    for call in on_one + more:
        call.cancel()
    assert wait_for(lambda: srv.health.open_watches == 0, 10)
    shared.close()
    for ch in others:
        ch.close()


@pytest.mark.timeout(60)
def test_a_watch_that_grants_no_window_stalls_only_itself(make_server):
    """A raw HTTP/2 client opens a Watch with INITIAL_WINDOW_SIZE 0, so its sends never complete.

    Every other watcher still gets its first status at once and NOT_SERVING at
    shutdown (one notifier sending in turn was stuck behind it for good).
    """
    import threading
    import time

    from h2.settings import SettingCodes
    from support.h2abuse import HEALTH_WATCH, H2Client, grpc_frame

    srv = make_server()
    stuck = H2Client(srv.port)
    stuck.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 0})
    stuck.flush()
    stuck.start(HEALTH_WATCH, grpc_frame(health_pb2.HealthCheckRequest().SerializeToString()))
    stuck.flush()
    stuck.pump(0.5)
    assert wait_for(lambda: srv.health.open_watches == 1, 5)
    ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=OWN_CONNECTION)
    got: list[object] = []

    def watch() -> None:
        try:
            for r in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=20):
                got.append(r.status)
        except grpc.RpcError as exc:
            got.append(exc.code())

    reader = threading.Thread(target=watch)
    reader.start()
    end = time.monotonic() + 15  # a condition, bounded generously for a busy machine
    while time.monotonic() < end and not got:
        stuck.pump(0.2)  # answers pings, never grants window
    assert got == [SERVING]
    srv.health.enter_graceful_shutdown()
    end = time.monotonic() + 15
    while time.monotonic() < end and len(got) < 2:
        stuck.pump(0.2)
    assert got[:2] == [SERVING, NOT_SERVING]
    stuck.close()
    ch.close()
    reader.join(20)
