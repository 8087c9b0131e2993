"""Review of issue 26: a feature constant in the baseline (a dead ReLU unit) that comes alive is never tested.

``NullModel.live`` drops σ = 0 components from the window test and the CUSUMs (``constant_features``
counts them). A dead unit waking up is a textbook drift signal, but only the pooled mean/std can see
it, diluted by the other features. Here a (16, 256) Linear+ReLU has unit 7 dead in the baseline
(bias -100); reviving it (bias 0, per-element std ~0.6) raises no alarm in 4 windows. Suggested: a
constant component that moves off its constant value (|x - μ| > a tolerance) raises the alarm (or
is at least counted as "changed constant features" and exported), instead of being skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from layertap.server.drift.monitor import DriftMonitor
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb


def test_a_dead_unit_that_comes_alive_raises_the_alarm() -> None:
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("fc", nn.Linear(4, 256))
    net.add_module("act", nn.ReLU())
    with torch.no_grad():
        net.fc.bias[7] = -100.0
    host = ModelHost(LoadedModel(net, "dead", "factory", [InputSpec("input", torch.float32, (-1, 4))]))
    host.warm_up()
    engine = TapEngine(host, Broker(), max_taps=3)
    monitor = engine.sinks.add(DriftMonitor(engine, default_window=5))
    try:
        monitor.set_baseline(pb.SetBaselineRequest(selector="act", passes=50, window=5))
        g = torch.Generator().manual_seed(1)
        for _ in range(50):
            host.run([torch.randn(16, 4, generator=g)])
        engine.flush(10)
        (d,) = monitor.drift()
        assert d.calibration == pb.DRIFT_CALIBRATION_CALIBRATED and d.constant_features >= 2  # unit 7's mean and std
        with torch.no_grad():
            net.fc.bias[7] = 0.0
        for _ in range(20):
            host.run([torch.randn(16, 4, generator=g)])
        engine.flush(10)
        (d,) = monitor.drift()
        assert d.windows == 4
        assert d.alarm, f"dead unit revived, no alarm (score {d.score:.2f}, threshold {d.threshold:.2f})"
    finally:
        engine.close()
