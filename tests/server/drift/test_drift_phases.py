"""Drift per phase, in process: one baseline per phase seen, each window scored against its own phase's baseline.

Passes run under ``host.pass_context(phase=...)``, as the Generate step loop
runs them. ``PhaseStamp`` copies the pass's phase onto its summaries in
case the publisher does not yet (it is a no-op once it does).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from layertap.server.drift.monitor import DriftMonitor
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.health import ServerMetrics
from layertap.server.export.sink import MetricsSink
from layertap.server.export.snapshots import SnapshotStore
from layertap.server.host.model_host import PHASE_DECODE, PHASE_NONE, PHASE_PREFILL, ModelHost, PassContext
from layertap.server.host.sources import load_model
from layertap.server.stream.broker import Broker
from layertap.server.stream.sinks import Sink
from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

PHASES = {"forward": PHASE_NONE, "prefill": PHASE_PREFILL, "decode": PHASE_DECODE}
LAYERS = ["layer1", "layer2", "layer3", "layer4"]


class PhaseStamp(Sink):
    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        for s in summaries:
            s.phase = ctx.phase


@dataclass
class Rig:
    host: ModelHost
    engine: TapEngine
    monitor: DriftMonitor
    store: SnapshotStore
    registry: CollectorRegistry
    #: (layer, phase) -> the latest score the monitor handed to the metrics store.
    scores: dict[tuple[str, str], DriftScore | None] = field(default_factory=dict)
    #: phase -> layer1's outputs of every pass of that phase, float64.
    seen: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def run(self, phase: str, n: int, *, batch: int, scale: float, shift: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            x = torch.randn(batch, 3, 32, 32, generator=g) * scale + shift
            with torch.inference_mode(), self.host.pass_context(phase=PHASES[phase]):
                self.host.module(x)
            # Pass by pass: a plan switched by the host-transfer thread (a phase that starts or
            # freezes) lands between two passes; unflushed, the model thread would run ahead of it.
            assert self.engine.flush(10)

    def drifted(self, phase: str) -> set[str]:
        return {layer for (layer, ph), s in self.scores.items() if ph == phase and s is not None and s.drifted}


#: Each phase's own distribution: a generation's decode steps look nothing like a prompt or an Infer batch.
DIST = {"forward": {"batch": 4, "scale": 1.0, "shift": 0.0},
        "prefill": {"batch": 8, "scale": 2.0, "shift": 1.0},
        "decode": {"batch": 1, "scale": 0.5, "shift": -1.0}}


def make_rig(baseline_dir: Path) -> Iterator[Rig]:
    host = ModelHost(load_model("demo"))
    host.warm_up()
    engine = TapEngine(host, Broker())
    engine.sinks.add(PhaseStamp())
    store = SnapshotStore()
    registry = CollectorRegistry()
    registry.register(ActivationCollector(store.snapshot, "demo"))
    engine.sinks.add(MetricsSink(ServerMetrics(registry, "demo", cuda=False), store, engine.is_durable))
    rig: Rig

    def on_score(tap: str, layer: str, point: str, score: DriftScore | None, thresholds: DriftThresholds,
                 *, phase: str) -> None:
        rig.scores[layer, phase] = score
        store.set_drift(tap, layer, point, score, thresholds, phase=phase)

    monitor = engine.sinks.add(DriftMonitor(engine, on_score=on_score, baseline_dir=str(baseline_dir),
                                            default_window=4))
    rig = Rig(host, engine, monitor, store, registry)

    def keep(_m: Any, _i: Any, out: torch.Tensor) -> None:
        ctx = host._current
        if ctx is not None:
            rig.seen.setdefault(ctx.phase, []).append(out.detach().double().numpy().ravel())

    handle = host.module.layer1.register_forward_hook(keep)
    try:
        yield rig
    finally:
        handle.remove()
        engine.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from make_rig(tmp_path / "baselines")


def reducer_names(rig: Rig, tap: str, layer: str) -> list[str]:
    return [r.name for r in rig.engine.get(tap).layer_plans[layer].reducers]


def test_each_phase_freezes_its_own_baseline_and_is_scored_only_against_it(rig: Rig) -> None:
    # Four passes are too few to calibrate: fixed thresholds (the defaults, given) decide the alarm.
    tap, layers = rig.monitor.set_baseline(pb.SetBaselineRequest(selector="layer*", passes=4, window=4,
                                                                 thresholds=pb.DriftThresholds(psi=0.2)))
    assert layers == LAYERS
    rig.run("forward", 4, **DIST["forward"], seed=0)
    assert all(d.state == pb.BASELINE_STATE_READY for d in rig.monitor.drift())
    assert "quantiles" not in reducer_names(rig, tap, "layer1")  # forward alone: exactly the plan before phases
    # Decode steps arrive: against the forward baseline they would drift (mean -1 in 0.5 sigma); they
    # start a decode baseline instead and are never scored against forward's. The first decode pass
    # found no phase of the layer collecting (no quantiles in its plan), so it only starts the entry.
    rig.seen.clear()
    rig.run("decode", 2, **DIST["decode"], seed=1)
    names = reducer_names(rig, tap, "layer1")
    assert "quantiles" in names and names.count("histogram") == 1  # forward's edges, and decode collecting
    assert rig.scores["layer1", "decode"] is None  # exported: thresholds only, while collecting
    rig.run("decode", 3, **DIST["decode"], seed=2)
    rig.run("prefill", 5, **DIST["prefill"], seed=3)  # likewise: decode froze, nothing collected any more
    drift = rig.monitor.drift()
    assert len(drift) == 3 * len(LAYERS) and {d.state for d in drift} == {pb.BASELINE_STATE_READY}
    names = reducer_names(rig, tap, "layer1")
    assert "quantiles" not in names and names.count("histogram") == 3  # one per phase's edges
    # Each baseline holds exactly its own phase's passes (all but the first): count, float64 mean and
    # std of layer1's outputs.
    for phase in ("decode", "prefill"):
        b = rig.monitor.baseline_for("layer1", "output", phase)
        assert b is not None and b.phase == phase
        assert len(rig.seen[PHASES[phase]]) == 5
        ref = np.concatenate(rig.seen[PHASES[phase]][1:])
        assert b.count == ref.size and b.passes == 4
        assert b.mean == pytest.approx(float(ref.mean()), rel=1e-9, abs=1e-12)
        assert b.std == pytest.approx(float(ref.std()), rel=1e-9)
    assert not np.array_equal(rig.monitor.baseline_for("layer1", "output", "decode").edges,  # type: ignore[union-attr]
                              rig.monitor.baseline_for("layer1", "output", "prefill").edges)  # type: ignore[union-attr]

    # Steady traffic in every phase, interleaved as a server serving Infer and Generate sees it: calm.
    for i in range(4):
        for phase in ("forward", "prefill", "decode"):
            rig.run(phase, 1, **DIST[phase], seed=10 + i)
    for phase in ("forward", "prefill", "decode"):
        assert all(rig.scores[layer, phase] is not None for layer in LAYERS), phase
        assert rig.drifted(phase) == set(), (phase, {k: v for k, v in rig.scores.items() if k[1] == phase})

    # Only decode shifts: decode drifts, forward and prefill do not.
    for i in range(4):
        rig.run("decode", 1, **{**DIST["decode"], "shift": 1.0}, seed=20 + i)
        rig.run("prefill", 1, **DIST["prefill"], seed=30 + i)
    assert "layer1" in rig.drifted("decode")
    score = rig.scores["layer1", "decode"]
    assert score is not None and score.mean_shift > 1.0
    assert rig.drifted("prefill") == set() and rig.drifted("forward") == set()

    # The metrics store gets each phase's scores on its own series, so drift > threshold joins per phase.
    g = rig.registry.get_sample_value

    def lab(phase: str, **extra: str) -> dict[str, str]:
        return {"model": "demo", "layer": "layer1", "point": "output", "tap": tap, "phase": phase, **extra}

    assert g("layertap_activation_drift", lab("decode", metric="mean_shift")) == score.mean_shift
    assert g("layertap_activation_drift", lab("decode", metric="mean_shift")) > \
        g("layertap_activation_drift_threshold", lab("decode", metric="mean_shift"))
    assert g("layertap_activation_drift", lab("prefill", metric="mean_shift")) < \
        g("layertap_activation_drift_threshold", lab("prefill", metric="mean_shift"))
    last_decode = rig.seen[PHASE_DECODE][-1]
    assert g("layertap_activation_mean", lab("decode")) == pytest.approx(float(last_decode.mean()), rel=1e-9, abs=1e-12)


def test_phase_baselines_survive_a_restart(tmp_path: Path) -> None:
    baselines = tmp_path / "baselines"
    first = make_rig(baselines)
    rig = next(first)
    try:
        # Three passes cannot calibrate: fixed thresholds, which the files keep.
        tap, _ = rig.monitor.set_baseline(pb.SetBaselineRequest(selector="layer1", passes=3, window=4,
                                                                thresholds=pb.DriftThresholds(psi=0.2)))
        # Interleaved, as a server serving Infer and Generate sees them: while forward collects, the
        # others' first passes carry quantiles too, so all three freeze after exactly 3 passes.
        for i in range(3):
            for phase in ("forward", "prefill", "decode"):
                rig.run(phase, 1, **DIST[phase], seed=10 * PHASES[phase] + i)
        assert {d.baseline_passes for d in rig.monitor.drift()} == {3}
        frozen = {ph: rig.monitor.baseline_for("layer1", "output", ph) for ph in PHASES}
        assert all(b is not None for b in frozen.values())
    finally:
        first.close()
    files = sorted(baselines.glob("*.json"))
    assert len(files) == 3
    versions = sorted(json.loads(p.read_text())["version"] for p in files)
    assert versions == [3, 3, 3]  # frozen now, every phase carries its null statistics: v3

    second = make_rig(baselines)
    rig = next(second)
    try:
        assert rig.monitor.load() == 3
        for ph, b in frozen.items():
            got = rig.monitor.baseline_for("layer1", "output", ph)
            assert got is not None and b is not None and got.mean == b.mean and np.array_equal(got.edges, b.edges)
        assert reducer_names(rig, tap, "layer1").count("histogram") == 3
        for i in range(4):
            rig.run("decode", 1, **{**DIST["decode"], "shift": 1.0}, seed=40 + i)
            rig.run("forward", 1, **DIST["forward"], seed=50 + i)
        assert rig.drifted("decode") == {"layer1"} and rig.drifted("forward") == set()
    finally:
        second.close()


def test_fleet_install_of_a_decode_document_starts_that_phase(tmp_path: Path) -> None:
    """Another replica's frozen decode baseline installs as this tap's decode baseline (its phase travels in the document)."""
    src = make_rig(tmp_path / "a")
    a = next(src)
    try:
        tap, _ = a.monitor.set_baseline(pb.SetBaselineRequest(selector="layer1", name="fleet", passes=3, window=4))
        a.run("decode", 3, **DIST["decode"], seed=0)
        exported = a.monitor.export(tap)
        decode_docs = [m.frozen for m in exported if m.HasField("frozen") and b'"decode"' in m.frozen]
        assert len(decode_docs) == 1
        # The forward builder (collecting, 0 passes) still travels; builders of other phases only with a phase field.
        assert [m.layer for m in exported if m.HasField("builder")] == ["layer1"]
        want = a.monitor.baseline_for("layer1", "output", "decode")
    finally:
        src.close()
    dst = make_rig(tmp_path / "b")
    b = next(dst)
    try:
        b.monitor.set_baseline(pb.SetBaselineRequest(selector="layer1", name="fleet", passes=50, window=4))
        (installed,) = b.monitor.install(pb.InstallBaselineRequest(tap="fleet", frozen=decode_docs))
        assert installed.phase == "decode"
        got = b.monitor.baseline_for("layer1", "output", "decode")
        assert got is not None and want is not None and np.array_equal(got.edges, want.edges)
        assert b.monitor.baseline_for("layer1", "output", "forward") is None  # forward still collects here
        states = sorted(d.state for d in b.monitor.drift())
        assert states == [pb.BASELINE_STATE_COLLECTING, pb.BASELINE_STATE_READY]
        for i in range(4):
            b.run("decode", 1, **DIST["decode"], seed=60 + i)
        assert b.scores["layer1", "decode"] is not None and b.drifted("decode") == set()
    finally:
        dst.close()
