"""The whole metrics path against a real Prometheus: drift, the dashboard, health, promtool.

A Perturbable model is served with metrics on a free port; a real
``prometheus`` scrapes it every second. A drift baseline is frozen from
in-distribution traffic, then ``layer3``'s weights are scaled in place. Every
assertion goes through Prometheus's HTTP API, so label sets, PromQL matching
and the dashboard's queries are checked as Grafana would run them.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pytest
from support.dashboard import dashboard_exprs, dashboard_targets
from support.e2e import wait_for
from support.models import Perturbable, perturbable_loaded
from support.prom import ALERTS, JOB, PrometheusServer, prometheus_binary, sample_value

import layertap

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]

MODEL = "perturbable"
LAYERS = ["layer1", "layer2", "layer3", "layer4"]
METRICS = ("psi", "js", "wasserstein", "mean_shift")
#: Stands in for Grafana's $__rate_interval: many 1 s scrapes, short test.
RATE_INTERVAL = "20s"


class Traffic:
    """Live in-distribution traffic, N(0, 1) batches of 256 at ~``rate`` passes/s, on a thread."""

    def __init__(self, address: str, rate: float = 25.0, batch: int = 256) -> None:
        self.address, self.period, self.batch = address, 1.0 / rate, batch
        self.passes = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _run(self) -> None:
        rng = np.random.default_rng(0)
        try:
            with layertap.Client(self.address) as client:
                while not self._stop.is_set():
                    client.infer(rng.standard_normal((self.batch, 16)).astype(np.float32), timeout=30)
                    self.passes += 1
                    self._stop.wait(self.period)
        except BaseException as exc:  # noqa: BLE001 - reported by check()/stop()
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"traffic thread failed: {self.error!r}") from self.error

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(30)
        if et is None:
            self.check()


def rows_by(rows: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"].get(k, "") for k in labels): sample_value(r) for r in rows}


def test_drift_dashboard_and_health_through_real_prometheus(make_server, tmp_path: Path) -> None:
    prometheus_binary()  # skip before starting anything when it is not installed
    srv = make_server(perturbable_loaded(MODEL), metrics_port=0,
                      baseline_dir=str(tmp_path / "baselines"), drift_window=10)
    model = srv.state.host.module
    assert isinstance(model, Perturbable)
    addr = f"127.0.0.1:{srv.port}"
    with layertap.Client(addr) as client, Traffic(addr) as traffic, \
            PrometheusServer(tmp_path / "prom", f"127.0.0.1:{srv.metrics_port}", rule_files=[ALERTS]) as prom:
        prom.wait_for(prom.targets_up, what="the first successful scrape")
        # Twenty passes cannot calibrate: a given threshold makes the alarm fixed (the four scores).
        info = client.set_baseline("layer*", passes=20, window=10, thresholds={"psi": 0.2})
        assert info.layers == LAYERS
        tap = info.tap
        assert wait_for(lambda: all(d.state == "ready" for d in client.drift()), timeout=30), client.drift()
        traffic.check()

        # Before any perturbation: every layer is scored, all under threshold.
        # `<=` proves the drift and threshold label sets match one-to-one (an
        # empty `>` alone could just mean they never match).
        under = f'layertap_activation_drift{{model="{MODEL}"}} <= layertap_activation_drift_threshold'
        rows = prom.wait_for(lambda: (r := prom.query(under)) and len(r) == 16 and r,
                             what="16 drift scores under threshold (4 layers x 4 metrics)")
        assert set(rows_by(rows, "layer", "metric")) == {(lay, m) for lay in LAYERS for m in METRICS}
        assert {r["metric"]["tap"] for r in rows} == {tap}
        assert {r["metric"]["phase"] for r in rows} == {"forward"}  # Infer passes: plain forwards

        perturbed_at = time.time()
        with srv.state.host.pass_lock():
            model.perturb_layer3(scale=3.0, shift=1.0)

        # layer3 and the layer after it cross their thresholds; the series
        # carry the labels the alert rule and the dashboard group by.
        def crossing(layer: str) -> list[dict[str, Any]]:
            return prom.query(f'layertap_activation_drift{{model="{MODEL}", layer="{layer}"}}'
                              " > layertap_activation_drift_threshold")

        for layer in ("layer3", "layer4"):
            over = prom.wait_for(lambda: crossing(layer), timeout=30, what=f"{layer} drift above threshold")
            for r in over:
                assert r["metric"]["layer"] == layer and r["metric"]["tap"] == tap
                assert r["metric"]["point"] == "output" and r["metric"]["metric"] in METRICS
                assert r["metric"]["job"] == JOB and r["metric"]["model"] == MODEL
        # All four scores of layer3 cross once its window holds only perturbed passes.
        full = prom.wait_for(lambda: len(r := crossing("layer3")) == 4 and r, timeout=30,
                             what="all four layer3 scores above threshold")
        assert {r["metric"]["metric"] for r in full} == set(METRICS)
        # The rule in deploy/prometheus/alerts.yml, loaded by this Prometheus, fires on the alarm series.
        firing = prom.wait_for(
            lambda: prom.query('ALERTS{alertname="LayertapActivationDrift", layer="layer3"}'),
            timeout=15, what="LayertapActivationDrift pending for layer3")
        assert firing[0]["metric"]["alertstate"] in ("pending", "firing")
        # Per-channel stats are tapped (2-D outputs), so the channel fraction is exported.
        frac = rows_by(prom.query(f'layertap_activation_channel_drift_fraction{{model="{MODEL}"}}'), "layer")
        assert set(frac) == {(lay,) for lay in LAYERS}
        assert frac[("layer3",)] > 0.2 and frac[("layer1",)] == 0.0

        # layer1 sits upstream of the perturbation: under every threshold, now
        # and at every 1 s step since the perturbation.
        layer1_under = prom.query(f'layertap_activation_drift{{model="{MODEL}", layer="layer1"}}'
                                  " <= layertap_activation_drift_threshold")
        assert {r["metric"]["metric"] for r in layer1_under} == set(METRICS)
        since = max(2, int(time.time() - perturbed_at))
        worst = prom.query(f'max_over_time((layertap_activation_drift{{model="{MODEL}", layer="layer1"}}'
                           f" / layertap_activation_drift_threshold)[{since}s:1s])")
        assert len(worst) == 4 and all(sample_value(r) < 1.0 for r in worst), worst

        # Every dashboard query returns data for real values of $model and $layer.
        # Rates need a few scrapes of the frozen histogram and the counters.
        exprs = dashboard_exprs(values={"model": MODEL, "layer": "layer3", "phase": "forward", "tap": tap},
                                rate_interval=RATE_INTERVAL)
        raw = [e for _, e in dashboard_targets()]
        assert len(exprs) >= 10 and not any("vector(" in e for e in raw), raw
        results: dict[str, list[dict[str, Any]]] = {}

        def all_dashboard_queries_answer() -> bool:
            for e in exprs:
                results[e] = prom.query(e)
            return all(results.values())

        if not wait_for(all_dashboard_queries_answer, timeout=30):
            empty = [e for e in exprs if not results[e]]
            pytest.fail(f"dashboard queries with no result: {empty}")
        for e, got in results.items():
            if "layertap_activation_" not in e:
                continue
            layers = {r["metric"].get("layer") for r in got}
            if 'layer=~"layer3"' in e:
                assert layers == {"layer3"}, (e, got)
            else:  # panels over all layers (drifting count, status history, NaN rate, staleness)
                assert None not in layers and "layer3" in layers, (e, got)
        # Panels of score / threshold per layer (the status history) read > 1 only where drifted.
        ratios = [e for e in exprs if "layertap_activation_drift_ratio" in e and "by (layer)" in e]
        assert ratios, exprs
        for e in ratios:
            status = rows_by(results[e], "layer")
            assert status[("layer3",)] > 1.0 and status[("layer1",)] < 1.0, (e, status)

        # The server's own health series.
        health = {
            f'layertap_inference_requests_total{{model="{MODEL}", status="OK"}}': lambda v: v > 20,
            f'layertap_inference_duration_seconds_count{{model="{MODEL}"}}': lambda v: v > 20,
            f'layertap_inference_duration_seconds_bucket{{model="{MODEL}", le="+Inf"}}': lambda v: v > 20,
            f'layertap_hook_duration_seconds_count{{model="{MODEL}"}}': lambda v: v > 20,
            f'layertap_taps{{model="{MODEL}"}}': lambda v: v == 1,
            f'layertap_subscribers{{model="{MODEL}"}}': lambda v: v == 0,
            f'layertap_stream_dropped_total{{model="{MODEL}"}}': lambda v: v == 0,
            f'layertap_reducer_errors_total{{model="{MODEL}"}}': lambda v: v == 0,
            f'layertap_baseline_load_errors_total{{model="{MODEL}"}}': lambda v: v == 0,
            f'layertap_export_layers_dropped{{model="{MODEL}"}}': lambda v: v == 0,
            f'layertap_build_info{{model="{MODEL}"}}': lambda v: v == 1,
            f'sum(layertap_activation_nonfinite_total{{model="{MODEL}"}})': lambda v: v == 0,
        }
        for expr, ok in health.items():
            got = prom.query(expr)
            assert len(got) == 1 and ok(sample_value(got[0])), (expr, got)
        build = prom.query("layertap_build_info")[0]["metric"]
        assert build["version"] and build["torch_version"]
        # Only the durable baseline tap is exported: one tap label on every activation series.
        taps = prom.query('count by (tap) ({__name__=~"layertap_activation_.*"})')
        assert [r["metric"]["tap"] for r in taps] == [tap]
    assert len(list((tmp_path / "baselines").glob("*.json"))) == len(LAYERS)  # saved as they froze


def test_promtool_accepts_live_scrape_with_taps_baseline_and_drift(make_server, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (CI installs Debian's prometheus package)")
    srv = make_server(perturbable_loaded(MODEL), metrics_port=0,
                      baseline_dir=str(tmp_path / "baselines"), drift_window=5)
    model = srv.state.host.module
    x = np.random.default_rng(3).standard_normal((64, 16)).astype(np.float32)
    with layertap.Client(f"127.0.0.1:{srv.port}") as client:
        # Every reducer the exporter maps, on a second durable tap, next to the baseline.
        client.create_tap("layer*", reducers=["moments", "minmax", "abs_max", "zero_fraction", "nonfinite", "norm",
                                              "latency", "logits",
                                              {"quantiles": {"probabilities": [0.05, 0.5, 0.95]}},
                                              {"histogram": {"bins": 8, "min": -4, "max": 4}}],
                          name="all-reducers", forever=True)
        client.set_baseline("layer*", passes=5, window=5, thresholds={"psi": 0.2})  # too short to calibrate: fixed
        for _ in range(8):
            client.infer(x)
        # The baseline freezes on the host-transfer thread: perturb only after it has,
        # so that all five perturbed passes fill the drift window.
        assert wait_for(lambda: all(d.state == "ready" for d in client.drift()), timeout=30)
        with srv.state.host.pass_lock():
            model.perturb_layer3()
        for _ in range(5):
            client.infer(x)
        assert srv.state.taps.flush(10)
        assert any(d.drifted for d in client.drift())
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as r:
        text = r.read()
    body = text.decode()
    for name in ("layertap_activation_drift{", "layertap_activation_drift_threshold{",
                 "layertap_activation_channel_drift_fraction{", "layertap_activation_quantile{",
                 "layertap_activation_value_bucket{", "layertap_activation_abs_max{",
                 "layertap_activation_zero_fraction{", "layertap_activation_nonfinite_total{",
                 "layertap_activation_last_update_timestamp_seconds{", "layertap_activation_l2{",
                 "layertap_layer_latency_seconds{", "layertap_logits_entropy_nats{", 'tap="all-reducers"',
                 "layertap_activation_drift_alarm{", "layertap_activation_drift_ratio{"):
        assert name in body, name
    # docs/operations.md's metrics reference lists every family the server exports.
    reference = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    exported = {line.split()[2] for line in body.splitlines()  # not prometheus-client's own *_created twins
                if line.startswith("# TYPE layertap_") and not line.split()[2].endswith("_created")}
    assert len(exported) > 30 and not {f for f in exported if f"`{f}" not in reference}
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert res.returncode == 0, (res.stdout + res.stderr).decode()
    assert not res.stdout.strip() and not res.stderr.strip(), (res.stdout + res.stderr).decode()
