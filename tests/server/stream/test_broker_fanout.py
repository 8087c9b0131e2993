"""The broker's fan-out: each subscriber gets exactly its taps' summaries of a pass, in the pass's order.

The fan-out decides per subscriber and tap, not per summary (thirty subscribers
of thirty taps over 67 layers asked 60,000 times a sampled pass); these tests
hold it to the per-summary rule it replaced.
"""

from __future__ import annotations

import pytest

from layertap.server.stream.broker import Broker
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


def _pass(taps: list[str], layers: int, index: int) -> list[pb.Summary]:
    """Layer-major, as hooks fire: every tap's summary of layer 0, then of layer 1..."""
    return [pb.Summary(tap=t, layer=f"l{i}" * (1 + i % 3), pass_index=index) for i in range(layers) for t in taps]


def test_each_subscriber_gets_its_own_taps_summaries_in_pass_order() -> None:
    taps = ["a", "b", "c", "d"]
    durable = {"a": True, "b": False, "c": True, "d": False}
    broker = Broker(default_queue_size=100)
    follows: list[list[str] | None] = [["a"], ["b", "d"], ["d", "a", "c"], None, ["a", "b", "c", "d"], ["zz"]]
    subs = [broker.subscribe(f) for f in follows]
    summaries = _pass(taps, 5, 7)
    events = [pb.TapEvent(tap="c", kind="expired", message="m"), pb.TapEvent(tap="b", kind="disabled", message="n")]
    broker.publish(summaries, durable, events)
    for sub, f in zip(subs, follows):
        want = [s for s in summaries if (durable[s.tap] if f is None else s.tap in f)]
        want_events = [e for e in events if (durable[e.tap] if f is None else e.tap in f)]
        if not want and not want_events:
            assert sub.get(0) is None
            continue
        batch = sub.get(0)
        assert batch is not None
        assert [(s.tap, s.layer) for s in batch.summaries] == [(s.tap, s.layer) for s in want]
        assert [e.tap for e in batch.events] == [e.tap for e in want_events]
        assert batch.nbytes == sum(s.ByteSize() for s in want) + sum(e.ByteSize() for e in want_events)


def test_a_subscriber_following_every_tap_of_the_pass_gets_a_list_of_its_own() -> None:
    broker = Broker(default_queue_size=100)
    one, two = broker.subscribe(["a"]), broker.subscribe(["a"])
    summaries = _pass(["a"], 3, 1)
    broker.publish(summaries, {"a": False})
    first, second = one.get(0), two.get(0)
    assert first is not None and second is not None
    assert first.summaries == summaries == second.summaries
    first.summaries.clear()  # a consumer's list is its own: the others' and the caller's are untouched
    assert len(second.summaries) == len(summaries) == 3


def test_a_batch_sent_from_its_wire_bytes_is_the_message_the_summaries_make() -> None:
    """The publisher's bytes go out as they are; the stream's message must parse as if built from the messages."""
    broker = Broker(default_queue_size=100)
    sub, plain = broker.subscribe(["a", "b"]), broker.subscribe(["a", "b"])
    summaries = _pass(["a", "b", "c"], 4, 3)
    for s in summaries:
        s.results.add().moments.count = 5
    # Wire bytes as the publisher writes them: zero fields written out (proto3 would leave them out).
    wires = [s.SerializeToString() + pb.Summary(point=0).SerializeToString() + b"\x20\x00" for s in summaries]
    events = [pb.TapEvent(tap="a", kind="expired", message="m")]
    broker.publish(summaries, {}, events, wires=wires)
    batch = sub.get(0)
    assert batch is not None and batch.wires is not None
    assert batch.nbytes == sum(len(w) for w, s in zip(wires, summaries) if s.tap != "c") + events[0].ByteSize()
    got = pb.SubscribeResponse.FromString(batch.response(dropped=7))
    want = [s for s in summaries if s.tap != "c"]
    assert got == pb.SubscribeResponse(summaries=want, events=events, dropped=7)
    # And a batch with no bytes serializes its messages, to the same message.
    broker.publish(summaries, {}, events)
    assert sub.get(0).wires is None  # type: ignore[union-attr]
    first = plain.get(0)
    assert first is not None
    assert pb.SubscribeResponse.FromString(first.response(dropped=7)) == got
