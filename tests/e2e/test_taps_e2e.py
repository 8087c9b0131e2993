"""Taps and summary streams over real gRPC with the real client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from support.e2e import assert_basic_summaries, batch, first_per_layer, wait_for
from support.models import layer_outputs

import layertap

pytestmark = pytest.mark.e2e


def test_watch_streams_correct_summaries(client, demo_server):
    x = batch(3, seed=4)
    ref = layer_outputs(x, ["layer1", "layer2", "layer3", "layer4"])
    with client.watch("layer*", reducers=["moments", "minmax", "nonfinite"], timeout=60) as stream:
        assert wait_for(lambda: client.stats().active_hooks == 4)
        client.infer(x)
        got = first_per_layer(stream, 4)
    assert_basic_summaries(got, ref)
    assert wait_for(lambda: client.stats().active_hooks == 0)  # stream tap ended with the stream
    assert client.taps() == []


def test_durable_tap_context_manager_and_list(client):
    with client.tap("fc", reducers=["moments", "abs_max"], ttl=60, name="head") as t:
        infos = client.taps()
        assert [(i.id, i.kind) for i in infos] == [("head", "durable")]
        assert infos[0].expires_at is not None
        with t.summaries(timeout=60) as stream:
            assert wait_for(lambda: client.stats().subscribers == 1)
            x = batch(2, seed=9)
            client.infer(x)
            s = next(stream)
        ref = layer_outputs(x, ["fc"])["fc"]
        np.testing.assert_allclose(s.results["abs_max"].value, np.abs(ref).max(), rtol=1e-12)
        assert t.refresh().hits == 1
    assert client.taps() == []
    assert client.stats().active_hooks == 0


def test_bad_specs_map_to_status_codes(client):
    with pytest.raises(layertap.LayerNotFound, match="layer4"):
        client.create_tap("layer9*", reducers=["moments"])
    with pytest.raises(layertap.InvalidArgument, match="histogram"):
        client.create_tap("fc", reducers=[{"histogram": {"bins": 0, "min": 1, "max": 0}}])
    with pytest.raises(layertap.InvalidArgument):
        client.create_tap("fc", reducers=["moments"], probability=3.0)


def test_slow_subscriber_drops_are_counted_and_fast_one_gets_all(client, demo_server):
    n = 40
    # ~10 KB per message (1024 histogram edges), so the slow reader's HTTP/2
    # window (64 KiB, BDP probing off) fills after a few messages.
    tap = client.create_tap("fc", reducers=["moments", {"histogram": {"bins": 1024, "min": -4, "max": 4}}],
                            ttl=120, name="drops")
    import grpc

    from layertap.v1 import telemetry_pb2, telemetry_pb2_grpc

    channel = grpc.insecure_channel(client.target, options=[("grpc.http2.bdp_probe", 0)])
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    # A raw subscriber that never reads past its first message.
    slow = stub.Subscribe(telemetry_pb2.SubscribeRequest(tap_ids=[tap.id], queue_size=2), timeout=120)
    next(slow)
    with client.subscribe([tap.id], queue_size=1000, timeout=120) as fast:
        assert wait_for(lambda: client.stats().subscribers == 2)
        x = batch(1)
        for _ in range(n):
            client.infer(x)
        got = [next(fast) for _ in range(n)]
        assert [s.pass_index for s in got] == sorted({s.pass_index for s in got})
        assert fast.dropped == 0
        # The slow subscriber's queue (2) plus what its gRPC window absorbed;
        # everything else was dropped and counted, and nobody blocked.
        sub_stats = demo_server.state.broker
        assert wait_for(lambda: sub_stats.dropped_total > 0)
    dropped = client.stats().stream_dropped
    assert 0 < dropped <= n - 2
    # What the slow reader finally gets says how many it lost, matching the server.
    last = None
    for msg in slow:
        last = msg
        if msg.dropped == dropped:
            break
    assert last is not None and last.dropped == dropped
    slow.cancel()
    channel.close()


def test_sixteen_concurrent_subscribers(client, demo_server):
    tap = client.create_tap("layer3", reducers=["moments", "minmax"], ttl=120)
    results: dict[int, list] = {}
    errors: list = []
    ready = threading.Barrier(17)

    def sub(i: int) -> None:
        try:
            ids = (tap.id if i % 4 == 1 else "") if i % 2 else [tap.id]  # a bare id is one tap; "" all of them
            with layertap.Client(client.target) as c, c.subscribe(ids, timeout=120) as stream:
                ready.wait(30)
                results[i] = [next(stream) for _ in range(3)]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=sub, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    ready.wait(30)
    assert wait_for(lambda: client.stats().subscribers == 16, 10)
    xs = [batch(2, seed=50 + k) for k in range(3)]
    for x in xs:
        client.infer(x)
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    refs = [layer_outputs(x, ["layer3"])["layer3"] for x in xs]
    for i in range(16):
        for s, ref in zip(results[i], refs):
            np.testing.assert_allclose(s.results["moments"].mean, ref.mean(), rtol=1e-9, atol=1e-12)
            assert s.results["minmax"].min == ref.min()


SUBSCRIBER = textwrap.dedent("""
    import sys, layertap
    with layertap.Client(sys.argv[1]) as c:
        stream = c.watch("layer*", reducers=["moments"])
        print("watching", flush=True)
        for s in stream:
            pass
""")


def test_sigkilled_subscriber_removes_its_stream_taps(demo_server):
    addr = f"127.0.0.1:{demo_server.port}"
    with layertap.Client(addr) as client:
        client.create_tap("fc", reducers=["moments"], ttl=60)
        before = client.stats().active_hooks
        proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, addr], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "watching"
        assert wait_for(lambda: client.stats().active_hooks == before + 4, 10)
        client.infer(batch())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_for(lambda: client.stats().active_hooks == before, 5)
        assert wait_for(lambda: client.stats().subscribers == 0, 5)
        assert [t.kind for t in client.taps()] == ["durable"]


def test_reducer_error_does_not_fail_infer_and_is_reported(client):
    with client.watch("layer4", reducers=[{"per_channel": {"dim": 9}}], timeout=60) as stream:
        assert wait_for(lambda: client.stats().active_hooks == 1)
        out = client.infer(batch())
        assert out.shape == (4, 10)
        for _batch in stream.batches():
            if stream.events:
                break
    assert stream.events[-1].kind == "disabled"
    assert client.stats().reducer_errors == 1
