"""Calls that never send their request, bursts and empty calls must not fail a probe (issue 25, residual holes).

Raw ``h2`` clients send what grpcio's client cannot: HEADERS and two bytes of
a message prefix, never the rest, or HEADERS that end the stream with no
message at all. Also what the issue 25 review found: a backlog of stalled Checks queued
ahead of a probe, and stalled calls outside Health holding every place while tokens are off.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.e2e import rich_details, wait_for
from support.h2abuse import HEALTH_CHECK, LIST_LAYERS, H2Client

from layertap.server.app import OPEN_WORKERS
from layertap.server.rpc.health_listener import HEALTH_WORKERS
from layertap.server.rpc.open_pool import PATIENCE

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
#: kubelet's default probe timeoutSeconds.
PROBE_DEADLINE = 1.0
#: Stalled calls beyond the pool's threads, so some wait for a thread too.
EXTRA = 2


def _probe(port: int) -> str:
    """One Health.Check on a channel (and connection) of its own: ``SERVING``, or why not."""
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=PROBE_DEADLINE).status
            return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"


def _stall(port: int, streams: int) -> tuple[H2Client, list[int]]:
    """``streams`` Health.Checks that send HEADERS and 2 of the 5 prefix bytes, and nothing more."""
    client = H2Client(port)
    sids = [client.start(HEALTH_CHECK, b"\x00\x00", end=False) for _ in range(streams)]
    client.flush()
    client.pump(0.2)
    return client, sids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("listener", ["main port", "health listener"])
def test_stalled_health_checks_leave_probes_answered(make_server, listener):
    """More stalled Checks than Health has threads: before, every probe timed out until the socket dropped."""
    srv = make_server(workers=8, max_streams=4, health_address="127.0.0.1:0")
    port, threads = (srv.port, OPEN_WORKERS) if listener == "main port" else (srv.health_port, HEALTH_WORKERS)
    pool = srv.principals.open.pool if listener == "main port" else srv.listener_pool
    attacker, sids = _stall(port, threads + EXTRA)
    try:
        # Every thread held a stalled call while the extra ones waited, until the pool cancelled the
        # calls past PATIENCE and no call waits for a thread any more (2 x PATIENCE on an idle machine).
        assert wait_for(lambda: pool.cancelled >= 1 and not pool.pressed(), 10 * PATIENCE), pool.pool()
        answers = [_probe(port) for _ in range(10)]
        assert answers == ["SERVING"] * 10, answers
        # The server gave stalled calls' threads to the probes by cancelling them (RST_STREAM), not by luck.
        attacker.pump(0.5)
        assert sum(attacker.server_resets.values()) >= 1, attacker.server_resets
        assert pool.cancelled >= 1
    finally:
        attacker.close()
    # The other listener never noticed.
    assert _probe(srv.health_port if listener == "main port" else srv.port) == "SERVING"


@pytest.mark.timeout(60)
def test_a_burst_of_other_calls_never_refuses_a_health_check(make_server):
    """--workers 8: 50 Checks while 60 other calls arrive at once. grpc's maximum_concurrent_rpcs counted
    them all, and 1-5 of 50 Checks were refused "Concurrent RPC limit exceeded!"."""
    srv = make_server(workers=8, max_streams=4)
    # Two connections: one connection's streams past grpc.max_concurrent_streams (100) are refused by the transport.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options)
    probes = grpc.insecure_channel(f"127.0.0.1:{srv.port}", options)
    layers = channel.unary_unary(LIST_LAYERS)
    health = health_pb2_grpc.HealthStub(probes)
    try:
        for _round in range(3):
            others = [layers.future(b"", timeout=30) for _ in range(60)]
            checks = [health.Check.future(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(50)]
            failed = []
            for f in checks:
                try:
                    assert f.result().status == SERVING
                except grpc.RpcError as exc:
                    failed.append(f"{exc.code().name}: {exc.details()}")
            assert failed == [], failed
            codes = []
            for f in others:
                try:
                    f.result()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
                    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the others' own bound, named
                        info, _ = rich_details(exc)
                        assert info.metadata["call_limit"] == "16", exc.details()
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert srv.principals.calls is not None and srv.principals.calls.pool()[0] == 0
    finally:
        channel.close()
        probes.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", [HEALTH_CHECK, LIST_LAYERS, "/layertap.v1.InferenceService/GetModelMetadata"])
def test_a_unary_call_without_its_message_gets_invalid_argument(make_server, method):
    """HEADERS with END_STREAM and no message, tokens off: grpc answered UNIMPLEMENTED
    ``"b''" requires exactly one request message.`` (the method's empty registered name, formatted from bytes)."""
    srv = make_server()
    client = H2Client(srv.port)
    try:
        sid = client.start(method, None)
        client.flush()
        client.responses(sid, 1, 5)
        trailers = client.trailers(sid)
    finally:
        client.close()
    assert trailers.get(b"grpc-status") == b"3", trailers  # INVALID_ARGUMENT
    assert trailers[b"grpc-message"].decode() == \
        "request: the call ended before its message arrived (a unary method reads exactly one)"
    # The server goes on answering on that method.
    assert _probe(srv.port) == "SERVING"


def _stall_backlog(port: int, calls: int, per_connection: int) -> list[H2Client]:
    """``calls`` stalled Health.Checks (HEADERS and 2 prefix bytes), ``per_connection`` to a connection."""
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
    """Issue 25 review: OpenPool cancels a stalled read only once it holds a thread and has waited PATIENCE
    (1 s), so it drained stalled calls at about ``workers`` per second while a probe queued behind all of them
    in the executor's FIFO queue: with a burst of stalled Checks from a stranger with no token every probe
    with kubelet's 1 s deadline failed for ~backlog/workers seconds."""
    srv = make_server(workers=8, max_streams=4, health_address="127.0.0.1:0")
    port, threads, per_conn = ((srv.port, OPEN_WORKERS, 100) if listener == "main port"
                               else (srv.health_port, HEALTH_WORKERS, 8))
    pool = srv.principals.open.pool if listener == "main port" else srv.listener_pool
    backlog = 6 * threads  # well under either pool's limit (256 / 64)
    attackers = _stall_backlog(port, backlog, per_conn)
    try:
        # The whole backlog has reached the pool (in flight, or already cancelled), and aged 0.3 s, before
        # the first probe: a probe right behind a fresh burst waits up to PATIENCE, its whole deadline.
        assert wait_for(lambda: sum(pool.pool()) >= backlog, 30), pool.pool()
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


#: Longer than OpenPool's READ_TIMEOUT (10 s), the bound Health's stalled calls get.
HOLD = 13.0


@pytest.mark.timeout(60)
def test_stalled_calls_without_tokens_do_not_refuse_others_for_ever(make_server):
    """Issue 25 review, tokens off: every caller is one principal and only the server-wide bound (2 x --workers
    = 16 here) is left. Calls outside Health had no read deadline, so 16 ListLayers with HEADERS and 2 prefix
    bytes from a live peer held all 16 places for as long as the connection lived, and every other non-Health
    call was RESOURCE_EXHAUSTED. Expected: a call still without its request after a bounded time is cancelled."""
    srv = make_server(workers=8, max_streams=4)
    attacker = H2Client(srv.port)
    for _ in range(16):
        attacker.start(LIST_LAYERS, b"\x00\x00", end=False)
    attacker.flush()
    end = time.monotonic() + HOLD
    while time.monotonic() < end:  # stays a live peer: answers pings, sends nothing more
        attacker.pump(0.2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            try:
                ch.unary_unary(LIST_LAYERS)(b"", timeout=5)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = f"{exc.code().name}: {exc.details()}"
        in_flight = srv.principals.calls.pool()[0] if srv.principals.calls else None
        resets = dict(attacker.server_resets)
    finally:
        attacker.close()
    assert outcome == "OK", (outcome, f"calls in flight {in_flight}", f"server resets {resets}")
