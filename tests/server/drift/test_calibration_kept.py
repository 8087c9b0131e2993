"""Calibration kept and shown: baseline files (schema v3 keeps the null, v1/v2 load uncalibrated),
the alarm series on /metrics, and the rate changed at run time without new passes."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from layertap.server.drift.alarm import CALIBRATED, FIXED, UNCALIBRATED, AlarmReading, WindowAlarm
from layertap.server.drift.builder import BaselineBuilder
from layertap.server.drift.files import load_baselines, save_baseline
from layertap.server.drift.layer import OLD_FILE, LayerEntry
from layertap.server.drift.null import NullModel, components
from layertap.server.drift.rates import check_rate
from layertap.server.drift.schema import baseline_to_dict
from layertap.server.drift.scores import DriftScore
from layertap.server.drift.thresholds import DriftThresholds
from layertap.server.errors import InvalidField
from layertap.server.export.activations import ActivationCollector
from layertap.server.export.snapshots import SnapshotStore

pytestmark = pytest.mark.slow


def frozen(passes: int = 300, window: int = 50, seed: int = 0):  # type: ignore[no-untyped-def]
    """A baseline fed like the monitor feeds it: moments, per-channel stats and their components."""
    rng = np.random.default_rng(seed)
    b = BaselineBuilder("tap-1", "layer1", passes=passes, seed=seed, window=window)
    for _ in range(passes):
        x = rng.normal(0.0, 1.0, size=(8, 4))
        cm, cs = x.mean(0), x.std(0)
        b.feed(x.ravel(), x.size, x.mean(), x.std(), x.min(), x.max(), channel_mean=cm, channel_std=cs,
               components=components(x.mean(), x.std(), cm, cs))
    return b.freeze(window=window)


def test_a_v3_file_keeps_its_calibration(tmp_path: Path) -> None:
    b = frozen()
    assert b.null is not None and b.null.calibrated and b.null.features == 4 and b.null.windows == 6
    path = save_baseline(tmp_path, b)
    assert json.loads(path.read_text())["version"] == 3
    (loaded,), errors = load_baselines(tmp_path, {"layer1": 4})
    assert errors == [] and loaded.null is not None and not loaded.fixed
    np.testing.assert_array_equal(loaded.null.mean, b.null.mean)
    np.testing.assert_array_equal(loaded.null.std, b.null.std)
    assert (loaded.null.passes, loaded.null.window, loaded.null.windows) == (300, 50, 6)
    assert loaded.null.dispersion == b.null.dispersion
    assert loaded.null.threshold(1e-4) == b.null.threshold(1e-4)


def test_an_older_file_loads_uncalibrated_and_a_bad_null_is_refused_and_counted(tmp_path: Path) -> None:
    b = frozen()
    save_baseline(tmp_path, replace(b, null=None))  # as a server before calibration wrote it
    (old,), errors = load_baselines(tmp_path)
    assert errors == [] and old.null is None
    e = LayerEntry("tap-1", "layer1", "output", 300, 50, DriftThresholds())
    e.arm(old, 1e-4)
    assert e.alarm is not None and not e.calibrated and e.alarm.reading().reason == OLD_FILE
    assert e.alarm.reading().calibration == UNCALIBRATED

    doc = baseline_to_dict(b)
    bad = {**doc, "null": {**doc["null"], "std": doc["null"]["std"][:3]}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    loaded, errors = load_baselines(tmp_path)
    assert len(loaded) == 1 and len(errors) == 1 and "null: mean has 10 entries, std 3" in errors[0]


def test_fixed_thresholds_are_kept_and_never_armed() -> None:
    b = replace(frozen(), fixed=True)
    e = LayerEntry("tap-1", "layer1", "output", 300, 50, DriftThresholds(psi=0.3))
    e.arm(b, 1e-4)
    assert e.fixed and e.alarm is None and not e.calibrated


def test_the_rate_is_checked() -> None:
    assert check_rate(1e-4) == 1e-4
    for bad in (0.0, -1e-3, 0.6, math.nan, math.inf):
        with pytest.raises(InvalidField, match="rate"):
            check_rate(bad)


def test_alarm_and_ratio_series() -> None:
    registry = CollectorRegistry()
    store = SnapshotStore()
    registry.register(ActivationCollector(store.snapshot, "demo", max_layers=8))
    thr = DriftThresholds()
    raised = AlarmReading(CALIBRATED, score=12.0, threshold=4.0, alarm=True)
    store.set_drift("t", "layer1", "output", DriftScore(0.01, 0.01, 0.01, 0.01, thr, alarm=raised))
    store.set_drift("t", "layer2", "output", DriftScore(0.3, 0.05, 0.05, 0.5, thr, alarm=AlarmReading(FIXED, alarm=True)))
    store.set_drift("t", "layer3", "output", DriftScore(0.0, 0.0, 0.0, 0.0, thr,
                                                        alarm=AlarmReading(UNCALIBRATED, "too short")))
    store.set_drift("t", "layer4", "output", DriftScore(0.0, 0.0, 0.0, 0.0, thr, alarm=AlarmReading(CALIBRATED)))
    g = registry.get_sample_value

    def lab(layer: str) -> dict[str, str]:
        return {"model": "demo", "layer": layer, "point": "output", "tap": "t", "phase": "forward"}

    assert g("layertap_activation_drift_alarm", lab("layer1")) == 1.0
    assert g("layertap_activation_drift_ratio", lab("layer1")) == 3.0
    assert g("layertap_activation_drift_alarm", lab("layer2")) == 1.0
    assert g("layertap_activation_drift_ratio", lab("layer2")) == pytest.approx(0.3 / 0.2)  # fixed: the worst of four
    assert g("layertap_activation_drift_alarm", lab("layer3")) == 0.0  # uncalibrated: never raised
    assert g("layertap_activation_drift_ratio", lab("layer3")) is None
    assert g("layertap_activation_drift_alarm", lab("layer4")) == 0.0  # no window yet: no ratio series
    assert g("layertap_activation_drift_ratio", lab("layer4")) is None


def test_raising_the_rate_keeps_alarm_and_ratio_consistent() -> None:
    """Issue 26 review: ``WindowAlarm.set_rate`` recomputes ``threshold`` from the saved null, so
    ``reading().ratio`` (and ``layertap_activation_drift_ratio``: "the alarm is raised above 1") used the new
    threshold at once while ``alarm`` kept the decision made at the old one. Observed: score 4.29, threshold
    4.87 at 1e-4 (ratio 0.88, no alarm); at 0.5 the threshold was 2.69, ratio 1.59 and ``alarm`` still False.
    Expected: the last completed window re-decided at the new threshold."""
    k, w, n = 34, 50, 500
    model = NullModel(np.zeros(k), np.ones(k), n, w, 10, 1.0, 16)
    alarm = WindowAlarm(model, 1e-4)
    alarm.limit = math.inf  # the window test alone, for a deterministic score
    x = np.random.default_rng(3).standard_normal((w, k))
    x[:, 0] += 3.6 / math.sqrt(w)
    for v in x:
        alarm.add(v)
    before = alarm.reading()
    assert before.ratio < 1 and not before.alarm
    alarm.set_rate(0.5)
    after = alarm.reading()
    assert after.alarm == (after.ratio > 1), f"ratio {after.ratio:.2f} (p {after.p_value:.1e}) but alarm {after.alarm}"
