"""One principal holds at most its share of the workers; others and Health keep theirs (issue 25)."""

from __future__ import annotations

import hashlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.e2e import batch, rich_details, wait_for

import layertap
from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

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
