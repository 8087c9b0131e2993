"""One principal holds at most its share of the workers; others and Health keep theirs (issue 25).

The share is checked when a call arrives: a burst of one principal's calls never holds the server-wide
places that another principal's calls need (the issue 25 review).
"""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.e2e import batch, rich_details, wait_for
from support.h2abuse import LIST_LAYERS
from support.storm import TOKENS as STORM_TOKENS
from support.storm import Tls, tokens_file

import layertap
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

TOKENS = {"reader": "tok-reader-0123456789abcdef", "other": "tok-other-0123456789abcdef"}


@pytest.fixture
def secured(make_server, tmp_path):
    path = tmp_path / "tokens"
    path.write_text("".join(f"{who} sha256:{hashlib.sha256(tok.encode()).hexdigest()} "
                            f"{'read' if who == 'reader' else 'infer,read'}\n" for who, tok in TOKENS.items()))
    # 16 workers at a share of 0.25: 4 calls in flight per principal.
    return make_server(auth_tokens=str(path), workers=16, max_streams=12, metrics_port=0)


def _subscribe(channel: grpc.Channel, who: str) -> grpc.Call:
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    return stub.Subscribe(telemetry_pb2.SubscribeRequest(), timeout=30,
                          metadata=[("authorization", f"Bearer {TOKENS[who]}")])


def test_one_principal_cannot_take_more_than_its_share(secured):
    limit = secured.principals.principals.limit
    assert limit == 4
    channel = grpc.insecure_channel(f"127.0.0.1:{secured.port}")
    held = [_subscribe(channel, "reader") for _ in range(limit)]  # each holds a worker until cancelled
    assert wait_for(lambda: secured.principals.principals.pool()[0] == limit, 10)
    extra = _subscribe(channel, "reader")
    with pytest.raises(grpc.RpcError) as refused:
        next(extra)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "principal 'reader' has 4 calls in flight, the limit is 4 (--principal-share" in refused.value.details()
    info, _ = rich_details(refused.value)
    assert info.reason == "RESOURCE_EXHAUSTED" and info.metadata["principal"] == "reader"
    # Another principal and the open Health service are served meanwhile.
    with layertap.Client(f"127.0.0.1:{secured.port}", token=TOKENS["other"]) as other:
        assert other.infer(batch(), timeout=10).shape[0] == 4
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert secured.principals.principals.pool() == (limit, 1)
    # Places come back when the streams end, cancelled or not.
    for call in held:
        call.cancel()
    assert wait_for(lambda: secured.principals.principals.pool()[0] == 0, 10)
    again = _subscribe(channel, "reader")
    assert wait_for(lambda: secured.principals.principals.pool()[0] == 1, 10)
    again.cancel()
    channel.close()


def test_unary_calls_are_answered_through_the_request_stream_wrapper(secured):
    """Every budgeted call is read by the wrapper: bad bytes still get INVALID_ARGUMENT, good ones their answer."""
    channel = grpc.insecure_channel(f"127.0.0.1:{secured.port}")
    metadata = [("authorization", f"Bearer {TOKENS['reader']}")]
    layers = channel.unary_unary("/layertap.v1.TelemetryService/ListLayers",
                                 response_deserializer=telemetry_pb2.ListLayersResponse.FromString)
    assert layers(b"", timeout=10, metadata=metadata).layers
    with pytest.raises(grpc.RpcError) as bad:
        layers(b"\xff\xff\xff", timeout=10, metadata=metadata)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request" in bad.value.details()
    assert secured.principals.principals.pool() == (0, 0)
    channel.close()


@pytest.mark.timeout(60)
def test_one_principals_burst_never_refuses_another_principal(make_server, tmp_path):
    """Issue 25 review: PrincipalAdmission took the server-wide place (16 at --workers 8) when a call arrived
    but checked the principal's share (0.25 x 8 = 2) only once a worker picked the call up, so a burst over a
    principal's share sat in the executor's queue holding server-wide places, and another principal's calls
    were refused RESOURCE_EXHAUSTED "16 calls are in flight" (38 of 158 of ``root``'s ListLayers in 8 s)."""
    tls = Tls.make(tmp_path)
    srv = make_server(workers=8, max_streams=4, tls_cert=str(tls.cert), tls_key=str(tls.key),
                      auth_tokens=str(tokens_file(tmp_path / "tokens")))
    creds = grpc.ssl_channel_credentials(tls.ca.read_bytes())

    def channel() -> grpc.Channel:
        return grpc.secure_channel(f"127.0.0.1:{srv.port}", creds, options=[("grpc.use_local_subchannel_pool", 1)])

    stop = threading.Event()

    def burst() -> None:  # ordinary, well-formed calls, as fast as the reader's client goes
        with channel() as ch:
            layers, md = ch.unary_unary(LIST_LAYERS), [("authorization", f"Bearer {STORM_TOKENS['reader']}")]
            while not stop.is_set():
                for f in [layers.future(b"", metadata=md, timeout=5) for _ in range(50)]:
                    try:
                        f.result()
                    except grpc.RpcError:
                        pass

    threads = [threading.Thread(target=burst) for _ in range(2)]
    for t in threads:
        t.start()
    refused: list[str] = []
    answered = 0
    try:
        assert wait_for(lambda: srv.principals.calls.pool()[0] >= 1), "the burst never reached the server"
        with channel() as ch:
            layers, md = ch.unary_unary(LIST_LAYERS), [("authorization", f"Bearer {STORM_TOKENS['root']}")]
            end = time.monotonic() + 6.0
            while time.monotonic() < end:
                try:
                    layers(b"", metadata=md, timeout=10)  # refused is the failure; slow on a busy machine is not
                    answered += 1
                except grpc.RpcError as exc:
                    refused.append(f"{exc.code().name}: {exc.details()}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert refused == [], f"{len(refused)} of {len(refused) + answered} root calls refused: {refused[:2]}"
