"""Time one ``/metrics`` scrape with N tapped layers carrying every series, every layer updated between scrapes.

Each layer gets moments, min/max, abs_max, zero_fraction, 7 quantiles,
non-finite counts, a 20-bin histogram on baseline-style edges, drift scores
with thresholds and a channel drift fraction; the server's health metrics are
registered too. Before every timed call, untimed, every layer gets a fresh
summary (new values, new timestamp, more histogram counts) and fresh drift
scores, as under steady traffic: cached text of unchanged layers cannot help.

Two registries are timed side by side: one whose histogram counters are young
(below 1e6, written as ``123.0``) and one in steady state (counts ~1e8, which
the text format writes in Go's exponent form, ``1.2345678e+08``, the slower
path). Times, interleaved (A B C A B C ...):

* ``render_latest`` / ``render_openmetrics``: what ``/metrics`` serves;
* ``generate_latest`` of prometheus-client, text and OpenMetrics (same bytes);
* a real HTTP GET of ``/metrics`` on loopback, both formats (``Accept`` header),
  plus curl in another process when installed,

and prints median/p90/min in ms plus the series one tapped layer costs.

    python benchmarks/scrape.py [--layers 200] [--reps 100]
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.endpoint import start_metrics_server, stop_metrics_server
from layertap.server.export.exposition import render_latest, render_openmetrics
from layertap.server.export.health import ServerMetrics
from layertap.server.export.snapshots import SnapshotStore
from layertap.server.host.allocator import tune_malloc
from layertap.v1 import telemetry_pb2 as pb

PROBS = [0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99]
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
#: Distinct summaries per layer, cycled: every update changes every value.
POOL = 8


def _summary(layer: str, rng: np.random.Generator, edges: np.ndarray, scale: int) -> pb.Summary:
    s = pb.Summary(tap="bench", layer=layer, point=pb.POINT_OUTPUT)
    x = rng.normal(size=4096).astype(np.float32).astype(np.float64)  # float32 activations, as served
    add = s.results.add
    add().moments.CopyFrom(pb.Moments(count=x.size, mean=float(x.mean()), std=float(x.std())))
    add().minmax.CopyFrom(pb.MinMax(min=float(x.min()), max=float(x.max())))
    add().abs_max.value = float(np.abs(x).max())
    add().zero_fraction.fraction = float(rng.random() * 1e-3)
    add().nonfinite.CopyFrom(pb.Nonfinite(nan_count=0, inf_count=0))
    add().quantiles.CopyFrom(pb.Quantiles(probabilities=PROBS, values=np.quantile(x, PROBS).tolist()))
    counts = np.bincount(np.searchsorted(edges, x, side="right"), minlength=edges.size + 1) * scale
    add().histogram.CopyFrom(pb.Histogram(edges=edges.tolist(), counts=counts.tolist()))
    return s


class Bench:
    """A registry with health metrics and ``layers`` fully tapped layers, and a way to update them all."""

    def __init__(self, layers: int, seed_counts: int = 0) -> None:
        rng = np.random.default_rng(0)
        self.registry = CollectorRegistry()
        ServerMetrics(self.registry, "bench", cuda=False)
        self.store = SnapshotStore()
        self.registry.register(ActivationCollector(self.store.snapshot, "bench", max_layers=layers))
        self._rng = rng
        self._pools: list[list[pb.Summary]] = []
        for i in range(layers):
            layer = f"blocks.{i}.mlp"
            edges = np.sort(rng.normal(size=19)) + i * 1e-3  # per-layer edges, as frozen baselines give
            if seed_counts:  # counters that have run for a while
                self.store.update_from_summary("bench", _summary(layer, rng, edges, seed_counts))
            self._pools.append([_summary(layer, rng, edges, 1) for _ in range(POOL)])
        self._round = itertools.count()
        self.update()

    def update(self) -> None:
        """A new summary (values, timestamp, histogram counts) and new drift scores for every layer."""
        r = next(self._round)
        now = time.time()
        scores = self._rng.random((len(self._pools), 4)).tolist()
        for pool, sc in zip(self._pools, scores):
            s = pool[r % POOL]
            s.wall_time.FromNanoseconds(int(now * 1e9))
            self.store.update_from_summary("bench", s)
            self.store.set_drift("bench", s.layer, "output",
                                 DriftScore(*sc, thresholds=DriftThresholds(), channel_drift_fraction=sc[0] / 2))


def series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--malloc-tuning", action="store_true",
                    help="tune glibc malloc as `layertap serve --malloc-tuning` does (host.allocator)")
    args = ap.parse_args()
    malloc = (tune_malloc() or "on") if args.malloc_tuning else "off"  # as `layertap serve --malloc-tuning`

    young, steady = Bench(args.layers), Bench(args.layers, seed_counts=50_000)
    text = generate_latest(young.registry).decode()
    base_text = generate_latest(Bench(0).registry).decode()
    for b in (young, steady):  # same bytes, faster
        assert render_latest(b.registry) == generate_latest(b.registry)
        assert render_openmetrics(b.registry) == generate_openmetrics(b.registry)
    assert 'le="+Inf",' in (big := render_latest(steady.registry).decode()) and "e+08\n" in big  # Go's exponent form

    server, port = start_metrics_server(young.registry, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"

    def http(accept: str | None) -> Callable[[], object]:
        req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})

        def get() -> bytes:
            with urllib.request.urlopen(req, timeout=10) as r:
                return bytes(r.read())
        return get

    def curl() -> float:
        out = subprocess.run([curl_exe or "curl", "-s", "-o", "/dev/null", "-w", "%{time_total}", url],
                             capture_output=True, text=True, check=True).stdout
        return float(out) * 1e3

    variants: dict[str, tuple[Bench, Callable[[], object]]] = {
        "render_latest": (young, lambda: render_latest(young.registry)),
        "render_openmetrics": (young, lambda: render_openmetrics(young.registry)),
        "render_latest, steady": (steady, lambda: render_latest(steady.registry)),
        "render_openmetrics, steady": (steady, lambda: render_openmetrics(steady.registry)),
        "generate_latest": (young, lambda: generate_latest(young.registry)),
        "openmetrics generate_latest": (young, lambda: generate_openmetrics(young.registry)),
        "HTTP GET text": (young, http(None)),
        "HTTP GET openmetrics": (young, http(OPENMETRICS)),
    }
    curl_exe = shutil.which("curl")
    if curl_exe:
        # A scraper in another process (as Prometheus is): curl's own timer,
        # without its start-up, and no GIL shared with the server.
        variants["curl process, text"] = (young, curl)
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(3):  # warm caches (label strings, le strings, templates)
            for b, fn in variants.values():
                b.update()
                fn()
        for _ in range(args.reps):
            for name, (b, fn) in variants.items():
                b.update()  # untimed: every layer changes before every timed call
                t0 = time.perf_counter()
                own = fn()
                t = (time.perf_counter() - t0) * 1e3
                times[name].append(own if isinstance(own, float) else t)
    finally:
        stop_metrics_server(server)
    per_layer = (series(text) - series(base_text)) / max(args.layers, 1)
    print(f"layers={args.layers} series_total={series(text)} bytes={len(text)} reps={args.reps} malloc tuning={malloc}")
    print(f"series per tapped layer: {per_layer:g}; every layer updated before every timed call")
    for name, ts in times.items():
        ts.sort()
        p90 = ts[int(0.9 * (len(ts) - 1))]
        print(f"{name:28s} ms: median={statistics.median(ts):7.2f} p90={p90:7.2f} min={ts[0]:7.2f}")


if __name__ == "__main__":
    main()
