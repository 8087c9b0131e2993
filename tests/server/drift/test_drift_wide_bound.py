"""Wide layers (issue 26): calibrated drift tests every feature up to MAX_DRIFT_CHANNELS, counts the rest.

Past the client cap MAX_CHANNELS (4096) the drift tap's own per_channel reducer reports up to
MAX_DRIFT_CHANNELS (65536) features: the Bonferroni threshold counts all their components, the baseline file
keeps them (and loads calibrated), a subscriber still receives the first MAX_CHANNELS, and past the bound
GetDrift says how many features are untested. A bad or oversized null is refused with its reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from layertap.server.drift import files
from layertap.server.drift.exchange import builder_state_from_proto
from layertap.server.drift.files import load_baselines
from layertap.server.drift.monitor import DriftMonitor
from layertap.server.drift.null import t_quantile
from layertap.server.drift.schema import BaselineFormatError, baseline_from_dict, baseline_to_dict
from layertap.server.errors import InvalidField
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.reducers.plan import build_reducers
from layertap.server.reducers.spec import MAX_CHANNELS, MAX_DRIFT_CHANNELS, SpecError
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb


def _serve(width: int, baseline_dir: str | None = None) -> tuple[nn.Sequential, ModelHost, TapEngine, DriftMonitor]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("wide", nn.Linear(4, width))
    host = ModelHost(LoadedModel(model, "wide", "factory", [InputSpec("input", torch.float32, (-1, 4))]))
    host.warm_up()
    engine = TapEngine(host, Broker(), max_taps=3)
    monitor = engine.sinks.add(DriftMonitor(engine, default_window=5, baseline_dir=baseline_dir))
    return model, host, engine, monitor


def _run(host: ModelHost, engine: TapEngine, passes: int, g: torch.Generator) -> None:
    for _ in range(passes):
        host.run([torch.randn(16, 4, generator=g)])
    engine.flush(30)


def _shift(model: nn.Sequential, feature: int, sigmas: float = 5.0) -> None:
    with torch.no_grad():
        model.wide.bias[feature] += sigmas * float(model.wide.weight[feature].norm())


def test_a_client_may_not_ask_past_max_channels_the_server_may() -> None:
    spec = pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=pb.PerChannelParams(max_channels=MAX_CHANNELS + 1))
    with pytest.raises(SpecError, match=f"at most {MAX_CHANNELS}, got {MAX_CHANNELS + 1}"):
        build_reducers([spec])
    (r,) = build_reducers([spec], channel_limit=MAX_DRIFT_CHANNELS)
    assert r.spec().per_channel.max_channels == MAX_CHANNELS + 1
    spec.per_channel.max_channels = MAX_DRIFT_CHANNELS + 1
    with pytest.raises(SpecError, match=f"at most {MAX_DRIFT_CHANNELS}"):
        build_reducers([spec], channel_limit=MAX_DRIFT_CHANNELS)


def test_every_feature_counts_in_the_threshold_and_subscribers_get_the_client_cap() -> None:
    """5000 features: the null has 2 * 5000 + 2 components and the threshold is Bonferroni over all of them;
    a subscriber of every durable tap receives the baseline tap's first MAX_CHANNELS features only."""
    model, host, engine, monitor = _serve(5000)
    sub = engine.broker.subscribe(None, 100_000)
    try:
        monitor.set_baseline(pb.SetBaselineRequest(selector="wide", passes=25, window=5))
        g = torch.Generator().manual_seed(1)
        _run(host, engine, 30, g)
        b = monitor.baseline_for("wide", "output")
        assert b is not None and b.null is not None and b.null.calibrated
        assert b.null.features == 5000 and b.null.mean.shape == (10002,)
        (d,) = monitor.drift()
        k = 10002 - d.constant_features
        want = t_quantile(d.false_alarm_rate / 2 / (2 * k), b.null.passes - 1)
        assert d.calibration == pb.DRIFT_CALIBRATION_CALIBRATED and d.threshold == pytest.approx(want, rel=1e-12)
        assert d.untested_features == 0
        seen = 0
        while (batch := sub.get(timeout=0)) is not None:
            for s in batch.summaries:
                for r in s.results:
                    if r.WhichOneof("value") == "per_channel":
                        pc = r.per_channel
                        assert len(pc.mean) == len(pc.std) == len(pc.abs_max) == MAX_CHANNELS and pc.channels == 5000
                        seen += 1
        assert seen >= 30
    finally:
        engine.broker.unsubscribe(sub)
        engine.close()


def test_past_the_bound_the_first_features_are_tested_and_the_rest_counted() -> None:
    width = MAX_DRIFT_CHANNELS + 500
    model, host, engine, monitor = _serve(width)
    try:
        monitor.set_baseline(pb.SetBaselineRequest(selector="wide", passes=25, window=5))
        g = torch.Generator().manual_seed(1)
        _run(host, engine, 25, g)
        (d,) = monitor.drift()
        b = monitor.baseline_for("wide", "output")
        assert b is not None and b.null is not None and b.null.features == MAX_DRIFT_CHANNELS and b.channel_mean is None
        assert d.calibration == pb.DRIFT_CALIBRATION_CALIBRATED and d.untested_features == 500, d
        _shift(model, 60_000)  # past 4096, within the bound: seen
        _run(host, engine, 10, g)
        (d,) = monitor.drift()
        assert d.alarm and d.windows == 2 and d.untested_features == 500, d
    finally:
        engine.close()


def test_a_wide_baseline_file_round_trips_calibrated_and_a_bad_null_is_refused(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model, host, engine, monitor = _serve(5000, str(tmp_path))
    g = torch.Generator().manual_seed(1)
    try:
        monitor.set_baseline(pb.SetBaselineRequest(selector="wide", passes=25, window=5))
        _run(host, engine, 25, g)
    finally:
        engine.close()
    (path,) = tmp_path.glob("*.json")
    (b,), errors = load_baselines(tmp_path, {"wide": 5000})
    assert errors == [] and b.null is not None and b.null.calibrated and b.null.features == 5000
    assert b.channel_mean is None  # kept up to MAX_CHANNELS only: the sliding window holds one vector per pass

    # Reloaded by a fresh server: calibrated, and a shift of feature 4500 is still seen.
    model, host, engine, monitor = _serve(5000, str(tmp_path))
    try:
        assert monitor.load() == 1
        (d,) = monitor.drift()
        assert d.calibration == pb.DRIFT_CALIBRATION_CALIBRATED and d.state == pb.BASELINE_STATE_READY, d
        _run(host, engine, 5, g)
        (d,) = monitor.drift()
        assert d.windows == 1 and d.ignored_passes == 0 and not d.alarm, d
        _shift(model, 4500)
        _run(host, engine, 10, g)
        (d,) = monitor.drift()
        assert d.alarm, d
    finally:
        engine.close()

    doc = json.loads(path.read_text())
    bad = json.loads(json.dumps(doc))
    bad["null"]["features"] = MAX_DRIFT_CHANNELS + 1
    with pytest.raises(BaselineFormatError, match=f"'null.features' is {MAX_DRIFT_CHANNELS + 1}, at most {MAX_DRIFT_CHANNELS}"):
        baseline_from_dict(bad)
    bad = json.loads(json.dumps(doc))
    n = 2 * MAX_DRIFT_CHANNELS + 3
    bad["null"]["mean"], bad["null"]["std"] = [0.0] * n, [1.0] * n
    with pytest.raises(BaselineFormatError, match=f"{n} components, at most {n - 1}"):
        baseline_from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["channel_mean"] = bad["channel_std"] = [0.0] * (MAX_CHANNELS + 1)
    with pytest.raises(BaselineFormatError, match=f"channel_mean has {MAX_CHANNELS + 1} entries, at most {MAX_CHANNELS}"):
        baseline_from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["null"]["features"] = 4999  # components of 5000 features: not a calibrated null
    with pytest.raises(BaselineFormatError, match="10002 components for 4999 features"):
        baseline_from_dict(bad)
    # A file saved at the old cap (4096 features in the null, no channel means) loads uncalibrated, with the reason.
    assert baseline_to_dict(b)["null"]["features"] == 5000
    old = json.loads(json.dumps(doc))
    old["channel_mean"] = old["channel_std"] = None
    for key in ("mean", "std"):
        v = old["null"][key]
        old["null"][key] = v[:MAX_CHANNELS] + v[5000:5000 + MAX_CHANNELS] + v[-2:]
    old["null"]["features"] = MAX_CHANNELS
    older = baseline_from_dict(old, {"wide": 5000})
    assert older.null is not None and not older.null.calibrated
    assert f"cover {MAX_CHANNELS} features, layer 'wide' has 5000 tested" in older.null.reason

    # An oversized file is refused before it is parsed, with its reason; the others still load.
    monkeypatch.setattr(files, "MAX_FILE_BYTES", path.stat().st_size - 1)
    loaded, errors = load_baselines(tmp_path, {"wide": 5000})
    assert loaded == [] and len(errors) == 1 and f"over {path.stat().st_size - 1} bytes" in errors[0]


def test_a_replica_s_builder_state_may_not_carry_more_channel_means_than_a_builder_keeps() -> None:
    msg = pb.BaselineBuilderState(layer="wide", channel_count=1.0, channel_mean=[0.0] * (MAX_CHANNELS + 1),
                                  channel_m2=[0.0] * (MAX_CHANNELS + 1))
    with pytest.raises(InvalidField, match=f"at most {MAX_CHANNELS} channels, got {MAX_CHANNELS + 1}"):
        builder_state_from_proto(msg, "builders[0]")
    del msg.channel_mean[MAX_CHANNELS:], msg.channel_m2[MAX_CHANNELS:]
    assert builder_state_from_proto(msg, "builders[0]").channel_mean.shape == (MAX_CHANNELS,)  # type: ignore[union-attr]
