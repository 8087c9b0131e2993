"""Which subscribers share a stream tap, and when a shared tap ends (``taps.shared_streams``)."""

from __future__ import annotations

import pytest

from layertap.server.taps.shared_streams import SharedStreams
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

WIDE = pb.TapSpec(selector="**", reducers=[pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)])


def test_identical_unnamed_specs_of_one_principal_share_and_others_do_not() -> None:
    key = SharedStreams.key
    assert key(WIDE, "alice") == key(pb.TapSpec(selector="**", reducers=[pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)]),
                                     "alice")
    assert key(WIDE, "alice") != key(WIDE, "bob")  # the budget's fairness and ownership stay per principal
    assert key(pb.TapSpec(selector="layer1", reducers=WIDE.reducers), "alice") != key(WIDE, "alice")
    named = pb.TapSpec(name="mine", selector="**", reducers=WIDE.reducers)
    drawn = pb.TapSpec(selector="**", reducers=WIDE.reducers, sampling=pb.Sampling(probability=0.5))
    metered = pb.TapSpec(selector="**", reducers=WIDE.reducers, sampling=pb.Sampling(max_per_second=2))
    assert key(named, "alice") is None and key(drawn, "alice") is None and key(metered, "alice") is None
    assert key(pb.TapSpec(selector="**", reducers=WIDE.reducers, sampling=pb.Sampling(every_n=3)), "alice") is not None


def test_a_shared_tap_counts_its_subscribers_and_ends_with_the_last() -> None:
    streams = SharedStreams()
    assert streams.join(WIDE, "alice") is None  # none yet: the caller makes one
    streams.add("t1", WIDE, "alice")
    assert streams.join(WIDE, "alice") == "t1" and streams.join(WIDE, "alice") == "t1"
    assert streams.join(WIDE, "bob") is None
    assert streams.subscribers("t1") == 3
    assert not streams.leave("t1") and not streams.leave("t1")
    assert streams.leave("t1")  # the last: the caller deletes the tap
    assert streams.subscribers("t1") == 0 and streams.join(WIDE, "alice") is None


def test_a_tap_gone_for_another_reason_is_never_joined_again() -> None:
    streams = SharedStreams()
    streams.add("t1", WIDE, "alice")
    assert streams.join(WIDE, "alice") == "t1"
    streams.forget("t1")  # failed or ended by the engine
    assert streams.join(WIDE, "alice") is None
    streams.add("t2", WIDE, "alice")
    assert streams.join(WIDE, "alice") == "t2"


def test_two_made_at_once_the_second_stays_its_own() -> None:
    streams = SharedStreams()
    streams.add("t1", WIDE, "alice")
    streams.add("t2", WIDE, "alice")
    assert streams.join(WIDE, "alice") == "t1"
    assert streams.leave("t2")  # its only subscriber
    assert streams.join(WIDE, "alice") == "t1"


def test_a_failed_tap_is_unshared_and_its_subscribers_keep_their_places() -> None:
    """A newcomer finds the shared tap failed: it gets a tap of its own, and the failed one still ends only
    with the last of those who followed it (the review's finding: one leaving had ended the other's stream)."""
    streams = SharedStreams()
    streams.add("t1", WIDE, "alice")
    assert streams.join(WIDE, "alice") == "t1"  # two follow t1
    assert streams.join(WIDE, "alice") == "t1"  # the newcomer, who finds it failed...
    streams.unshare("t1")
    assert not streams.leave("t1")  # ...undoes its join
    assert streams.join(WIDE, "alice") is None  # no one joins t1 again
    assert not streams.leave("t1")  # the first follower leaves: one remains
    assert streams.leave("t1")  # the last one: now it ends
