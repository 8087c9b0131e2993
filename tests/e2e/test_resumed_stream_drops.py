"""A subscriber that stops reading and comes back is told what it lost (issue 43's fourth small finding).

The finding: after 60 s of never reading, a subscriber's first message was 14
bytes with ``dropped=0`` although thousands of drops were counted. Those 14
bytes are the stream's opening message (``stream_tap_ids``: one 12-character
tap id), written when the stream opened, before anything was lost. What
follows it must carry the count: this test reads nothing for a while, then
checks that the messages after the opener say how many were dropped, up to
the server's own count.
"""

from __future__ import annotations

import grpc
import pytest
from support.e2e import batch, wait_for

from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

pytestmark = pytest.mark.e2e


def test_a_stream_that_resumes_reads_its_drops_after_the_opening_message(client, demo_server) -> None:
    spec = pb.TapSpec(selector="fc", reducers=[pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS),
                                               pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM,
                                                              histogram=pb.HistogramParams(bins=1024, min=-4, max=4))])
    channel = grpc.insecure_channel(client.target, options=[("grpc.http2.bdp_probe", 0)])
    call = telemetry_pb2_grpc.TelemetryServiceStub(channel).Subscribe(
        pb.SubscribeRequest(stream_taps=[spec], queue_size=2), timeout=120)
    try:
        assert wait_for(lambda: client.stats().subscribers == 1, 30)
        x = batch(1)
        for _ in range(40):  # nothing read meanwhile, not even the opening message
            client.infer(x)
        broker = demo_server.state.broker
        assert demo_server.state.taps.flush(30)  # every pass published: no drop comes after ``lost`` is read
        assert wait_for(lambda: broker.dropped_total > 0, 30)
        opener = next(call)
        assert opener.stream_tap_ids and not opener.summaries
        assert opener.ByteSize() == len(opener.stream_tap_ids[0]) + 2  # the 14-byte message of the finding
        lost = broker.dropped_total
        counts = []
        for msg in call:
            counts.append(msg.dropped)
            if msg.dropped >= lost:  # past it would be a drop after the count was read: fail, never hang
                break
        assert counts and counts[-1] == lost > 0  # the resumed stream says what it lost
        assert counts == sorted(counts)  # and the count never goes back
    finally:
        call.cancel()
        channel.close()
