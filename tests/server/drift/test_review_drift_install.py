"""Review of issue 26: a frozen baseline installed on a tap with another window keeps the source's alarm window.

``DriftMonitor.install`` (frozen documents) replaces the baseline's ``window`` with the receiving
tap's (50 here) but keeps ``null.window`` from the source (2). The sliding window and GetDrift's
``window_passes`` follow 50, while the calibrated alarm completes a tumbling window (and spends one
window's share of the false-alarm rate) every 2 passes: after 10 passes it has decided 5 windows,
so per pass it alarms ~25x as often as the rate the operator set for 50-pass windows, and its
thresholds are those of 2-pass windows. Expected: the alarm decided on the tap's window (the null's
per-pass μ, σ rescale to any W; φ measured at the source's W could be kept or reset to 1 with a
note), or the install refused/flagged when the windows differ.
"""

from __future__ import annotations

import torch

from layertap.server.drift.monitor import DriftMonitor
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import load_model
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb


def rig() -> tuple[ModelHost, TapEngine, DriftMonitor]:
    host = ModelHost(load_model("demo"))
    host.warm_up()
    engine = TapEngine(host, Broker(), max_taps=3)
    return host, engine, engine.sinks.add(DriftMonitor(engine, default_window=5))


def test_an_installed_frozen_baseline_alarms_on_the_receiving_taps_window() -> None:
    g = torch.Generator().manual_seed(0)
    host_a, engine_a, mon_a = rig()
    host_b, engine_b, mon_b = rig()
    try:
        tap_a, _ = mon_a.set_baseline(pb.SetBaselineRequest(selector="layer1", passes=10, window=2))
        for _ in range(10):
            host_a.run([torch.randn(2, 3, 32, 32, generator=g)])
        engine_a.flush(10)
        docs = [lb.frozen for lb in mon_a.export(tap_a)]
        tap_b, _ = mon_b.set_baseline(pb.SetBaselineRequest(selector="layer1", passes=500, window=50, hold=True))
        mon_b.install(pb.InstallBaselineRequest(tap=tap_b, frozen=docs))
        for _ in range(10):
            host_b.run([torch.randn(2, 3, 32, 32, generator=g)])
        engine_b.flush(10)
        (d,) = mon_b.drift()
        assert d.calibration == pb.DRIFT_CALIBRATION_CALIBRATED and d.scored_passes == 10
        assert d.windows == 0, f"{d.windows} alarm windows decided in 10 passes on a tap whose window is 50"
    finally:
        engine_a.close()
        engine_b.close()
