"""Sinks: the one interface through which the engine and broker feed consumers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import load_model
from layertap.server.reducers import batched
from layertap.server.stream.broker import Broker
from layertap.server.stream.sinks import Sink, Sinks
from layertap.server.taps import firing
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


class Recorder(Sink):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_summaries(self, ctx, summaries):
        self.events.append(("summaries", ctx.index, sorted(s.layer for s in summaries)))

    def on_tap_created(self, tap):
        self.events.append(("created", tap.id))

    def on_tap_removed(self, tap, reason):
        self.events.append(("removed", tap.id, reason))

    def on_tap_error(self, tap):
        self.events.append(("error", tap.id))

    def on_hook_time(self, seconds):
        self.events.append(("hooks", seconds > 0))

    def on_delivery(self, dropped):
        self.events.append(("delivery", dropped))


class Broken(Sink):
    """Raises on every event: the sinks after it must still hear everything."""

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            def fail(*_args):
                raise RuntimeError(f"{name} broke")
            return fail
        return super().__getattribute__(name)


@pytest.fixture
def wired():
    sinks = Sinks()
    sinks.add(Broken())
    rec = sinks.add(Recorder())
    host = ModelHost(load_model("demo"))
    broker = Broker(sinks=sinks)
    engine = TapEngine(host, broker, sinks=sinks)
    yield host, broker, engine, rec
    engine.close()


def _pass(host: ModelHost) -> None:
    host.run([torch.from_numpy(np.zeros((1, 3, 32, 32), np.float32))])


def test_every_event_reaches_sinks_past_a_broken_one(wired) -> None:
    host, broker, engine, rec = wired
    tap = engine.create(pb.TapSpec(name="t", selector="layer1", reducers=[reducer_spec("moments", "r")]))
    sub = broker.subscribe([tap.id], queue_size=1)
    _pass(host)
    assert engine.flush(5)
    _pass(host)  # the subscriber never reads: this message pushes the first out
    assert engine.flush(5)
    engine.delete(tap.id)
    assert ("created", "t") in rec.events
    assert ("summaries", 0, ["layer1"]) in rec.events and ("summaries", 1, ["layer1"]) in rec.events
    assert ("hooks", True) in rec.events
    # Two passes, then the deletion event (an event message, also queued).
    assert [e for e in rec.events if e[0] == "delivery"] == [("delivery", 0), ("delivery", 1), ("delivery", 1)]
    assert ("removed", "t", "deleted") in rec.events
    broker.unsubscribe(sub)


def test_a_reducer_error_is_told_to_sinks_and_inference_goes_on(wired, monkeypatch) -> None:
    host, _broker, engine, rec = wired
    tap = engine.create(pb.TapSpec(name="t", selector="layer1", reducers=[reducer_spec("moments", "r")]))

    def boom(_tensor):
        raise ValueError("reducer broke")

    monkeypatch.setattr(tap.plan, "run", boom)
    # A small tensor's statistics come from the pass's batch (reducers.batched): it breaks there.
    monkeypatch.setattr(batched, "batched_basic_stats", lambda _x, _g: boom(_x))
    # A basic tap's firing is one op call (taps.firing): it breaks there first.
    monkeypatch.setattr(firing, "tap_stats_op", lambda x, *_a: boom(x))
    _pass(host)  # must not raise
    assert tap.disabled and ("error", "t") in rec.events
    assert engine.reducer_errors == 1


def test_sinks_add_returns_the_sink_and_iterates_in_order() -> None:
    sinks = Sinks()
    a, b = Recorder(), Recorder()
    assert sinks.add(a) is a and sinks.add(b) is b
    assert list(sinks) == [a, b]
