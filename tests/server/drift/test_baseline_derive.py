"""Derived baselines kept (issue 45): schema v4 names the derive, files without one are written as before.

The v1, v2 and v3 documents below are what the server wrote before v4 (``baseline_to_dict`` at the
commit before it, on the same baseline): each still loads, and a baseline without a derive is still
written as exactly that text.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from layertap.server.drift.baseline import Baseline
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.exchange import frozen_from_bytes, frozen_to_bytes
from layertap.server.drift.files import load_baselines, save_baseline
from layertap.server.drift.layer import LayerEntry
from layertap.server.drift.monitor import DriftMonitor
from layertap.server.drift.null import NullModel
from layertap.server.drift.schema import BASELINE_VERSION, BaselineFormatError, baseline_from_dict, baseline_to_dict
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.errors import InvalidField
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import load_model
from layertap.server.reducers.derive import DERIVE_NAMES
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

#: What every version before v4 wrote of the baseline of :func:`make`, in order, after schema and version.
BODY: dict[str, Any] = {
    "tap": "tap-1", "layer": "layer1", "point": "output", "edges": [-1.0, 0.0, 1.0], "counts": [2, 3, 3, 2],
    "count": 10, "mean": 0.0, "m2": 9.5, "min": -2.0, "max": 2.0, "passes": 12,
    "quantiles": [[0.5, 0.0], [0.95, 1.5]], "channel_mean": [0.25, -0.25], "channel_std": [1.0, 0.5], "window": 2,
    "thresholds": {"psi": 0.25, "js": 0.1, "wasserstein": 0.1, "mean_shift": 1.0}, "created_at": 1700000000.5,
}
NULL: dict[str, Any] = {"mean": [0.25, -0.25, 1.0, 0.5, 0.0, 1.0], "std": [0.5] * 6, "passes": 12, "window": 2,
                        "windows": 6, "dispersion": 1.25, "features": 2, "reason": "", "unit": 5.0}
V1 = {"schema": "layertap.baseline", "version": 1, **BODY}
V2 = {"schema": "layertap.baseline", "version": 2, **BODY, "phase": "decode"}
V3 = {"schema": "layertap.baseline", "version": 3, **BODY, "phase": "forward", "null": NULL, "fixed": False}


def make(phase: str = "forward", *, null: bool = False, derive: int = 0) -> Baseline:
    """The baseline of ``BODY``; a derived one has no per-feature statistics (its null the pooled pair only)."""
    features = 0 if derive else 2
    model = NullModel(np.array(NULL["mean"][:2 * features + 2]), np.full(2 * features + 2, 0.5), 12, 2, 6, 1.25,
                      features, "", 5.0)
    return Baseline(tap="tap-1", layer="layer1", point="output", edges=np.array([-1.0, 0.0, 1.0]),
                    counts=np.array([2, 3, 3, 2], dtype=np.int64), count=10, mean=0.0, m2=9.5, min=-2.0, max=2.0,
                    passes=12, quantiles={0.5: 0.0, 0.95: 1.5},
                    channel_mean=None if derive else np.array([0.25, -0.25]),
                    channel_std=None if derive else np.array([1.0, 0.5]), window=2,
                    thresholds=DriftThresholds(psi=0.25), created_at=1700000000.5, phase=phase,
                    null=model if null else None, derive=derive)


def text(doc: dict[str, Any]) -> str:
    return json.dumps(doc, allow_nan=False, indent=1)  # as save_baseline writes it


@pytest.mark.parametrize(("baseline", "old"), [(make(), V1), (make("decode"), V2), (make(null=True), V3)],
                         ids=["v1", "v2", "v3"])
def test_a_baseline_without_derive_is_written_as_before_byte_for_byte(tmp_path: Path, baseline: Baseline,
                                                                        old: dict[str, Any]) -> None:
    assert text(baseline_to_dict(baseline)) == text(old)
    assert save_baseline(tmp_path, baseline).read_text(encoding="utf-8") == text(old)


@pytest.mark.parametrize("old", [V1, V2, V3], ids=["v1", "v2", "v3"])
def test_v1_v2_and_v3_documents_still_load_as_the_tensors_own(tmp_path: Path, old: dict[str, Any]) -> None:
    (tmp_path / "old.json").write_text(json.dumps(old))
    (b,), errors = load_baselines(tmp_path, {"layer1": 2})
    assert errors == [] and b.derive == 0 and b.phase == old.get("phase", "forward")
    assert (b.null is not None) == (old["version"] == 3)
    assert b.null is None or (b.null.calibrated and b.null.features == 2)
    np.testing.assert_array_equal(b.channel_mean, [0.25, -0.25])


@pytest.mark.parametrize("derive", sorted(DERIVE_NAMES))
def test_a_derived_baseline_round_trips_as_v4_with_its_derive(tmp_path: Path, derive: int) -> None:
    b = make(null=True, derive=derive)
    doc = baseline_to_dict(b)
    assert BASELINE_VERSION == doc["version"] == 4 and doc["derive"] == DERIVE_NAMES[derive]
    assert list(doc) == list(V3) + ["derive"]  # v3 and the derive
    assert doc["channel_mean"] is None and doc["null"]["features"] == 0
    got = baseline_from_dict(json.loads(json.dumps(doc)), {"layer1": 2})
    assert got.derive == derive and got.null is not None and got.null.calibrated and got.channel_mean is None
    # On disk and on the wire (InstallBaseline.frozen): the same document.
    path = save_baseline(tmp_path, b)
    (loaded,), errors = load_baselines(tmp_path, {"layer1": 2})
    assert errors == [] and loaded.derive == derive and json.loads(path.read_text())["version"] == 4
    assert frozen_from_bytes(frozen_to_bytes(b), "frozen[0]", {"layer1": 2}).derive == derive


def test_a_derived_baseline_without_null_statistics_is_still_v4_and_loads_uncalibrated() -> None:
    doc = baseline_to_dict(make(derive=pb.DERIVE_TOP1_PROB))
    assert doc["version"] == 4 and doc["derive"] == "top1_prob" and doc["null"]["reason"]
    got = baseline_from_dict(doc)
    assert got.derive == pb.DERIVE_TOP1_PROB and got.null is not None and not got.null.calibrated


V4 = baseline_to_dict(make(null=True, derive=pb.DERIVE_ENTROPY))


@pytest.mark.parametrize(("doc", "message"), [
    ({k: v for k, v in V4.items() if k != "derive"}, "derive None is not one of entropy, top1_prob"),
    ({**V4, "derive": "confidence"}, "derive 'confidence' is not one of entropy, top1_prob"),
    ({**V4, "derive": pb.DERIVE_ENTROPY}, f"derive {pb.DERIVE_ENTROPY} is not one of"),
    ({**V4, "derive": ""}, "derive '' is not one of"),
    ({**V3, "derive": "entropy"}, "field 'derive' needs schema version 4"),  # an older reader: the tensor's own
    ({**V4, "channel_mean": [0.5, 0.5], "channel_std": [1.0, 1.0]}, "derive 'entropy' has no per-feature"),
    ({**V4, "null": NULL}, "derive 'entropy' has no per-feature"),
    ({k: v for k, v in V4.items() if k != "null"}, "field 'null' must be an object"),
], ids=["missing", "unknown", "number", "empty", "v3", "channels", "features", "no-null"])
def test_a_bad_v4_document_is_refused_naming_derive_and_the_others_load(tmp_path: Path, doc: dict[str, Any],
                                                                      message: str) -> None:
    with pytest.raises(BaselineFormatError, match="derive|null"):
        baseline_from_dict(doc)
    save_baseline(tmp_path, replace(make(null=True), tap="tap-good"))
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    (good,), (error,) = load_baselines(tmp_path, {"layer1": 2})  # skipped, one message to count
    assert good.tap == "tap-good" and "bad.json refused: " in error and message in error, error


def test_a_derived_baseline_is_frozen_and_saved_with_its_derive(tmp_path: Path) -> None:
    builder = BaselineBuilder("tap-1", "lm_head", passes=3, seed=0)
    x = np.random.default_rng(0).gamma(2.0, size=500)
    builder.feed(x, x.size, x.mean(), x.std(), x.min(), x.max())
    b = builder.freeze(derive=pb.DERIVE_ENTROPY)
    assert b.derive == pb.DERIVE_ENTROPY
    entry = LayerEntry("tap-1", "lm_head", "output", 3, 50, DriftThresholds(), baseline=b, derive=pb.DERIVE_ENTROPY)
    assert entry.save(str(tmp_path), 0.0) and entry.save_error == ""  # no longer kept in memory only
    [path] = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["derive"] == "entropy"
    with pytest.raises(ValueError, match="read different quantities"):
        b.merge(replace(b, derive=0))


@pytest.fixture
def demo(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A demo model's engine and a monitor over ``tmp_path``; another start on the same directory with ``again``."""
    engines: list[TapEngine] = []

    def start() -> tuple[ModelHost, TapEngine, DriftMonitor]:
        host = ModelHost(load_model("demo"))
        host.warm_up()
        engine = TapEngine(host, Broker())
        engines.append(engine)
        errors.clear()
        return host, engine, engine.sinks.add(DriftMonitor(engine, baseline_dir=str(tmp_path), default_window=3,
                                                           on_load_error=errors.append))

    errors: list[str] = []
    yield start, errors
    for engine in engines:
        engine.close()


def feed(host: ModelHost, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        host.run([torch.randn(4, 3, 32, 32, generator=g)])


def test_a_restart_recreates_a_derived_tap_with_its_derive_and_no_channels(demo) -> None:  # type: ignore[no-untyped-def]
    start, errors = demo
    host, engine, monitor = start()
    # The entropy of fc's softmax (10 classes): one value per image, no features.
    tap, _ = monitor.set_baseline(pb.SetBaselineRequest(selector="fc", passes=4, window=3, derive=pb.DERIVE_ENTROPY))
    plain, _ = monitor.set_baseline(pb.SetBaselineRequest(selector="fc", passes=4, window=3))
    feed(host, 4)
    engine.flush(10)
    assert {d.tap: d.state for d in monitor.drift()} == {tap: pb.BASELINE_STATE_READY, plain: pb.BASELINE_STATE_READY}
    before = {e.tap: e.baseline for e in monitor._all()}
    engine.close()

    host, engine, again = start()
    assert again.load() == 2 and errors == []
    got = {d.tap: d for d in again.drift()}
    assert got[tap].derive == pb.DERIVE_ENTROPY and got[plain].derive == pb.DERIVE_UNSPECIFIED
    assert got[tap].state == pb.BASELINE_STATE_READY
    specs = {t.id: t.spec for t in engine.all_taps()}
    assert (specs[tap].derive, specs[plain].derive) == (pb.DERIVE_ENTROPY, pb.DERIVE_UNSPECIFIED)
    per_channel = {t: any(r.kind == pb.REDUCER_KIND_PER_CHANNEL for r in spec.reducers) for t, spec in specs.items()}
    assert per_channel == {tap: False, plain: True}
    for e in again._all():
        assert e.baseline is not None and e.baseline.derive == e.derive
        assert e.baseline.mean == before[e.tap].mean and np.array_equal(e.baseline.edges, before[e.tap].edges)
    # It scores the derived quantity again: its window fills with entropies (0 <= H <= log 10).
    feed(host, 3, seed=1)
    engine.flush(10)
    scored = {d.tap: d for d in again.drift()}
    assert scored[tap].window_passes == 3 and np.isfinite(scored[tap].psi), scored[tap]
    assert 0.0 < again.baseline_for("fc", "output", derive=pb.DERIVE_ENTROPY).max <= np.log(10)  # type: ignore[union-attr]
    assert again.baseline_for("fc", "output").derive == 0  # type: ignore[union-attr]  # the recorder's: the tensor's


def test_a_tap_whose_files_disagree_on_derive_loads_the_first_and_counts_the_rest(demo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    start, errors = demo
    derived = make(null=True, derive=pb.DERIVE_ENTROPY)
    save_baseline(tmp_path, replace(derived, tap="tap-x", layer="layer1", derive=0))
    save_baseline(tmp_path, replace(derived, tap="tap-x", layer="layer2"))
    _host, engine, monitor = start()
    assert monitor.load() == 1 and len(errors) == 1 and "more than one point or derive" in errors[0], errors
    assert [t.id for t in engine.all_taps()] == ["tap-x"]
    assert len(monitor.drift()) == 1


def test_an_installed_baseline_reads_what_the_tap_reads(demo) -> None:  # type: ignore[no-untyped-def]
    start, _errors = demo
    host, engine, monitor = start()
    req = pb.SetBaselineRequest(selector="fc", passes=4, derive=pb.DERIVE_ENTROPY, hold=True)
    tap, _ = monitor.set_baseline(req)
    derived = make(null=True, derive=pb.DERIVE_ENTROPY)
    plain = frozen_to_bytes(replace(derived, tap=tap, layer="fc", derive=0))
    with pytest.raises(InvalidField, match="the tensor itself, but tap .* reads 'entropy'"):
        monitor.install(pb.InstallBaselineRequest(tap=tap, frozen=[plain]))
    # Merged builders freeze with the tap's derive (a builder's state does not carry it).
    feed(host, 4)
    engine.flush(10)
    builders = [m.builder for m in monitor.export(tap)]
    [b] = monitor.install(pb.InstallBaselineRequest(tap=tap, builders=builders))
    assert b.derive == pb.DERIVE_ENTROPY
    [d] = monitor.drift()
    assert d.derive == pb.DERIVE_ENTROPY and d.state == pb.BASELINE_STATE_READY
    [doc] = [json.loads(m.frozen) for m in monitor.export(tap)]
    assert doc["derive"] == "entropy"
    # A replica given that document installs it as an entropy baseline (the id of its tap aside).
    copy, _ = monitor.set_baseline(pb.SetBaselineRequest(selector="fc", name="copy", derive=pb.DERIVE_ENTROPY, hold=True))
    [c] = monitor.install(pb.InstallBaselineRequest(tap=copy, frozen=[json.dumps(doc).encode()]))
    assert (c.tap, c.derive, c.mean) == ("copy", pb.DERIVE_ENTROPY, b.mean)


def test_the_flight_recorder_holds_a_derived_tap_against_its_derived_baseline(demo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The mean trigger's reference: an entropy tap's is the entropy baseline, a plain tap's the tensor's."""
    from layertap.server.record.recorder import Recorder
    from layertap.server.record.store import IncidentStore

    start, _errors = demo
    host, engine, monitor = start()
    monitor.set_baseline(pb.SetBaselineRequest(selector="fc", passes=4, window=3, derive=pb.DERIVE_ENTROPY))
    monitor.set_baseline(pb.SetBaselineRequest(selector="fc", passes=4, window=3))
    feed(host, 4)
    engine.flush(10)
    entropy = monitor.baseline_for("fc", "output", derive=pb.DERIVE_ENTROPY)
    tensor = monitor.baseline_for("fc", "output")
    assert entropy is not None and tensor is not None and entropy.mean != tensor.mean
    recorder = Recorder(engine, IncidentStore(tmp_path / "incidents"), drift=monitor)
    assert recorder._baseline("fc", pb.POINT_OUTPUT, derive=pb.DERIVE_ENTROPY) == (entropy.mean, entropy.std)
    assert recorder._baseline("fc", pb.POINT_OUTPUT) == (tensor.mean, tensor.std)
