"""Generation self-metrics: batched observations against prometheus-client's own Histogram and numpy, a real scrape, promtool."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from layertap.server.export.endpoint import start_metrics_server, stop_metrics_server
from layertap.server.export.exposition import render_latest, render_openmetrics
from layertap.server.export.generation import INTER_TOKEN_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS, GenerationMetrics, StepHistogram
from layertap.server.export.health import ServerMetrics

pytestmark = pytest.mark.unit

M = {"model": "m"}
ITL = "layertap_generate_inter_token_seconds"
TTFT = "layertap_generate_time_to_first_token_seconds"


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    """``(sample name, le)`` -> value of one histogram family, ``_created`` left out."""
    text = render_latest(registry).decode()
    fam = {f.name: f for f in text_string_to_metric_families(text)}[name]
    return {(s.name, s.labels.get("le", "")): s.value for s in fam.samples if not s.name.endswith("_created")}


def test_a_batched_step_equals_its_tokens_observed_one_by_one() -> None:
    """inter_token(seconds, count) must export what count calls of Histogram.observe(seconds) export,
    and what numpy's bin counts and float64 sum of the repeated values give."""
    rng = np.random.default_rng(0)
    # Step times across the buckets, exactly on bounds (le is inclusive), above the last, and zero.
    steps = [*np.exp(rng.uniform(np.log(2e-4), np.log(20.0), 300)).tolist(), *INTER_TOKEN_BUCKETS, 0.0, 7.0, 123.0]
    counts = rng.integers(1, 65, len(steps)).tolist()
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    metrics = GenerationMetrics(ours, "m")
    reference = Histogram(ITL, "ref", ["model"], buckets=INTER_TOKEN_BUCKETS, registry=theirs).labels("m")
    for seconds, n in zip(steps, counts):
        metrics.inter_token(seconds, n)
        for _ in range(n):
            reference.observe(seconds)
    got, want = samples(ours, ITL), samples(theirs, ITL)
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k[0] != ITL + "_sum"} == {k: v for k, v in want.items() if k[0] != ITL + "_sum"}
    repeated = np.repeat(np.asarray(steps, dtype=np.float64), counts)
    bounds = np.asarray(INTER_TOKEN_BUCKETS)
    per_bucket = np.bincount(np.searchsorted(bounds, repeated, side="left"), minlength=bounds.size + 1)
    cumulative = np.cumsum(per_bucket)
    for le, c in zip([*INTER_TOKEN_BUCKETS, "+Inf"], cumulative):
        key = (ITL + "_bucket", "+Inf" if le == "+Inf" else str(float(le)))
        assert got[key] == float(c), key
    assert got[ITL + "_count", ""] == float(sum(counts))
    assert got[ITL + "_sum", ""] == pytest.approx(float(repeated.sum()), rel=1e-12)
    assert got[ITL + "_sum", ""] == pytest.approx(want[ITL + "_sum", ""], rel=1e-12)


def test_time_to_first_token_tokens_active_and_cancelled() -> None:
    registry = CollectorRegistry()
    g = GenerationMetrics(registry, "m")
    get = registry.get_sample_value
    # Exported from the start: rate() and the dashboard see zeros, not missing series.
    for name in ("layertap_generate_tokens_total", "layertap_generate_active", "layertap_generate_cancelled_total",
                 TTFT + "_count", ITL + "_count"):
        assert get(name, M) == 0.0, name
    for _ in range(3):
        g.started()
    for ttft in (0.004, 0.05, 0.3):
        g.first_token(ttft)
    g.tokens(3)  # the prefill's first tokens
    g.inter_token(0.02, 3)
    g.tokens(3)
    g.finished(cancelled=False)
    g.inter_token(0.03, 2)
    g.tokens(2)
    g.finished(cancelled=True)
    g.tokens(0)
    g.inter_token(0.5, 0)  # a step that produced nothing records nothing
    g.inter_token(float("nan"), 4)
    g.first_token(-1.0)
    assert get("layertap_generate_active", M) == 1.0
    assert get("layertap_generate_cancelled_total", M) == 1.0
    assert get("layertap_generate_tokens_total", M) == 8.0
    assert get(TTFT + "_count", M) == 3.0
    assert get(TTFT + "_sum", M) == pytest.approx(0.354, rel=1e-12)
    assert get(TTFT + "_bucket", {**M, "le": "0.005"}) == 1.0
    assert get(TTFT + "_bucket", {**M, "le": "0.25"}) == 2.0
    assert get(TTFT + "_bucket", {**M, "le": "+Inf"}) == 3.0
    assert get(ITL + "_count", M) == 5.0 and get(ITL + "_sum", M) == pytest.approx(0.12, rel=1e-12)
    assert get(ITL + "_bucket", {**M, "le": "0.025"}) == 3.0
    assert [b for b in TIME_TO_FIRST_TOKEN_BUCKETS if b < 0.25][-1] == 0.1


def test_buckets_must_increase() -> None:
    for bad in ((), (0.1, 0.1), (0.2, 0.1), (0.1, float("inf"))):
        with pytest.raises(ValueError, match="strictly increasing"):
            StepHistogram("h", "h", "m", bad)
    registry = CollectorRegistry()
    GenerationMetrics(registry, "m")
    with pytest.raises(ValueError, match=f"Duplicated timeseries.*{TTFT}"):  # describe() names the family
        GenerationMetrics(registry, "m")


def test_a_real_scrape_of_a_server_registry_passes_promtool() -> None:
    registry = CollectorRegistry()
    ServerMetrics(registry, "m", version="0.1.0", torch_version="2.x", cuda=False)
    g = GenerationMetrics(registry, "m")
    g.started()
    g.first_token(0.12)
    g.inter_token(0.004, 8)
    g.tokens(9)
    server, port = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read()
    finally:
        stop_metrics_server(server)
    assert text == render_latest(registry)
    fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
    assert fams[TTFT].type == "histogram" and fams[ITL].type == "histogram"
    assert fams["layertap_generate_tokens"].type == "counter" and fams["layertap_generate_active"].type == "gauge"
    values = {(s.name, s.labels.get("le", "")): s.value for f in fams.values() for s in f.samples}
    assert values[ITL + "_bucket", "0.005"] == 8.0 and values["layertap_generate_tokens_total", ""] == 9.0
    assert b"# EOF" in render_openmetrics(registry)  # OpenMetrics writes the families too
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (CI installs it)")
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
