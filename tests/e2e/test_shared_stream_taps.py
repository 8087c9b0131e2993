"""Subscribers of one principal asking for the same unnamed stream tap share one tap (``taps.shared_streams``).

Thirty identical subscribers then cost what one does plus the fan-out: one
reduction, one set of summaries, the same bytes sent to each. A subscriber
that draws its own samples, names its tap, or belongs to another principal
keeps a tap of its own; a shared tap ends with its last subscriber.
"""

from __future__ import annotations

import hashlib
import threading

import grpc
import pytest
from support.e2e import batch, wait_for

import layertap
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

pytestmark = pytest.mark.e2e

TOKENS = {"alice": "tok-alice-0123456789abcdef", "bob": "tok-bob-0123456789abcdef"}
WIDE = pb.TapSpec(selector="layer1.*", reducers=[pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS),
                                                 pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM)])


class Stream:
    """One Subscribe call, read on its own thread."""

    def __init__(self, channel: grpc.Channel, who: str, spec: pb.TapSpec) -> None:
        stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
        self.call = stub.Subscribe(pb.SubscribeRequest(stream_taps=[spec]), timeout=120,
                                   metadata=[("authorization", f"Bearer {TOKENS[who]}")])
        self.ids = list(next(self.call).stream_tap_ids)
        self.summaries: list[pb.Summary] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.summaries.extend(msg.summaries)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)


@pytest.fixture
def server(make_server, tmp_path):
    path = tmp_path / "tokens"
    path.write_text("".join(f"{who} sha256:{hashlib.sha256(tok.encode()).hexdigest()} infer,read,tap\n"
                            for who, tok in TOKENS.items()))
    return make_server(auth_tokens=str(path))


def test_identical_stream_taps_of_one_principal_are_one_tap_until_the_last_leaves(server) -> None:
    engine = server.state.taps
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    drawn = pb.TapSpec(selector=WIDE.selector, reducers=WIDE.reducers, sampling=pb.Sampling(probability=0.5))
    named = pb.TapSpec(name="alice-own", selector=WIDE.selector, reducers=WIDE.reducers)
    first, second = Stream(channel, "alice", WIDE), Stream(channel, "alice", WIDE)
    others = [Stream(channel, "bob", WIDE), Stream(channel, "alice", drawn), Stream(channel, "alice", named)]
    try:
        shared = first.ids[0]
        assert second.ids == [shared]
        assert len({shared, *(s.ids[0] for s in others)}) == 4  # another principal, own draws, a name: their own
        assert sorted(t.id for t in engine.all_taps()) == sorted({shared, *(s.ids[0] for s in others)})
        assert engine.streams.subscribers(shared) == 2
        with layertap.Client(f"127.0.0.1:{server.port}", token=TOKENS["alice"]) as c:
            c.infer(batch(), timeout=30)
            assert wait_for(lambda: first.summaries and second.summaries, 30)
            assert {s.tap for s in first.summaries} == {s.tap for s in second.summaries} == {shared}
            assert first.summaries == second.summaries  # the same summaries, fanned out
            first.close()
            assert wait_for(lambda: engine.streams.subscribers(shared) == 1, 30)
            assert engine.find(shared) is not None  # the other subscriber still has it
            seen = len(second.summaries)
            c.infer(batch(), timeout=30)
            assert wait_for(lambda: len(second.summaries) > seen, 30)
            second.close()
            assert wait_for(lambda: engine.find(shared) is None, 30)  # its last subscriber gone: so is the tap
            again = Stream(channel, "alice", WIDE)  # and a new subscriber gets a new tap
            assert again.ids != [shared]
            again.close()
    finally:
        for s in [first, second, *others]:
            s.close()
        channel.close()


def test_a_spec_listed_twice_in_one_request_gets_two_taps(server) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = telemetry_pb2_grpc.TelemetryServiceStub(channel)
    call = stub.Subscribe(pb.SubscribeRequest(stream_taps=[WIDE, WIDE]), timeout=60,
                          metadata=[("authorization", f"Bearer {TOKENS['alice']}")])
    try:
        ids = list(next(call).stream_tap_ids)
        assert len(ids) == 2 and ids[0] != ids[1]  # as before sharing: each entry its own tap
        other = Stream(channel, "alice", WIDE)  # another subscriber joins the first of them
        assert other.ids == ids[:1]
        assert server.state.taps.streams.subscribers(ids[0]) == 2 and server.state.taps.streams.subscribers(ids[1]) == 1
        other.close()
    finally:
        call.cancel()
        channel.close()
    assert wait_for(lambda: server.state.taps.all_taps() == [], 30)
