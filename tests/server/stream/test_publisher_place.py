"""The publisher stamps each summary with its pass's place in a generation, the same on both of its paths.

A piece of a request's inline tap names that request alone (and its own position); every other piece
the whole pass. The hand-written path (basic-only plans) and the message path must give the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.summaries import FakeTap

from layertap.server.host.model_host import PHASE_DECODE, PHASE_PREFILL, PassContext, RequestRows
from layertap.server.reducers.latency import Lap
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.stream.broker import Broker
from layertap.server.stream.publisher import Piece, Publisher
from layertap.server.taps.tap_files import reducer_spec
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

SHAPE = (3, 5, 8)


def publish(ctx: PassContext, *, messages: bool, rank: int | None) -> list[pb.Summary]:
    plan = ReducerPlan(build_reducers([reducer_spec(r, "r") for r in ("moments", "minmax", "nonfinite")]))
    # A piece with a lap takes the message path, as latency plans do; this plan has no latency result to fill.
    lap = Lap(0.0) if messages else None
    a = RequestRows("a", slice(0, 1), (5,))
    b = RequestRows("b", slice(1, 3), (2, 2), 3)
    whole, tap_a, tap_b = FakeTap("whole"), FakeTap("a-tap"), FakeTap("b-tap")
    pieces = [Piece(whole, "block", 0, 0, SHAPE, plan, True, lap),
              Piece(tap_a, "block", 0, 0, (1, 5, 8), plan, True, lap, request=a),
              Piece(tap_b, "block", 0, 0, (2, 2, 8), plan, True, lap, request=b),
              Piece(tap_b, "head", 0, 1, (2, 2, 4), plan, False, lap, request=b)]
    rng = np.random.default_rng(0)
    values = {}
    for i, p in enumerate(pieces):
        v = rng.standard_normal(plan.width(p.shape))
        v[:3] = [0, 0, np.prod(p.shape)]  # zeros, NaN, finite: exact counts
        values[i] = v
    broker = Broker(default_queue_size=100)
    sub = broker.subscribe([p.tap.id for p in pieces])
    Publisher(broker).publish(ctx, pieces, values, lambda: {p.tap.id: True for p in pieces}, rank)
    out = []
    while (batch := sub.get(timeout=0)) is not None:
        out.extend(batch.summaries)
    return out


def place(s: pb.Summary) -> tuple[int, int | None, list[str]]:
    return s.phase, (s.position if s.has_position else None), list(s.request_ids)


@pytest.mark.parametrize("rank", [None, 3])
@pytest.mark.parametrize("phase, requests, want_whole", [
    (PHASE_PREFILL, (RequestRows("a", slice(0, 1), (5,)), RequestRows("b", slice(1, 3), (2, 2), 3)),
     (PHASE_PREFILL, None, ["a", "b"])),
    (PHASE_DECODE, (RequestRows("a", slice(0, 1), (0,)), RequestRows("b", slice(1, 3), (0, 0))),
     (PHASE_DECODE, 0, ["a", "b"])),
    (0, (), (0, None, [])),
])
def test_both_paths_stamp_the_same_place(phase, requests, want_whole, rank) -> None:
    ctx = PassContext(41, step=7, wall_time=1.7e9, phase=phase, requests=requests, tokens=5 if phase else 0)
    wire, messages = publish(ctx, messages=False, rank=rank), publish(ctx, messages=True, rank=rank)
    assert [s.SerializeToString(deterministic=True) for s in wire] == [
        s.SerializeToString(deterministic=True) for s in messages]
    by_tap = {(s.tap, s.layer): s for s in wire}
    assert place(by_tap["whole", "block"]) == want_whole
    # The request's own place: its id alone, its own position (the piece's rows, not the pass's).
    assert place(by_tap["a-tap", "block"]) == (phase, 5, ["a"])
    assert place(by_tap["b-tap", "block"]) == place(by_tap["b-tap", "head"]) == (phase, 2, ["b"])
    assert all((s.rank, s.has_rank) == (rank or 0, rank is not None) for s in wire)
    assert by_tap["b-tap", "head"].unsampled and by_tap["b-tap", "head"].call_index == 1
