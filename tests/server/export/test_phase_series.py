"""The ``phase`` label: a generation's prefill and decode steps and a plain forward keep series of their own."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from layertap.server.drift.phases import PHASE_NAMES, phase_name
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.exposition import render_latest, render_openmetrics
from layertap.server.export.health import ServerMetrics
from layertap.server.export.snapshots import SnapshotStore
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

EDGES = [-1.0, 0.0, 1.0]
PHASES = {"forward": pb.PHASE_UNSPECIFIED, "prefill": pb.PHASE_PREFILL, "decode": pb.PHASE_DECODE}


def summary(x: np.ndarray, phase: int, *, layer: str = "blocks.0", nan: int = 0, ts: float = 1_700_000_000.0,
            edges: list[list[float]] | None = None) -> pb.Summary:
    """A summary of ``x`` (float64 references: numpy's moments, quantiles and bin counts)."""
    s = pb.Summary(tap="t", layer=layer, point=pb.POINT_OUTPUT, phase=phase)
    s.wall_time.FromNanoseconds(int(ts * 1e9))
    add = s.results.add
    add().moments.CopyFrom(pb.Moments(count=x.size, mean=float(x.mean()), std=float(x.std())))
    add().minmax.CopyFrom(pb.MinMax(min=float(x.min()), max=float(x.max())))
    add().nonfinite.CopyFrom(pb.Nonfinite(nan_count=nan))
    add().quantiles.CopyFrom(pb.Quantiles(probabilities=[0.5], values=[float(np.quantile(x, 0.5))]))
    for e in edges or [EDGES]:
        counts = np.bincount(np.searchsorted(e, x, side="right"), minlength=len(e) + 1)
        add().histogram.CopyFrom(pb.Histogram(edges=e, counts=counts.tolist()))
    return s


@pytest.fixture
def rig() -> tuple[CollectorRegistry, SnapshotStore]:
    registry = CollectorRegistry()
    ServerMetrics(registry, "m", version="0.1.0", torch_version="2.x", cuda=False)
    store = SnapshotStore()
    registry.register(ActivationCollector(store.snapshot, "m", max_layers=10))
    return registry, store


def labels(phase: str, **extra: str) -> dict[str, str]:
    return {"model": "m", "layer": "blocks.0", "point": "output", "tap": "t", "phase": phase, **extra}


def test_phase_names_cover_the_proto_enum() -> None:
    assert {v: phase_name(v) for v in pb.Phase.values()} == {0: "forward", 1: "prefill", 2: "decode"}
    assert set(PHASE_NAMES) == set(pb.Phase.values())
    assert phase_name(9) == "phase_9"  # a newer peer's value: bounded and readable


def test_each_phase_keeps_its_own_series(rig) -> None:
    registry, store = rig
    rng = np.random.default_rng(0)
    # A prompt's hidden states, a decode step's (one token) and an Infer pass's: different distributions.
    data = {"forward": rng.normal(0.0, 1.0, 4096), "prefill": rng.normal(2.0, 0.5, 8192),
            "decode": rng.normal(-3.0, 2.0, 64)}
    nans = {"forward": 1, "prefill": 0, "decode": 4}
    for name, x in data.items():
        store.update_from_summary("t", summary(x, PHASES[name], nan=nans[name], ts=1_700_000_000.0 + PHASES[name]))
    # A second decode step adds to decode's counters only.
    x2 = rng.normal(-3.0, 2.0, 64)
    store.update_from_summary("t", summary(x2, pb.PHASE_DECODE, nan=2, ts=1_700_000_010.0))
    g = registry.get_sample_value
    for name, x in data.items():
        latest = x2 if name == "decode" else x
        assert g("layertap_activation_mean", labels(name)) == pytest.approx(float(latest.mean()), rel=1e-12)
        assert g("layertap_activation_std", labels(name)) == pytest.approx(float(latest.std()), rel=1e-12)
        assert g("layertap_activation_quantile", labels(name, q="0.5")) == float(np.quantile(latest, 0.5))
    assert g("layertap_activation_nonfinite_total", labels("decode", kind="nan")) == 6.0
    assert g("layertap_activation_nonfinite_total", labels("prefill", kind="nan")) == 0.0
    assert g("layertap_activation_nonfinite_total", labels("forward", kind="nan")) == 1.0
    # Histogram counters: cumulative per phase, against numpy's bin counts of every pass of that phase.
    decode_all = np.concatenate([data["decode"], x2])
    want = np.cumsum(np.bincount(np.searchsorted(EDGES, decode_all, side="right"), minlength=4))
    got = [g("layertap_activation_value_bucket", labels("decode", le=le)) for le in ("-1.0", "0.0", "1.0", "+Inf")]
    assert got == want.astype(float).tolist()
    assert g("layertap_activation_value_bucket", labels("forward", le="+Inf")) == 4096.0
    assert g("layertap_activation_last_update_timestamp_seconds", labels("decode")) == 1_700_000_010.0
    assert g("layertap_activation_last_update_timestamp_seconds", labels("forward")) == 1_700_000_000.0
    # No series without a phase: every activation sample carries one of the three.
    text = render_latest(registry).decode()
    phases = {s.labels.get("phase") for f in text_string_to_metric_families(text)
              if f.name.startswith("layertap_activation_") for s in f.samples}
    assert phases == {"forward", "prefill", "decode"}


def test_drift_joins_its_own_phase_and_renders_as_prometheus_client(rig) -> None:
    registry, store = rig
    rng = np.random.default_rng(1)
    for phase in (pb.PHASE_PREFILL, pb.PHASE_DECODE, pb.PHASE_UNSPECIFIED):
        store.update_from_summary("t", summary(rng.normal(size=256), phase))
    decode_th = DriftThresholds(psi=0.3)
    store.set_drift("t", "blocks.0", "output", DriftScore(0.9, 0.05, 0.01, 0.2, decode_th), phase="decode")
    store.set_drift("t", "blocks.0", "output", DriftScore(0.01, 0.01, 0.01, 0.1, DriftThresholds()), phase="prefill")
    g = registry.get_sample_value
    assert g("layertap_activation_drift", labels("decode", metric="psi")) == 0.9
    assert g("layertap_activation_drift_threshold", labels("decode", metric="psi")) == 0.3
    assert g("layertap_activation_drift", labels("prefill", metric="psi")) == 0.01
    assert g("layertap_activation_drift_threshold", labels("prefill", metric="psi")) == 0.2
    assert g("layertap_activation_drift", labels("forward", metric="psi")) is None  # no forward baseline
    # The fast writers still write prometheus-client's bytes, both formats, phase label in sorted place.
    text = render_latest(registry)
    assert text == generate_latest(registry)
    assert render_openmetrics(registry) == generate_openmetrics(registry)
    assert b'layertap_activation_drift{layer="blocks.0",metric="psi",model="m",phase="decode",point="output",tap="t"} 0.9' \
        in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (CI installs it)")
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_summary_with_a_histogram_per_phase_counts_its_first(rig) -> None:
    """A baseline tap scoring several phases runs one histogram per phase's edges: the series
    keeps one counter (the first histogram), never restarting on every summary."""
    registry, store = rig
    rng = np.random.default_rng(2)
    other = [-5.0, 5.0]
    xs = [rng.normal(size=512) for _ in range(3)]
    for x in xs:
        store.update_from_summary("t", summary(x, pb.PHASE_DECODE, edges=[EDGES, other]))
    total = np.concatenate(xs)
    want = np.cumsum(np.bincount(np.searchsorted(EDGES, total, side="right"), minlength=4)).astype(float).tolist()
    g = registry.get_sample_value
    assert [g("layertap_activation_value_bucket", labels("decode", le=le))
            for le in ("-1.0", "0.0", "1.0", "+Inf")] == want
    assert g("layertap_activation_value_bucket", labels("decode", le="-5.0")) is None


def test_the_layer_cap_counts_each_phase(rig) -> None:
    registry = CollectorRegistry()
    store = SnapshotStore()
    registry.register(ActivationCollector(store.snapshot, "m", max_layers=2))
    x = np.linspace(-1, 1, 64)
    for phase in (pb.PHASE_PREFILL, pb.PHASE_DECODE, pb.PHASE_UNSPECIFIED):
        store.update_from_summary("t", summary(x, phase))
    text = render_latest(registry).decode()
    fam = {f.name: f.samples for f in text_string_to_metric_families(text)}
    assert {s.labels["phase"] for s in fam["layertap_activation_mean"]} == {"prefill", "decode"}  # first come
    assert registry.get_sample_value("layertap_export_layers_dropped", {"model": "m"}) == 1.0
