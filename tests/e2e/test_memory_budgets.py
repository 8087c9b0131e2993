"""Never-reading wide subscribers against a real ``layertap serve``: bytes held stay in budget.

The server's RSS is read from /proc, so only the served process is measured
(the never-reading clients live in the test process).
"""

from __future__ import annotations

import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.e2e import scrape, wait_for

from layertap import Client
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")]

SUBSCRIBERS = 8
BUDGET = 2 << 20
#: Growth the budget leaves room for: the budget itself, the newest pass, and
#: each stream's message in gRPC's hands, several times over for the Python
#: objects behind the wire bytes. Eight 16 MiB queues with no budget are 128 MiB of wire bytes.
RSS_GROWTH_MIB = 150


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def infer_until(port: int, stop: threading.Event) -> None:
    x = np.random.default_rng(0).standard_normal((8, 3, 32, 32)).astype(np.float32)
    with Client(f"127.0.0.1:{port}") as c:
        while not stop.is_set():
            c.infer(x, timeout=30)


def test_never_reading_wide_subscribers_stay_in_the_byte_budget(serve_process):
    srv = serve_process("--metrics-port", "0", "--subscribers-budget-bytes", str(BUDGET))
    assert srv.metrics_port is not None
    pid = srv.proc.pid
    stop = threading.Event()
    driver = threading.Thread(target=infer_until, args=(srv.port, stop), daemon=True)
    driver.start()
    channels: list[grpc.Channel] = []
    try:
        time.sleep(2)
        before = rss_mib(pid)
        # No BDP probing: the client's windows stay 64 KiB, so a reader that never
        # reads pushes back on the server within a few messages, as a stalled one would.
        channels = [grpc.insecure_channel(srv.address, options=[("grpc.http2.bdp_probe", 0)])
                    for _ in range(SUBSCRIBERS)]
        wide = pb.SubscribeRequest(stream_taps=[pb.TapSpec(selector="**", reducers=[
            pb.ReducerSpec(kind=k) for k in (pb.REDUCER_KIND_MOMENTS, pb.REDUCER_KIND_HISTOGRAM,
                                             pb.REDUCER_KIND_PER_CHANNEL)])])
        calls = [telemetry_pb2_grpc.TelemetryServiceStub(ch).Subscribe(wide) for ch in channels]
        for call in calls:
            next(call)  # open: its stream tap exists; nothing more is ever read
        assert wait_for(lambda: scrape(srv.metrics_port).get("layertap_stream_budget_dropped_total", 0) > 0, 40), \
            "the budget never dropped anything"
        held, peak = [], before
        for _ in range(5):
            m = scrape(srv.metrics_port)
            held.append(m["layertap_stream_held_bytes"])
            peak = max(peak, rss_mib(pid))
            time.sleep(0.3)
        m = scrape(srv.metrics_port)
        # Budget drops are stream drops too, and each is one message a subscriber lost.
        assert m["layertap_stream_dropped_total"] >= m["layertap_stream_budget_dropped_total"] > 0
        # Over the budget by at most the newest pass's messages (~1 MiB here for all eight).
        assert 0 < max(held) <= BUDGET + (2 << 20), held
        print(f"held {held}, rss before {before:.0f} peak {peak:.0f} MiB")
        assert peak - before < RSS_GROWTH_MIB, (before, peak)
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()
        assert wait_for(lambda: scrape(srv.metrics_port)["layertap_subscribers"] == 0, 10)
        assert scrape(srv.metrics_port)["layertap_stream_held_bytes"] == 0
        assert wait_for(lambda: rss_mib(pid) <= 1.2 * before, 10), (before, peak, rss_mib(pid))
        print(f"rss after {rss_mib(pid):.0f} MiB")
        with grpc.insecure_channel(srv.address) as fresh:
            resp = health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop.set()
        for ch in channels:
            ch.close()
        driver.join(30)
