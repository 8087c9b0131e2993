"""Time one ``/metrics`` scrape with N tapped layers carrying every series.

Each layer gets moments, min/max, abs_max, zero_fraction, 7 quantiles,
non-finite counts, a 20-bin histogram on baseline-style edges, drift scores
with thresholds and a channel drift fraction; the server's health metrics are
registered too. Times, interleaved (A B C A B C ...):

* ``render_latest(registry)``: what the ``/metrics`` endpoint serves;
* ``generate_latest(registry)``: prometheus-client's own writer, same bytes;
* a real HTTP GET of ``/metrics`` on loopback (server from ``start_metrics_server``),

and prints median/p90 in ms plus the series one tapped layer costs.

    python benchmarks/scrape.py [--layers 200] [--reps 200]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import statistics
import time
import urllib.request

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.endpoint import start_metrics_server, stop_metrics_server
from layertap.server.export.exposition import render_latest
from layertap.server.export.health import ServerMetrics
from layertap.server.export.snapshots import SnapshotStore
from layertap.v1 import telemetry_pb2 as pb


def _summary(layer: str, rng: np.random.Generator, edges: np.ndarray) -> pb.Summary:
    s = pb.Summary(tap="bench", layer=layer, point=pb.POINT_OUTPUT)
    s.wall_time.GetCurrentTime()
    x = rng.normal(size=4096)
    add = s.results.add
    add().moments.CopyFrom(pb.Moments(count=x.size, mean=float(x.mean()), std=float(x.std())))
    add().minmax.CopyFrom(pb.MinMax(min=float(x.min()), max=float(x.max())))
    add().abs_max.value = float(np.abs(x).max())
    add().zero_fraction.fraction = 0.0
    add().nonfinite.CopyFrom(pb.Nonfinite(nan_count=0, inf_count=0))
    probs = [0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99]
    add().quantiles.CopyFrom(pb.Quantiles(probabilities=probs, values=np.quantile(x, probs).tolist()))
    counts = np.bincount(np.searchsorted(edges, x, side="right"), minlength=edges.size + 1)
    add().histogram.CopyFrom(pb.Histogram(edges=edges.tolist(), counts=counts.tolist()))
    return s


def build(layers: int) -> tuple[CollectorRegistry, SnapshotStore]:
    """A registry with health metrics and ``layers`` fully tapped layers."""
    rng = np.random.default_rng(0)
    registry = CollectorRegistry()
    ServerMetrics(registry, "bench", cuda=False)
    store = SnapshotStore()
    registry.register(ActivationCollector(store.snapshot, "bench", max_layers=layers))
    for i in range(layers):
        layer = f"blocks.{i}.mlp"
        edges = np.sort(rng.normal(size=19)) + i * 1e-3  # per-layer edges, as frozen baselines give
        store.update_from_summary("bench", _summary(layer, rng, edges))
        store.set_drift(
            "bench", layer, "output",
            DriftScore(*rng.random(4).tolist(), thresholds=DriftThresholds(), channel_drift_fraction=0.1),
        )
    return registry, store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()

    registry, _ = build(args.layers)
    base_registry, _ = build(0)
    text = generate_latest(registry).decode()
    base_text = generate_latest(base_registry).decode()

    def series(t: str) -> int:
        return sum(1 for line in t.splitlines() if line and not line.startswith("#"))

    assert render_latest(registry) == generate_latest(registry)  # same bytes, faster
    server, port = start_metrics_server(registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"

    def http() -> None:
        with urllib.request.urlopen(url, timeout=10) as r:
            r.read()

    variants = {"render_latest (served)": lambda: render_latest(registry),
                "generate_latest": lambda: generate_latest(registry),
                "HTTP GET /metrics": http}
    times: dict[str, list[float]] = {k: [] for k in variants}
    curl = shutil.which("curl")
    if curl:
        # A scraper in another process (as Prometheus is): curl's own timer,
        # without its start-up, and no GIL shared with the server.
        times["HTTP GET, curl process"] = []
    try:
        for _ in range(5):  # warm caches (label strings, le strings)
            for fn in variants.values():
                fn()
        for _ in range(args.reps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
            if curl:
                out = subprocess.run([curl, "-s", "-o", "/dev/null", "-w", "%{time_total}", url],
                                     capture_output=True, text=True, check=True).stdout
                times["HTTP GET, curl process"].append(float(out) * 1e3)
    finally:
        stop_metrics_server(server)
    per_layer = (series(text) - series(base_text)) / max(args.layers, 1)
    print(f"layers={args.layers} series_total={series(text)} bytes={len(text)} reps={args.reps}")
    print(f"series per tapped layer: {per_layer:g}")
    for name, ts in times.items():
        ts.sort()
        p90 = ts[int(0.9 * (len(ts) - 1))]
        print(f"{name:24s} ms: median={statistics.median(ts):7.2f} p90={p90:7.2f} min={ts[0]:7.2f}")

if __name__ == "__main__":
    main()
