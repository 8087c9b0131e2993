"""Prometheus exposition: names, labels, the layer cap, pipeline self-metrics, promtool, and the HTTP endpoint."""

from __future__ import annotations

import logging
import shutil
import subprocess
import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from support.e2e import wait_for

from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.endpoint import start_metrics_server, stop_metrics_server
from layertap.server.export.exposition import render_latest, render_openmetrics
from layertap.server.export.health import ServerMetrics
from layertap.server.export.pipeline import PipelineCollector
from layertap.server.export.snapshots import LayerSnapshot, SnapshotStore
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

EDGES = [-1.0, -0.5, 0.0, 0.5, 1.0]
PROBS = [0.01, 0.5, 0.99]


def summary(layer: str, tap: str = "tap-1", nan: int = 0, inf: int = 0, output_index: int = 0, ts: float = 1_700_000_000.5) -> pb.Summary:
    s = pb.Summary(tap=tap, layer=layer, point=pb.POINT_OUTPUT, output_index=output_index)
    s.wall_time.FromNanoseconds(int(ts * 1e9))
    add = s.results.add
    add().moments.CopyFrom(pb.Moments(count=100, mean=0.25, std=1.5))
    add().minmax.CopyFrom(pb.MinMax(min=-3.0, max=4.0))
    add().abs_max.value = 4.0
    add().zero_fraction.CopyFrom(pb.ZeroFraction(fraction=0.1, count=10))
    add().nonfinite.CopyFrom(pb.Nonfinite(nan_count=nan, inf_count=inf))
    add().quantiles.CopyFrom(pb.Quantiles(probabilities=PROBS, values=[-2.0, 0.2, 3.0]))
    add().histogram.CopyFrom(pb.Histogram(edges=EDGES, counts=[1, 2, 3, 4, 5, 6]))
    return s


@dataclass
class FakeTransferStats:
    processed: int = 0
    dropped: int = 0
    errors: int = 0
    pinned_allocations: int = 0


PIPELINE_TRANSFER = (
    "layertap_transfer_passes_total",
    "layertap_transfer_dropped_passes_total",
    "layertap_transfer_errors_total",
    "layertap_pinned_buffers_allocated_total",
)
PIPELINE_BASELINE = "layertap_baseline_skipped_passes_total"


SCORE = DriftScore(0.3, 0.05, 0.2, 0.5, DriftThresholds(), window_passes=5, baseline_passes=10, channel_drift_fraction=0.25)
#: 6 gauges + quantiles + nan/inf + last_update + 4 drift + 4 thresholds + channel + (edges + +Inf) buckets.
SERIES_PER_LAYER = 6 + len(PROBS) + 2 + 1 + 4 + 4 + 1 + (len(EDGES) + 1)


@pytest.fixture
def setup() -> tuple[CollectorRegistry, SnapshotStore, ActivationCollector]:
    registry = CollectorRegistry()
    ServerMetrics(registry, "demo", version="0.1.0", torch_version="2.x", cuda=False)
    store = SnapshotStore()
    collector = ActivationCollector(store.snapshot, "demo", max_layers=3)
    registry.register(collector)
    return registry, store, collector


def families(registry: CollectorRegistry) -> dict[str, list]:
    text = render_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_health_metrics_names_and_labels(setup) -> None:
    registry, _, _ = setup
    m = ServerMetrics(CollectorRegistry(), "x", cuda=False)  # a second registry: nothing global
    m.record_inference("OK", 0.02)
    reg = registry
    assert reg.get_sample_value("layertap_build_info", {"model": "demo", "version": "0.1.0", "torch_version": "2.x"}) == 1.0
    for name in ("layertap_reducer_errors_total", "layertap_capture_bytes_total", "layertap_stream_messages_total",
                 "layertap_stream_dropped_total", "layertap_subscribers", "layertap_taps",
                 "layertap_baseline_load_errors_total", "layertap_hook_duration_seconds_count",
                 "layertap_inference_duration_seconds_count"):
        assert reg.get_sample_value(name, {"model": "demo"}) == 0.0, name
    assert reg.get_sample_value("layertap_inference_requests_total", {"model": "demo", "status": "OK"}) == 0.0
    assert reg.get_sample_value("layertap_captures_total", {"model": "demo", "code": "OK"}) == 0.0
    assert reg.get_sample_value("layertap_cuda_memory_allocated_bytes", {"model": "demo", "device": "0"}) is None


def test_health_metrics_record(setup) -> None:
    registry = CollectorRegistry()
    m = ServerMetrics(registry, "demo", cuda=False)
    m.record_inference("INVALID_ARGUMENT", 0.5)
    m.observe_hooks(3e-4)
    m.record_capture("RESOURCE_EXHAUSTED")
    m.record_capture("OK", 1024)
    m.stream_dropped.inc(3)
    m.taps.set(2)
    g = registry.get_sample_value
    assert g("layertap_inference_requests_total", {"model": "demo", "status": "INVALID_ARGUMENT"}) == 1.0
    assert g("layertap_inference_duration_seconds_sum", {"model": "demo"}) == 0.5
    assert g("layertap_hook_duration_seconds_bucket", {"model": "demo", "le": "0.0005"}) == 1.0
    assert g("layertap_captures_total", {"model": "demo", "code": "RESOURCE_EXHAUSTED"}) == 1.0
    assert g("layertap_capture_bytes_total", {"model": "demo"}) == 1024.0
    assert g("layertap_stream_dropped_total", {"model": "demo"}) == 3.0
    assert g("layertap_taps", {"model": "demo"}) == 2.0


def test_activation_series_from_summaries(setup) -> None:
    registry, store, _ = setup
    store.update_from_summary("tap-1", summary("layer1", nan=2))
    store.update_from_summary("tap-1", summary("layer1", nan=1, inf=4))
    store.update_from_summary("tap-1", summary("layer1", nan=5, output_index=1))  # second output: nonfinite only
    store.set_drift("tap-1", "layer1", "output", SCORE)
    lab = {"model": "demo", "layer": "layer1", "point": "output", "tap": "tap-1", "phase": "forward"}
    g = registry.get_sample_value
    assert g("layertap_activation_mean", lab) == 0.25 and g("layertap_activation_std", lab) == 1.5
    assert g("layertap_activation_min", lab) == -3.0 and g("layertap_activation_max", lab) == 4.0
    assert g("layertap_activation_abs_max", lab) == 4.0 and g("layertap_activation_zero_fraction", lab) == 0.1
    assert g("layertap_activation_quantile", {**lab, "q": "0.5"}) == 0.2
    assert g("layertap_activation_nonfinite_total", {**lab, "kind": "nan"}) == 8.0
    assert g("layertap_activation_nonfinite_total", {**lab, "kind": "inf"}) == 4.0
    assert g("layertap_activation_last_update_timestamp_seconds", lab) == 1_700_000_000.5
    assert g("layertap_activation_drift", {**lab, "metric": "psi"}) == 0.3
    assert g("layertap_activation_drift_threshold", {**lab, "metric": "mean_shift"}) == 1.0
    assert g("layertap_activation_channel_drift_fraction", lab) == 0.25
    # Histogram counts accumulate (a counter), cumulative over le, +Inf = total.
    assert g("layertap_activation_value_bucket", {**lab, "le": "-1.0"}) == 2.0
    assert g("layertap_activation_value_bucket", {**lab, "le": "0.0"}) == 12.0
    assert g("layertap_activation_value_bucket", {**lab, "le": "+Inf"}) == 42.0
    # New edges (a baseline froze) restart the histogram.
    s = summary("layer1")
    del s.results[-1]
    s.results.add().histogram.CopyFrom(pb.Histogram(edges=[0.0], counts=[7, 9]))
    store.update_from_summary("tap-1", s)
    assert g("layertap_activation_value_bucket", {**lab, "le": "0.0"}) == 7.0
    assert g("layertap_activation_value_bucket", {**lab, "le": "-1.0"}) is None


def test_series_per_tapped_layer_and_untapped_omitted(setup) -> None:
    registry, store, _ = setup
    base_series = sum(len(s) for s in families(registry).values())
    store.update_from_summary("tap-1", summary("layer1"))
    store.set_drift("tap-1", "layer1", "output", SCORE)
    one = sum(len(s) for s in families(registry).values())
    assert one - base_series == SERIES_PER_LAYER == 27
    # A layer with only nonfinite tapped exports only that counter and its timestamp.
    s = pb.Summary(tap="tap-2", layer="layer2", point=pb.POINT_OUTPUT, unsampled=True)
    s.results.add().nonfinite.CopyFrom(pb.Nonfinite())
    store.update_from_summary("tap-2", s)
    fam = families(registry)
    layer2 = [(n, smp.name) for n, smps in fam.items() for smp in smps if smp.labels.get("layer") == "layer2"]
    assert sorted(x[1] for x in layer2) == sorted(
        ["layertap_activation_nonfinite_total"] * 2 + ["layertap_activation_last_update_timestamp_seconds"]
    )


def test_cap_on_exported_layers(setup, caplog: pytest.LogCaptureFixture) -> None:
    registry, store, _ = setup
    for i in range(5):
        store.update_from_summary("tap-1", summary(f"layer{i}"))
    with caplog.at_level(logging.WARNING, logger="layertap.server.export.activations"):
        for _ in range(3):
            fam = families(registry)
    exported = {s.labels["layer"] for s in fam["layertap_activation_mean"]}
    assert exported == {"layer0", "layer1", "layer2"}  # first come, first served
    assert registry.get_sample_value("layertap_export_layers_dropped", {"model": "demo"}) == 2.0
    assert len([r for r in caplog.records if "export cap" in r.getMessage()]) == 1  # one line, not per scrape
    store.remove_tap("tap-1")
    assert registry.get_sample_value("layertap_export_layers_dropped", {"model": "demo"}) == 0.0
    assert registry.get_sample_value("layertap_activation_mean", {"model": "demo", "layer": "layer0", "point": "output", "tap": "tap-1",
                                                               "phase": "forward"}) is None


def test_histogram_buckets_are_bounded() -> None:
    registry = CollectorRegistry()
    edges = np.linspace(-5, 5, 200)
    snap = LayerSnapshot("t", "l", "output", histogram=(edges, np.ones(201, dtype=np.int64)))
    registry.register(ActivationCollector(lambda: [snap], "m", max_buckets=16))
    buckets = [s for s in families(registry)["layertap_activation_value"] if s.name.endswith("_bucket")]
    assert len(buckets) == 16 and buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 201
    values = [b.value for b in buckets]
    assert values == sorted(values)  # still cumulative


def test_fast_render_matches_generate_latest_and_passes_promtool(setup) -> None:
    registry, store, _ = setup
    store.update_from_summary("tap-1", summary('we"ird\\layer\n'))  # label escaping
    store.update_from_summary("tap-1", summary("layer1"))
    store.set_drift("tap-1", "layer1", "output", SCORE)
    store.set_drift("tap-1", "layer1", "output", DriftScore(float("nan"), float("inf"), 0.0, 0.0))
    registry.register(PipelineCollector("demo", lambda: FakeTransferStats(12, 3, 1, 4_000_000), lambda: 2))
    fast, slow = render_latest(registry), generate_latest(registry)
    assert fast == slow
    assert render_openmetrics(registry) == generate_openmetrics(registry)  # the other negotiated format
    assert b'layertap_transfer_dropped_passes_total{model="demo"} 3.0' in fast
    list(text_string_to_metric_families(fast.decode()))  # parses
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (CI installs it)")
    res = subprocess.run([promtool, "check", "metrics"], input=fast, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


def test_http_endpoint_on_port_zero(setup) -> None:
    registry, store, _ = setup
    store.update_from_summary("tap-1", summary("layer1"))
    server, port = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = resp.read().decode()
    finally:
        stop_metrics_server(server)
    names = {f.name for f in text_string_to_metric_families(body)}
    assert {"layertap_activation_mean", "layertap_inference_requests", "layertap_export_layers_dropped"} <= names


def test_idle_connections_neither_pile_up_threads_nor_block_scrapes(setup) -> None:
    """Sockets that connect and send nothing (no token needed) each held a thread for as long
    as they stayed open; a byte every few seconds defeated a per-read timeout. Now each
    connection lives request_timeout at most, and one address gets max_per_address of them."""
    import http.client
    import socket
    import threading
    import time

    registry, store, _ = setup
    store.update_from_summary("tap-1", summary("layer1"))

    def serving() -> int:
        return sum(1 for t in threading.enumerate() if "process_request_thread" in t.name)

    server, port = start_metrics_server(registry, "127.0.0.1", 0, request_timeout=1.0, max_connections=10,
                                        max_per_address=4)
    limits = server.connection_limits
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    drip = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.3", 0))
    try:
        for sock in (*idle, drip):
            sock.settimeout(10)
        time.sleep(0.3)  # room to pile up: admission comes before a thread, so this holds however busy
        assert serving() <= 5  # 4 from 127.0.0.1, the dripping one from 127.0.0.3
        # Another address still gets its scrape while 127.0.0.1 holds all of its share.
        scrape = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=("127.0.0.2", 0))
        scrape.request("GET", "/metrics")
        response = scrape.getresponse()
        assert response.status == 200 and b"layertap_activation_mean" in response.read()
        scrape.close()
        # A byte of a request line every 0.2 s for up to DRIP s: kept alive by the drip, the connection
        # would outlast it; at its deadline (1 s) it ends well within half of it, however busy the machine.
        drip_seconds = 10.0
        start, cut = time.monotonic(), None
        while time.monotonic() - start < drip_seconds:
            try:
                drip.sendall(b"G")
            except OSError:
                cut = time.monotonic() - start
                break
            time.sleep(0.2)
            drip.setblocking(False)
            try:
                if drip.recv(1) == b"":
                    cut = time.monotonic() - start
                    break
            except BlockingIOError:
                pass
            finally:
                drip.setblocking(True)
                drip.settimeout(10)
        assert cut is not None and cut < drip_seconds / 2, cut  # ended at its deadline (1 s), not kept alive by the drip
        assert [sock.recv(1) for sock in idle] == [b""] * 8  # 4 closed at accept, 4 at their deadline
        assert wait_for(lambda: serving() == 0)
        assert limits.count() == 0 and limits.expired >= 5
    finally:
        for sock in (*idle, drip):
            sock.close()
        stop_metrics_server(server)


def test_stopping_the_endpoint_hangs_up_its_open_connections(setup) -> None:
    """Past the stop no reaper enforces deadlines: the stop itself ends what is still open."""
    import socket
    import time

    registry, _, _ = setup
    server, port = start_metrics_server(registry, "127.0.0.1", 0, request_timeout=30.0)
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(b"GET /met")  # a request never finished
        assert wait_for(lambda: server.connection_limits.count() == 1)  # the server holds it
        start = time.monotonic()
        stop_metrics_server(server)
        sock.settimeout(20)
        # Hung up by the stop, not at the connection's 30 s deadline: half of it is room for a busy machine.
        assert sock.recv(1) == b"" and time.monotonic() - start < 15
    finally:
        sock.close()


def test_pipeline_counters_follow_their_sources() -> None:
    registry = CollectorRegistry()
    stats = FakeTransferStats(processed=10, dropped=2, errors=1, pinned_allocations=3)
    skipped = [5]
    registry.register(PipelineCollector("demo", lambda: stats, lambda: skipped[0]))
    g = registry.get_sample_value
    lab = {"model": "demo"}
    assert [g(n, lab) for n in PIPELINE_TRANSFER] == [10.0, 2.0, 1.0, 3.0]
    assert g(PIPELINE_BASELINE, lab) == 5.0
    stats.processed, stats.dropped, stats.errors, stats.pinned_allocations = 20, 7, 4, 6
    skipped[0] = 9
    assert [g(n, lab) for n in PIPELINE_TRANSFER] == [20.0, 7.0, 4.0, 6.0]
    assert g(PIPELINE_BASELINE, lab) == 9.0
    # A new stats object each call (what HostTransfer.stats() returns) is read afresh.
    registry2 = CollectorRegistry()
    calls = iter(range(1, 100))
    registry2.register(PipelineCollector("demo", lambda: FakeTransferStats(processed=next(calls))))
    assert registry2.get_sample_value("layertap_transfer_passes_total", lab) == 1.0
    assert registry2.get_sample_value("layertap_transfer_passes_total", lab) == 2.0
    # Only the injected registry: the global one never sees these.
    assert REGISTRY.get_sample_value("layertap_transfer_passes_total", lab) is None


def test_pipeline_counters_are_counters_with_help_and_model_label() -> None:
    registry = CollectorRegistry()
    registry.register(PipelineCollector("m1", lambda: FakeTransferStats(1, 1, 1, 1), lambda: 1))
    fams = {f.name: f for f in text_string_to_metric_families(render_latest(registry).decode())}
    for name in (*PIPELINE_TRANSFER, PIPELINE_BASELINE):
        fam = fams[name.removesuffix("_total")]
        assert fam.type == "counter" and fam.documentation, name
        assert [(s.name, s.labels) for s in fam.samples] == [(name, {"model": "m1"})]


def test_pipeline_none_source_emits_nothing_for_its_families() -> None:
    only_baseline = CollectorRegistry()
    only_baseline.register(PipelineCollector("demo", None, lambda: 4))
    assert only_baseline.get_sample_value(PIPELINE_BASELINE, {"model": "demo"}) == 4.0
    text = render_latest(only_baseline).decode()
    for name in PIPELINE_TRANSFER:
        assert only_baseline.get_sample_value(name, {"model": "demo"}) is None
        assert name.removesuffix("_total") not in text
    only_transfer = CollectorRegistry()
    only_transfer.register(PipelineCollector("demo", transfer=lambda: FakeTransferStats(1, 0, 0, 2)))
    assert only_transfer.get_sample_value("layertap_transfer_passes_total", {"model": "demo"}) == 1.0
    assert only_transfer.get_sample_value(PIPELINE_BASELINE, {"model": "demo"}) is None
    assert "layertap_baseline_skipped" not in render_latest(only_transfer).decode()
    nothing = CollectorRegistry()
    nothing.register(PipelineCollector("demo"))
    assert render_latest(nothing) == generate_latest(nothing) == b""


def test_pipeline_failing_source_is_skipped_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    broken = [True]

    def stats() -> FakeTransferStats:
        if broken[0]:
            raise RuntimeError("stats unavailable")
        return FakeTransferStats(processed=3)

    registry.register(PipelineCollector("demo", stats, lambda: 1))
    with caplog.at_level(logging.WARNING, logger="layertap.server.export.pipeline"):
        for _ in range(3):
            assert registry.get_sample_value("layertap_transfer_passes_total", {"model": "demo"}) is None
            assert registry.get_sample_value(PIPELINE_BASELINE, {"model": "demo"}) == 1.0  # the rest survives
    assert len([r for r in caplog.records if "transfer pipeline counts failed" in r.getMessage()]) == 1
    broken[0] = False
    assert registry.get_sample_value("layertap_transfer_passes_total", {"model": "demo"}) == 3.0


def test_pipeline_names_clash_on_a_second_registration() -> None:
    registry = CollectorRegistry()
    registry.register(PipelineCollector("demo", lambda: FakeTransferStats(), lambda: 0))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(PipelineCollector("demo", lambda: FakeTransferStats()))
