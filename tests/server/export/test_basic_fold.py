"""A durable tap nobody streams feeds /metrics from its statistics slots, and ends up exactly as its summaries would.

The publisher builds a ``Summary`` only for a tap a subscriber or a summary-reading sink wants
(:meth:`Sink.wants_summaries`); the metrics sink folds every other basic piece from its values. The
two folds must leave the store identical, field by field and type by type, whatever the slots hold,
however outputs, calls, sampling and reducer sets mix across passes.
"""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from support.summaries import FakeTap

from layertap.server.export.health import ServerMetrics
from layertap.server.export.sink import MetricsSink
from layertap.server.export.snapshots import LayerSnapshot, SnapshotStore
from layertap.server.host.model_host import PHASE_DECODE, PHASE_NONE, PassContext
from layertap.server.reducers.basic import BASIC_REDUCERS
from layertap.server.reducers.kernels import BASIC_WIDTH
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.stream.broker import Broker
from layertap.server.stream.publisher import Piece, Publisher
from layertap.server.stream.sinks import Sink, Sinks
from layertap.server.stream.summary_wire import SummaryWire, results_bytes, timestamp
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

KINDS = sorted(BASIC_REDUCERS)
SLOT = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                 st.sampled_from([0.0, -0.0, 1.0, 1e300, -1e-300, math.nan, math.inf, -math.inf]))


@st.composite
def piece(draw: st.DrawFn) -> tuple:
    """(tap, layer, point, output_index, call_index, sampled, plan, slots, shape) of one piece."""
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=len(KINDS), unique=True))
    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=k) for k in kinds]))
    shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple))
    numel = math.prod(shape)
    count = draw(st.integers(0, numel))
    nan = draw(st.integers(0, numel - count))
    zeros = draw(st.integers(0, count))
    slots = [float(zeros), float(nan), float(count),
             *draw(st.lists(SLOT, min_size=BASIC_WIDTH - 3, max_size=BASIC_WIDTH - 3))]
    return (draw(st.sampled_from(["t1", "t2"])), draw(st.sampled_from(["a", "b"])),
            draw(st.sampled_from([pb.POINT_OUTPUT, pb.POINT_PARAM_GRAD])), draw(st.integers(0, 2)),
            draw(st.integers(0, 2)), draw(st.booleans()), plan, slots, shape)


def _same(a: LayerSnapshot, b: LayerSnapshot) -> None:
    for f in fields(LayerSnapshot):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert type(x) is type(y), (f.name, x, y)
        if isinstance(x, float) and math.isnan(x):
            assert math.isnan(y), (f.name, x, y)
        else:
            assert x == y, (f.name, x, y)


@settings(max_examples=300, deadline=None)
@given(passes=st.lists(st.lists(piece(), min_size=1, max_size=6), min_size=1, max_size=5),
       phase=st.sampled_from([PHASE_NONE, PHASE_DECODE]), wall=st.floats(0, 4e9))
def test_the_fold_from_slots_equals_the_fold_of_the_summaries(passes, phase, wall) -> None:
    by_summaries, by_slots = SnapshotStore(), SnapshotStore()
    wire = SummaryWire()
    ts = timestamp(wall)
    seconds = ts.seconds + ts.nanos * 1e-9
    place = b"" if phase == PHASE_NONE else pb.Summary(phase=phase).SerializeToString()
    for index, pieces in enumerate(passes):
        part = SummaryWire.pass_part(index, None, ts.seconds, ts.nanos)
        summaries = [(tap, pb.Summary.FromString(wire.summary(tap, layer, point, out, call, not sampled, part,
                                                              results_bytes(plan.basic_layout, slots, shape), place)))
                     for tap, layer, point, out, call, sampled, plan, slots, shape in pieces]
        by_summaries.update_from_summaries(summaries)
        by_slots.update_from_basic(seconds, index, phase, [
            (tap, layer, point, out, call, sampled, plan.basic_layout, slots, shape)
            for tap, layer, point, out, call, sampled, plan, slots, shape in pieces])
        a, b = by_summaries.snapshot(), by_slots.snapshot()
        assert [s.key for s in a] == [s.key for s in b]
        for x, y in zip(a, b):
            _same(x, y)


@pytest.mark.parametrize(("kind", "slots"), [
    (pb.REDUCER_KIND_NONFINITE, [0.0, -1.0, 4.0]),  # a negative NaN count: exported as a counter
    (pb.REDUCER_KIND_MOMENTS, [0.0, 0.0, -4.0]),  # a negative element count: in the summary, not exported
])
def test_a_count_out_of_range_folds_nothing_of_the_pass(kind, slots) -> None:
    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=kind)]))
    store = SnapshotStore()
    good = [0.0, 0.0, 4.0] + [1.0] * (BASIC_WIDTH - 3)
    bad = slots + [1.0] * (BASIC_WIDTH - 3)
    with pytest.raises(ValueError, match="uint64"):  # as writing the summary's varint raises
        results_bytes(plan.basic_layout, bad, (4,))
    with pytest.raises(ValueError, match="uint64"):
        store.update_from_basic(1.0, 0, PHASE_NONE, [("t", "a", pb.POINT_OUTPUT, 0, 0, True, plan.basic_layout, good, (4,)),
                                                     ("t", "b", pb.POINT_OUTPUT, 0, 0, True, plan.basic_layout, bad, (4,))])
    assert store.snapshot() == []


# -- the publisher's choice -------------------------------------------------------------------------


class Reads(Sink):
    """A sink that reads summaries of one tap only, as the drift monitor reads a baseline's."""

    def __init__(self, tap: str) -> None:
        self.tap, self.seen = tap, []

    def wants_summaries(self, tap_id: str) -> bool:
        return tap_id == self.tap

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        self.seen.extend(s.tap for s in summaries)


class ReadsAll(Sink):
    """A sink written before ``on_basic`` existed: it reads every summary, so every one is built for it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        self.seen.extend(s.tap for s in summaries)


def _pass(publisher: Publisher, taps: list[FakeTap], index: int) -> None:
    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)]))
    pieces = [Piece(tap, "layer", 0, 0, (4,), plan, True) for tap in taps]
    values = {i: np.array([0.0, 0.0, 4.0] + [float(i + 1)] * (BASIC_WIDTH - 3)) for i in range(len(pieces))}
    publisher.publish(PassContext(index=index, wall_time=1.0), pieces, values,
                      lambda: {t.id: t.durable for t in taps}, None)


def test_messages_are_built_only_for_the_taps_someone_reads() -> None:
    taps = [FakeTap("metrics-only"), FakeTap("streamed"), FakeTap("baseline")]
    store = SnapshotStore()
    sinks = Sinks()
    sinks.add(MetricsSink(ServerMetrics(CollectorRegistry(), "m"), store, lambda: {t.id: True for t in taps}))
    drift_like = sinks.add(Reads("baseline"))
    broker = Broker(sinks=sinks)
    publisher = Publisher(broker, sinks)
    sub = broker.subscribe(["streamed"])
    _pass(publisher, taps, 0)
    streamed = sub.get(timeout=0)
    assert streamed is not None and [s.tap for s in streamed.summaries] == ["streamed"]
    assert drift_like.seen == ["streamed", "baseline"]  # built for someone: every sink sees it
    # Every durable tap reaches /metrics, messages or not, and counts its hit.
    assert sorted(s.tap for s in store.snapshot()) == ["baseline", "metrics-only", "streamed"]
    assert [t.hits for t in taps] == [1, 1, 1]
    # A follow-all subscriber arriving later gets every durable tap's summaries from the next pass.
    everyone = broker.subscribe(None)
    _pass(publisher, taps, 1)
    batch = everyone.get(timeout=0)
    assert batch is not None and sorted(s.tap for s in batch.summaries) == ["baseline", "metrics-only", "streamed"]


def test_a_sink_that_reads_summaries_without_saying_which_gets_them_all() -> None:
    taps = [FakeTap("a"), FakeTap("b")]
    sinks = Sinks()
    legacy = sinks.add(ReadsAll())
    _pass(Publisher(Broker(sinks=sinks), sinks), taps, 0)
    assert legacy.seen == ["a", "b"]


class FoldsToo(MetricsSink):
    """A subclass that changes how summaries are read, but not the basic fold it inherits."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[str] = []

    def on_summaries(self, ctx: PassContext, summaries: list[pb.Summary]) -> None:
        self.seen.extend(s.tap for s in summaries)
        super().on_summaries(ctx, summaries)


def test_a_subclass_that_reads_summaries_below_a_basic_fold_gets_them_all() -> None:
    taps = [FakeTap("a")]
    store = SnapshotStore()
    sinks = Sinks()
    sub = sinks.add(FoldsToo(ServerMetrics(CollectorRegistry(), "m"), store, lambda: {"a": True}))
    assert sinks.add(Sink()).wants_summaries("a") is False  # reads nothing
    plain = MetricsSink(ServerMetrics(CollectorRegistry(), "m"), SnapshotStore(), lambda: {"a": True})
    assert plain.wants_summaries("a") is False and sub.wants_summaries("a") is True
    _pass(Publisher(Broker(sinks=sinks), sinks), taps, 0)
    assert sub.seen == ["a"] and [s.tap for s in store.snapshot()] == ["a"]  # folded once, as a summary


def test_a_bad_count_in_a_metrics_only_tap_fails_the_pass_as_its_summary_did() -> None:
    """The host-transfer thread counts the error; the other sinks still hear the pass."""
    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=pb.REDUCER_KIND_NONFINITE)]))

    class Hears(Sink):
        def __init__(self) -> None:
            self.passes = 0

        def on_basic(self, ctx, pieces) -> None:
            self.passes += 1

    sinks = Sinks()
    sinks.add(MetricsSink(ServerMetrics(CollectorRegistry(), "m"), SnapshotStore(), lambda: {"t": True}))
    hears = sinks.add(Hears())
    piece = Piece(FakeTap("t"), "layer", 0, 0, (4,), plan, True)
    bad = np.array([0.0, -1.0, 4.0] + [0.0] * (BASIC_WIDTH - 3))
    with pytest.raises(ValueError, match="uint64"):
        Publisher(Broker(sinks=sinks), sinks).publish(PassContext(index=0), [piece], {0: bad}, lambda: {"t": True}, None)
    assert hears.passes == 1


def test_a_sink_that_cannot_answer_is_sent_messages_and_the_pass_goes_on() -> None:
    class Unsure(Sink):
        def wants_summaries(self, tap_id: str) -> bool:
            raise RuntimeError("broken")

    sinks = Sinks()
    sinks.add(Unsure())
    legacy = sinks.add(ReadsAll())
    _pass(Publisher(Broker(sinks=sinks), sinks), [FakeTap("a")], 0)
    assert legacy.seen == ["a"]
