"""A guard for the next attempt at testing features past MAX_CHANNELS (issue 26's open gap): one SetBaseline
over wide layers must not make the host-transfer thread drop passes (every tap's, a client's too).

Session 13 raised the drift taps' per_channel cap to 65536; a review measured ~25 ms of host work per
65536-wide layer per pass (the per-feature vectors built as protobuf, 1.5 MiB each in the transfer backlog):
this test dropped 37 of 40 passes, and the change was reverted. It passes with the 4096 cap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layertap.server.drift.monitor import DriftMonitor
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import InputSpec, LoadedModel
from layertap.server.stream.broker import Broker
from layertap.server.taps.engine import TapEngine
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

LAYERS, WIDTH = 12, 65536


class _Fan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(4, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(h(x)[:, :1] for h in self.heads)


def test_a_baseline_of_wide_layers_does_not_make_client_taps_lose_passes() -> None:
    torch.manual_seed(0)
    host = ModelHost(LoadedModel(_Fan(), "fan", "factory", [InputSpec("input", torch.float32, (-1, 4))]))
    host.warm_up()
    engine = TapEngine(host, Broker(), max_taps=4)
    monitor = engine.sinks.add(DriftMonitor(engine, default_window=5))
    try:
        engine.create(pb.TapSpec(name="client", selector="re:heads\\.0$",
                                 reducers=[pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)]))
        monitor.set_baseline(pb.SetBaselineRequest(selector="re:heads\\.\\d+$", passes=10, window=5))
        g = torch.Generator().manual_seed(1)
        for _ in range(40):
            host.run([torch.randn(2, 4, generator=g)])
        engine.flush(120)
        stats = engine.transfer.stats()
        assert stats.dropped == 0, stats
    finally:
        engine.close()
