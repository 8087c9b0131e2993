"""Budgets that keep a server answering: stream slots, subscriber bytes, request copies."""

from __future__ import annotations

import hashlib
import queue
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.e2e import batch, rich_details, wait_for

import layertap
from layertap.server.rpc.admission import streaming_methods
from layertap.server.rpc.auth import SERVED_SERVICES
from layertap.server.rpc.inference import decode_inputs
from layertap.server.stream.broker import Batch, Broker
from layertap.v1 import inference_pb2, inference_pb2_grpc, telemetry_pb2, telemetry_pb2_grpc, tensor_pb2

pytestmark = pytest.mark.e2e

STREAMS_EACH = 70
#: Deadline and bound of the calls made while streams hold every worker: a starved call would wait for
#: the streams (held until the test releases them, 60 s at most); a quarter of that leaves a busy machine room.
OK_WITHIN_S = 15.0
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


class Held:
    """A request stream that sends ``first`` and then stays open until ``release``."""

    def __init__(self, first: object, release: threading.Event) -> None:
        self.first, self.release = first, release

    def __iter__(self) -> Iterator[object]:
        yield self.first
        self.release.wait()


def _open(call: grpc.Call) -> grpc.StatusCode | None:
    """None when the stream's first message arrived (it is open), else its refusal code."""
    try:
        next(call)  # type: ignore[call-overload]
        return None
    except grpc.RpcError as exc:
        return exc.code()


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def test_open_streams_never_starve_infer_or_health_check(make_server):
    """70 Watch + 70 reflection + 70 Subscribe at once: 48 of each worker pool admitted, the rest refused, calls answer.

    Health.Watch (callback streams: no worker held, no token needed) is bounded
    by the health servicer, per connection and in total, so strangers' Watches
    cannot lock Subscribe and reflection out; one channel gets its connection's share.
    """
    srv = make_server(max_subscribers=4 * STREAMS_EACH)  # the stream cap, not the subscriber cap, is under test
    assert srv.streams is not None and srv.streams.limit == srv.state.config.max_streams == 48
    release = threading.Event()
    # A connection of its own per kind: 210 streams on one connection pass the transport's
    # grpc.max_concurrent_streams (100), and under CPU load some were refused there (REFUSED_STREAM,
    # UNAVAILABLE) before Python saw them, which is not what this test is about.
    own = [("grpc.use_local_subchannel_pool", 1)]
    channel, refl_channel, sub_channel = (grpc.insecure_channel(f"127.0.0.1:{srv.port}", own) for _ in range(3))
    health = health_pb2_grpc.HealthStub(channel)
    refl = reflection_pb2_grpc.ServerReflectionStub(refl_channel)
    telemetry = telemetry_pb2_grpc.TelemetryServiceStub(sub_channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    calls: list[grpc.Call] = []
    for _ in range(STREAMS_EACH):  # interleaved, so every kind meets a full server
        calls.append(health.Watch(health_pb2.HealthCheckRequest(), timeout=60))
        calls.append(refl.ServerReflectionInfo(iter(Held(ask, release)), timeout=60))
        calls.append(telemetry.Subscribe(telemetry_pb2.SubscribeRequest(), timeout=60))
    try:
        outcomes = [_open(c) for c in calls]
        refused = [c for c, o in zip(calls, outcomes) if o is not None]
        watches, blocking = outcomes[0::3], outcomes[1::3] + outcomes[2::3]
        assert srv.streams.callbacks is not None
        per_connection = srv.health.max_watches_per_connection
        assert watches.count(None) == srv.health.open_watches == srv.streams.callbacks.open_streams == per_connection
        assert srv.health.refused["connection"] == STREAMS_EACH - per_connection
        assert blocking.count(None) == srv.streams.open_streams == 48
        assert {o for o in outcomes if o is not None} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        named = [c for c in refused if "--max-streams=48" in (c.details() or "")]
        assert named, "no refusal names the limit"
        info, _ = rich_details(named[0])
        assert info.reason == "RESOURCE_EXHAUSTED" and info.metadata["max_streams"] == "48"

        # While 48 streams hold their workers, unary calls and probes still answer at once.
        with layertap.Client(f"127.0.0.1:{srv.port}") as client:
            infer_s = _timed(lambda: client.infer(batch(), timeout=OK_WITHIN_S))
            stats_s = _timed(lambda: client.stats(timeout=OK_WITHIN_S))
        check_s = _timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=OK_WITHIN_S))
        assert max(infer_s, stats_s, check_s) < OK_WITHIN_S
        burst = [health.Check.future(health_pb2.HealthCheckRequest(), timeout=OK_WITHIN_S) for _ in range(32)]
        assert all(f.result().status == health_pb2.HealthCheckResponse.SERVING for f in burst)
    finally:
        release.set()
        for c in calls:
            c.cancel()
    assert wait_for(lambda: srv.streams.open_streams == 0, 10)
    assert wait_for(lambda: srv.streams.callbacks.open_streams == 0, 10)
    assert wait_for(lambda: srv.state.broker.subscriber_count == 0, 10)
    again = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
    assert _open(again) is None and srv.streams.callbacks.open_streams == 1
    again.cancel()
    for ch in (channel, refl_channel, sub_channel):
        ch.close()


def pool_samples(port: int) -> dict[tuple[str, str], float]:
    """``/metrics`` stream-admission samples: ``{(name, pool): value}``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, s.labels["pool"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if "pool" in s.labels}


def _generic_stream(channel: grpc.Channel, method: str, request: bytes, client_streaming: bool) -> grpc.Call:
    if client_streaming:
        return channel.stream_stream(method)(iter([request]), timeout=10)
    return channel.unary_stream(method)(request, timeout=10)


def test_every_streaming_method_takes_a_slot(make_server):
    """Read from the descriptors: each streaming method of every served service is refused when the slots are full."""
    srv = make_server(max_streams=1, workers=4, metrics_port=0)
    methods = {f"/{s.full_name}/{m.name}": m for s in (*SERVED_SERVICES, HEALTH, REFLECTION) for m in s.methods}
    streaming = streaming_methods((*SERVED_SERVICES, HEALTH, REFLECTION))
    assert {"/layertap.v1.TelemetryService/Subscribe", "/layertap.v1.TelemetryService/Capture",
            "/grpc.health.v1.Health/Watch", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"} <= streaming
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    # One stream holds each pool: a Watch the callback streams', a Subscribe the workers'.
    holder = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    sub = telemetry_pb2_grpc.TelemetryServiceStub(channel).Subscribe(telemetry_pb2.SubscribeRequest(), timeout=30)
    assert _open(holder) is None and _open(sub) is None
    assert srv.streams.open_streams == 1 and srv.streams.callbacks is not None
    assert srv.streams.callbacks.open_streams == 1
    for name in sorted(streaming):
        m = methods[name]
        request = message_factory.GetMessageClass(m.input_type)().SerializeToString()
        call = _generic_stream(channel, name, request, m.client_streaming)
        assert _open(call) == grpc.StatusCode.RESOURCE_EXHAUSTED, name
        info, _ = rich_details(call)
        assert info.metadata["max_streams"] == "1" and info.metadata["method"] == name
    # Unary calls are never counted.
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    inference_pb2_grpc.InferenceServiceStub(channel).GetModelMetadata(inference_pb2.GetModelMetadataRequest(), timeout=5)
    assert srv.streams.open_streams == 1 and srv.streams.refused == len(streaming) - 1
    assert srv.streams.callbacks.refused == 1  # Health.Watch
    metrics = pool_samples(srv.metrics_port)
    assert metrics[("layertap_streams_refused_total", "workers")] == len(streaming) - 1
    assert metrics[("layertap_streams_refused_total", "callbacks")] == 1
    assert metrics[("layertap_streams_open", "workers")] == metrics[("layertap_streams_open", "callbacks")] == 1
    holder.cancel()
    sub.cancel()
    assert wait_for(lambda: srv.streams.open_streams == 0 and srv.streams.callbacks.open_streams == 0)
    channel.close()


def test_a_refused_caller_takes_no_slot(make_server, tmp_path):
    """Auth runs before admission: unauthenticated streams cannot fill the slots."""
    token = "budget-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"reader sha256:{hashlib.sha256(token.encode()).hexdigest()} read\n")
    srv = make_server(auth_tokens=str(tokens), max_streams=2, workers=4)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    telemetry = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    for _ in range(5):
        assert _open(telemetry.Subscribe(telemetry_pb2.SubscribeRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert srv.streams.open_streams == 0 and srv.streams.refused == 0
    ok = telemetry.Subscribe(telemetry_pb2.SubscribeRequest(), timeout=10, metadata=[("authorization", f"Bearer {token}")])
    assert _open(ok) is None and srv.streams.open_streams == 1
    ok.cancel()
    assert wait_for(lambda: srv.streams.open_streams == 0)
    channel.close()


@pytest.mark.parametrize("streams,workers", [(64, 64), (0, 64), (65, 64)])
def test_max_streams_must_leave_workers_free(make_server, streams, workers):
    with pytest.raises(ValueError, match="--max-streams"):
        make_server(max_streams=streams, workers=workers)


def test_serve_refuses_max_streams_at_workers():
    proc = subprocess.run([sys.executable, "-m", "layertap.cli", "serve", "--port", "0", "--no-metrics",
                           "--workers", "8", "--max-streams", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--max-streams 8 must be at least 1 and below --workers 8" in proc.stderr


# -- subscriber queues bounded in bytes -------------------------------------------


def _summary(tap: str, n_bytes: int, pass_index: int = 0) -> telemetry_pb2.Summary:
    """A summary of about ``n_bytes`` on the wire (any field will do: the bound counts wire bytes)."""
    return telemetry_pb2.Summary(tap=tap, layer="x" * n_bytes, pass_index=pass_index)


def test_subscriber_queue_drops_oldest_past_its_byte_bound():
    broker = Broker(default_queue_size=1000, queue_bytes=10_000)
    sub = broker.subscribe(["t"])
    one = _summary("t", 3000, 1).ByteSize()  # the same for every pass index below
    for i in range(1, 11):
        broker.publish([_summary("t", 3000, i)], {"t": False})
    assert sub.pending() == 10_000 // one == 3  # the message bound (1000) never came into it
    assert sub.pending_bytes() == 3 * one <= 10_000
    assert sub.dropped == broker.dropped_total == 7
    assert [sub.get(0).summaries[0].pass_index for _ in range(3)] == [8, 9, 10]  # oldest went first
    assert sub.pending_bytes() == 0


def test_message_bound_still_applies_and_a_huge_message_is_kept_alone():
    broker = Broker(default_queue_size=2, queue_bytes=1 << 20)
    small = broker.subscribe(["t"])
    for i in range(5):
        broker.publish([_summary("t", 10, i)], {"t": False})
    assert small.pending() == 2 and small.dropped == 3
    broker.unsubscribe(small)
    tight = Broker(queue_bytes=100).subscribe(["t"])
    assert tight.put(_batch(_summary("t", 10))) == 0
    big = _summary("t", 5000)
    assert tight.put(_batch(big)) == 1  # pushes the small one out, is kept although over the bound
    assert tight.pending() == 1 and tight.get(0).summaries[0] is big


def _batch(s: telemetry_pb2.Summary) -> Batch:
    return Batch([s], [], s.ByteSize())


@dataclass
class CountingSummary:
    """Stands in for pb.Summary: publish reads only ``tap`` and ``ByteSize()``."""

    tap: str
    size: int
    calls: int = 0

    def ByteSize(self) -> int:  # protobuf's name
        self.calls += 1
        return self.size


def test_sizes_are_computed_once_per_pass_not_per_subscriber():
    broker = Broker(queue_bytes=1 << 20)
    subs = [broker.subscribe(["a", "b"]) for _ in range(8)] + [broker.subscribe(["b"])]
    pieces = [CountingSummary("a", 100), CountingSummary("b", 40)]
    broker.publish(pieces, {"a": False, "b": False})  # type: ignore[arg-type]
    assert [p.calls for p in pieces] == [1, 1]
    assert [s.pending_bytes() for s in subs] == [140] * 8 + [40]


def test_serve_wires_the_byte_bound(make_server):
    srv = make_server(subscriber_queue_bytes=12345)
    assert srv.state.broker.queue_bytes == 12345
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        stream = client.watch("layer1", reducers=["moments"])
        assert wait_for(lambda: srv.state.broker.subscriber_count == 1)
        assert all(s.max_bytes == 12345 for s in srv.state.broker._subs)
        stream.close()


# -- Infer: one copy of the request's bytes, moved to the device under the lock ---


def test_decode_copies_a_request_once(demo_server):
    x = np.random.default_rng(0).standard_normal((1024, 3, 32, 32)).astype(np.float32)  # 12 MiB
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=list(x.shape), raw_data=x.tobytes())
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        (tensor,) = decode_inputs([msg], demo_server.state).tensors()
        held, peak = (m - base for m in tracemalloc.get_traced_memory())
    finally:
        tracemalloc.stop()
    # One copy comes out of the message (reading raw_data copies); the tensor is a view of it.
    assert 0.95 * x.nbytes <= held <= peak < 1.1 * x.nbytes, (held, peak, x.nbytes)
    assert torch.equal(tensor, torch.from_numpy(x))


def test_small_inputs_are_copied_into_a_writable_buffer(demo_server):
    """Tiny bytes objects may be interpreter-shared; they are never handed to a model as a view."""
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_UINT8, shape=[1], raw_data=b"\x07")
    from layertap.server.codec import tensor_from_proto

    t = tensor_from_proto(msg)
    t.add_(1)
    assert b"\x07" == bytes([7]) and int(t) == 8


def test_inputs_move_to_the_device_under_the_model_lock(demo_server, monkeypatch):
    """Requests waiting for the model hold no device copy: the move waits for the lock."""
    host = demo_server.state.host
    lock = host.pass_lock()
    inputs = {id(t): t for t in (torch.from_numpy(batch(2, seed=i)) for i in range(4))}
    moved_under_lock: queue.Queue[bool] = queue.Queue()
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if id(self) in inputs:
            moved_under_lock.put(lock._is_owned())  # type: ignore[attr-defined]
        return real_to(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "to", to)
    with lock:  # a long pass in progress
        waiting = [threading.Thread(target=host.run, args=([t],)) for t in inputs.values()]
        for t in waiting:
            t.start()
        time.sleep(0.3)
        assert moved_under_lock.empty()  # four requests wait, none has moved its input
    for t in waiting:
        t.join(10)
    seen = [moved_under_lock.get_nowait() for _ in range(moved_under_lock.qsize())]
    assert seen == [True] * 4
