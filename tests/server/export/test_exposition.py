"""The fast ``/metrics`` writers against prometheus-client's own: bytes, parsers, promtool, negotiation, HTTP."""

from __future__ import annotations

import gzip
import math
import shutil
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.utils import floatToGoString

from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.endpoint import accepts_gzip, start_metrics_server, stop_metrics_server
from layertap.server.export.exposition import negotiate, render, render_latest, render_openmetrics
from layertap.server.export.health import ServerMetrics
from layertap.server.export.series import Lines, fmt_value
from layertap.server.export.snapshots import LayerSnapshot, SnapshotStore
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

#: Label values that need escaping or are not ASCII (and a '%', which the line layout must keep).
WEIRD = ['we"ird', "back\\slash", "new\nline", "ünï—コード", '100% "all"\\\n']
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def summary(layer: str, tap: str, rng: np.random.Generator, scale: int = 1, signed: bool = True) -> pb.Summary:
    s = pb.Summary(tap=tap, layer=layer, point=pb.POINT_OUTPUT)
    s.wall_time.FromNanoseconds(1_700_000_000_123_456_789 + int(rng.integers(0, 10**9)))
    x = rng.normal(size=256) if signed else np.abs(rng.normal(size=256))
    add = s.results.add
    add().moments.CopyFrom(pb.Moments(count=x.size, mean=float(x.mean()), std=float(x.std())))
    add().minmax.CopyFrom(pb.MinMax(min=float(x.min()), max=float(x.max())))
    add().abs_max.value = float(np.abs(x).max())
    add().zero_fraction.fraction = 0.0
    add().nonfinite.CopyFrom(pb.Nonfinite(nan_count=int(rng.integers(0, 3)), inf_count=0))
    probs = [0.01, 0.5, 0.99]
    add().quantiles.CopyFrom(pb.Quantiles(probabilities=probs, values=np.quantile(x, probs).tolist()))
    edges = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])
    counts = np.bincount(np.searchsorted(edges, x, side="right"), minlength=edges.size + 1) * scale
    add().histogram.CopyFrom(pb.Histogram(edges=edges.tolist(), counts=counts.tolist()))
    return s


def make_registry(layers: list[tuple[str, str]]) -> tuple[CollectorRegistry, SnapshotStore]:
    registry = CollectorRegistry()
    ServerMetrics(registry, 'mo"del\\', version="0.1.0", torch_version="2.x", cuda=False)
    store = SnapshotStore()
    registry.register(ActivationCollector(store.snapshot, 'mo"del\\', max_layers=len(layers) - 1))
    return registry, store


def assert_same_bytes(registry: CollectorRegistry) -> bytes:
    text, om = render_latest(registry), render_openmetrics(registry)
    assert text == generate_latest(registry)
    assert om == generate_openmetrics(registry)
    return text


@pytest.mark.parametrize("v", [0.0, -0.0, 1.0, 0.1, -2.5, 999_999.9999, 1e6, 1_000_001.0, 1_234_567.0, 1.7e9 + 0.123,
                               1e15, 9_007_199_254_740_993.0, 1e16, 1.5e300, -1e6, -1e20, 5e-324, 1e-7,
                               math.nan, math.inf, -math.inf])
def test_fmt_value_is_float_to_go_string(v: float) -> None:
    assert fmt_value(v) == floatToGoString(v)


def test_fmt_value_matches_on_random_values() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(size=2000), rng.normal(size=2000) * 1e9, rng.integers(0, 10**12, 2000),
                             np.exp(rng.uniform(-700, 700, 2000)), rng.normal(size=2000).astype(np.float32)])
    for v in values.tolist():
        assert fmt_value(float(v)) == floatToGoString(v), v


@pytest.mark.parametrize("values", [[0, 1, 999_999, 42], [0, -7, 3], [-(10**16), 5], [0, 1_000_000, 3],
                                    [10**8, 2**53 + 1], [True, 2], [1, 2.5], [np.int64(3), 4], []])
def test_lines_write_counts_as_prometheus_client_does(values: list) -> None:
    """Ints below 1e6 take a shortcut in Lines.fill; every mix must print as floatToGoString."""
    lines = Lines([f"m{i} " for i in range(len(values))])
    assert lines.fill(values) == "".join(f"m{i} {floatToGoString(float(v))}\n" for i, v in enumerate(values))


def test_same_bytes_as_prometheus_client_through_updates_escaping_nonfinite_and_removal() -> None:
    rng = np.random.default_rng(1)
    layers = [(f"blocks.{i}", "tap-a") for i in range(4)] + [(w, "tap-b") for w in WEIRD] + [("x", "tap-c")]
    registry, store = make_registry(layers)
    for layer, tap in layers:
        store.update_from_summary(tap, summary(layer, tap, rng))
    assert_same_bytes(registry)  # cold: everything laid out
    assert_same_bytes(registry)  # warm: nothing changed, cached text
    # Non-finite values everywhere a gauge can hold one, and counters past 1e6 (Go's exponent form).
    store.set_drift("tap-a", "blocks.0", "output", DriftScore(math.nan, math.inf, -math.inf, 0.0,
                                                             DriftThresholds(), channel_drift_fraction=0.5))
    store.set_drift("tap-b", WEIRD[0], "output", DriftScore(0.1, 0.2, 0.3, -0.0, DriftThresholds(psi=1e7)))
    nan = pb.Summary(tap="tap-a", layer="blocks.1", point=pb.POINT_OUTPUT)
    nan.results.add().moments.CopyFrom(pb.Moments(count=4, mean=math.nan, std=math.inf))
    nan.results.add().minmax.CopyFrom(pb.MinMax(min=-math.inf, max=math.inf))
    store.update_from_summary("tap-a", nan)
    store.update_from_summary("tap-a", summary("blocks.2", "tap-a", rng, scale=10**7))
    text = assert_same_bytes(registry).decode()
    assert 'layertap_activation_mean{layer="blocks.1",model="mo\\"del\\\\",phase="forward",point="output",tap="tap-a"} NaN' in text
    assert 'layertap_activation_drift{layer="blocks.0",metric="js",model="mo\\"del\\\\",phase="forward",point="output",tap="tap-a"} +Inf' in text
    assert "e+0" in text.split("layertap_activation_value_bucket", 1)[1]
    assert 'layer="new\\nline"' in text and 'layer="ünï—コード"' in text and 'layer="100% \\"all\\"\\\\\\n"' in text
    assert "layertap_export_layers_dropped{" in text and text.count('tap="tap-c"') == 0  # over the cap
    # Every layer updated, then a tap deleted: its series go, the dropped layer takes a slot.
    for layer, tap in layers:
        store.update_from_summary(tap, summary(layer, tap, rng))
    assert_same_bytes(registry)
    store.remove_tap("tap-b")
    text = assert_same_bytes(registry).decode()
    assert 'tap="tap-b"' not in text and 'tap="tap-c"' in text
    store.add_tap("tap-b")  # back under a reused name: laid out again
    store.update_from_summary("tap-b", summary(WEIRD[4], "tap-b", rng))
    assert 'tap="tap-b"' in assert_same_bytes(registry).decode()


def test_unchanged_layers_keep_their_snapshot_object() -> None:
    rng = np.random.default_rng(2)
    store = SnapshotStore()
    store.update_from_summary("t", summary("a", "t", rng))
    store.update_from_summary("t", summary("b", "t", rng))
    a1, b1 = store.snapshot()
    store.update_from_summary("t", summary("b", "t", rng))
    a2, b2 = store.snapshot()
    assert a2 is a1 and b2 is not b1 and b2.mean != b1.mean
    store.set_drift("t", "a", "output", DriftScore(0.1, 0.1, 0.1, 0.1))
    (a3, b3) = store.snapshot()
    assert a3 is not a1 and a3.drift is not None and b3 is b2


def test_both_formats_parse_with_prometheus_clients_parsers_and_promtool() -> None:
    rng = np.random.default_rng(3)
    layers = [("layer.0", "t"), (WEIRD[2], "t"), ("spare", "t")]
    registry, store = make_registry(layers)
    for layer, tap in layers[:2]:
        # Signed activations: negative quantiles must parse in both formats (a
        # summary's would not in OpenMetrics, hence the gauge with label q).
        store.update_from_summary(tap, summary(layer, tap, rng))
        store.set_drift(tap, layer, "output", DriftScore(0.5, 0.25, math.nan, 2.0, channel_drift_fraction=0.1))
    text, om = render_latest(registry).decode(), render_openmetrics(registry).decode()
    want = {"layer": WEIRD[2], "model": 'mo"del\\', "phase": "forward", "point": "output", "tap": "t"}
    for families in (parse_text(text), parse_openmetrics(om)):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
        assert samples[("layertap_activation_value_bucket", tuple(sorted({**want, "le": "+Inf"}.items())))] == 256
        assert samples[("layertap_activation_drift_threshold", tuple(sorted({**want, "metric": "psi"}.items())))] == 0.2
        assert math.isnan(samples[("layertap_activation_drift", tuple(sorted({**want, "metric": "wasserstein"}.items())))])
        assert min(v for (n, _), v in samples.items() if n == "layertap_activation_quantile") < 0
    assert om.endswith("# EOF\n") and "# TYPE layertap_activation_nonfinite counter\n" in om
    assert "# TYPE layertap_activation_nonfinite_total counter\n" in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (CI installs Debian's prometheus package)")
    # promtool's `check metrics` reads only the text format (2.42 stops at OpenMetrics' "info" TYPE).
    res = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert res.returncode == 0 and not res.stdout.strip(), (res.stdout + res.stderr).decode()


@pytest.mark.parametrize("accept", [
    None, "", "text/plain", "text/plain;version=0.0.4", "*/*", PROMETHEUS_ACCEPT,
    "application/openmetrics-text", "application/openmetrics-text; version=0.0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.3",
    "application/openmetrics-text;version=1.0.0;escaping=values", "application/openmetrics-text; version=2.0.0",
    "text/plain;version=1.0.0;escaping=allow-utf-8", "text/plain;version=1.0.0;escaping=dots",
])
def test_negotiation_is_prometheus_clients(accept: str | None) -> None:
    registry, store = make_registry([("l", "t"), ("m", "t")])
    store.update_from_summary("t", summary("l", "t", np.random.default_rng(4)))
    encoder, content_type = negotiate(accept)
    theirs, their_type = choose_encoder(accept or "")
    assert content_type == their_type
    assert encoder(registry) == theirs(registry)


def test_render_refuses_an_escaping_that_renames() -> None:
    with pytest.raises(ValueError, match="dots"):
        render(CollectorRegistry(), escaping="dots")


@pytest.mark.parametrize(("header", "gz"), [(None, False), ("gzip", True), ("deflate, gzip;q=0.5", True),
                                            ("gzip;q=0", False), ("gzip; q=0.0", False), ("identity", False),
                                            ("GZIP", True)])
def test_accepts_gzip(header: str | None, gz: bool) -> None:
    assert accepts_gzip(header) is gz


def test_http_negotiates_format_and_gzip_end_to_end() -> None:
    rng = np.random.default_rng(5)
    registry, store = make_registry([("a", "t"), ("b", "t")])
    store.update_from_summary("t", summary("a", "t", rng, signed=False))
    server, port = start_metrics_server(registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"

    def get(headers: dict[str, str]) -> tuple[str, str | None, bytes]:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            assert r.status == 200 and r.headers["Vary"] == "Accept, Accept-Encoding"
            return r.headers["Content-Type"], r.headers["Content-Encoding"], r.read()

    try:
        ctype, enc, body = get({})
        assert ctype == "text/plain; version=0.0.4; charset=utf-8" and enc is None
        assert list(parse_text(body.decode()))
        ctype, enc, body = get({"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
        assert ctype == "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
        assert enc == "gzip"
        om = gzip.decompress(body).decode()
        assert om.endswith("# EOF\n") and {f.name for f in parse_openmetrics(om)} >= {"layertap_activation_mean"}
        with pytest.raises(urllib.error.HTTPError) as err:
            get({"Accept": "application/openmetrics-text; version=abc"})
        assert err.value.code == 400 and b"Accept header" in err.value.read()
    finally:
        stop_metrics_server(server)


def test_histogram_snapshot_with_float_counts_and_unsorted_quantiles() -> None:
    registry = CollectorRegistry()
    snap = LayerSnapshot("t", "l", "output", mean=1, quantiles={0.9: 2.0, 0.1: -1.0},
                         histogram=([0.0, 1.0], np.array([1.0, 2.0, 3.0])), nan_total=0, inf_total=2)
    registry.register(ActivationCollector(lambda: [snap], "m"))
    text = assert_same_bytes(registry).decode()
    assert text.index('q="0.1"') < text.index('q="0.9"')
    assert 'le="+Inf",model="m",phase="forward",point="output",tap="t"} 6.0' in text
