"""grpc.health.v1 and server reflection, checked with grpc's own clients."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from layertap.server.app import SERVICE_NAMES

pytestmark = pytest.mark.e2e


def test_health_serving_and_graceful_shutdown(make_server):
    srv = make_server()
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", *SERVICE_NAMES):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    listed = stub.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert {name: r.status for name, r in listed.items()} == {
        name: health_pb2.HealthCheckResponse.SERVING for name in ("", *SERVICE_NAMES)}
    srv.health.enter_graceful_shutdown()
    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    listed = stub.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert {r.status for r in listed.values()} == {health_pb2.HealthCheckResponse.NOT_SERVING}
    srv.health.set("", health_pb2.HealthCheckResponse.SERVING)  # ignored after shutdown began
    assert stub.List(health_pb2.HealthListRequest(), timeout=5).statuses[""].status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    channel.close()


def test_reflection_lists_services(demo_server):
    channel = grpc.insecure_channel(f"127.0.0.1:{demo_server.port}")
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"layertap.v1.InferenceService", "layertap.v1.TelemetryService", "grpc.health.v1.Health"} <= services
    channel.close()


def test_no_reflection_flag(make_server):
    srv = make_server(reflection=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    db = ProtoReflectionDescriptorDatabase(channel)
    try:
        services = db.get_services()
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
    else:
        raise AssertionError(f"reflection answered: {services}")
    channel.close()


def test_model_loading_is_not_serving_then_serving(tmp_path):
    """Health says NOT_SERVING while the model loads (a slow factory)."""
    import sys
    import threading
    import time

    from layertap.server.app import start_server
    from layertap.server.config import ServerConfig

    mod = tmp_path / "slow_model.py"
    mod.write_text(
        "import time, torch\n"
        "def build():\n"
        "    time.sleep(2)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
    )
    sys.path.insert(0, str(tmp_path))
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cfg = ServerConfig(port=port, metrics_port=None, model="slow_model:build", input_shape="-1,4",
                       compile_reducers=False)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("srv", start_server(cfg)))
    t.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    seen = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "srv" not in box:
        try:
            seen.add(stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    t.join(30)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    box["srv"].stop(0)
    sys.path.remove(str(tmp_path))


def test_shutdown_ends_streams_unavailable_and_fast(make_server):
    """A watcher sees the restart as UNAVAILABLE (reconnect), not as a finished stream."""
    import threading
    import time

    import layertap

    srv = make_server()
    client = layertap.Client(f"127.0.0.1:{srv.port}")
    got: list[BaseException] = []

    def watch() -> None:
        try:
            for _ in client.watch("layer1", reducers=["moments"]):
                pass
        except BaseException as exc:  # noqa: BLE001 - inspected below
            got.append(exc)

    t = threading.Thread(target=watch)
    t.start()
    assert _wait(lambda: srv.state.broker.subscriber_count == 1)
    start = time.monotonic()
    srv.stop(10)
    t.join(10)
    assert not t.is_alive() and time.monotonic() - start < 5  # the grace period is not used up
    assert len(got) == 1 and isinstance(got[0], layertap.ServerUnavailable), got
    client.close()


def _wait(cond, timeout: float = 15.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_health_refuses_long_service_names(make_server):
    """Health needs no token and Watch keeps its name for the whole stream: names are capped."""
    from layertap.server.rpc.health import MAX_SERVICE_NAME

    srv = make_server()
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = health_pb2_grpc.HealthStub(channel)
    long_name = health_pb2.HealthCheckRequest(service="x" * (MAX_SERVICE_NAME + 1))
    for call in (lambda: stub.Check(long_name, timeout=5), lambda: next(stub.Watch(long_name, timeout=5))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "service" in err.value.details()
    ok = health_pb2.HealthCheckRequest(service="x" * MAX_SERVICE_NAME)
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(ok, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # accepted, just unknown
    assert srv.streams is not None and srv.streams.callbacks is not None
    assert srv.streams.callbacks.open_streams == 0  # the refused Watch gave its slot back
    channel.close()


def test_a_second_stop_waits_for_the_first(make_server):
    import threading

    srv = make_server()
    first = threading.Thread(target=srv.stop, args=(1.0,))
    first.start()
    assert srv._stopped.wait(5)
    srv.stop(0)
    assert srv._finished.is_set(), "stop() returned while the first stop was still running"
    first.join(10)
