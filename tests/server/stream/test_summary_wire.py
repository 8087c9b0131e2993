"""The host-transfer thread's hand-written summaries equal the ones built from messages, for any slot values."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layertap.server.reducers.basic import BASIC_REDUCERS
from layertap.server.reducers.kernels import BASIC_WIDTH
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.stream.summary_wire import Place, SummaryWire, results_bytes
from layertap.server.taps.tap import timestamp
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

SLOT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 2.0**53, 1e300, -1e-300, math.nan, math.inf, -math.inf]),
)
KINDS = sorted(BASIC_REDUCERS)
#: A pass's place in a generation: None for a plain forward.
PLACE = st.one_of(st.none(), st.builds(
    Place, st.sampled_from([pb.PHASE_UNSPECIFIED, pb.PHASE_PREFILL, pb.PHASE_DECODE]),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)), st.lists(st.text(max_size=30), max_size=4).map(tuple)))


def by_messages(plan: ReducerPlan, values: list[float], shape: tuple[int, ...], *, tap: str, layer: str,
                point: int, output_index: int, call_index: int, unsampled: bool, pass_index: int,
                step: int | None, rank: int | None, wall: float, output_key: str = "",
                place: Place | None = None) -> pb.Summary:
    """The engine's message path (``Publisher._summary``), written out field by field."""
    import numpy as np

    summary = pb.Summary(tap=tap, layer=layer, point=point, output_index=output_index, pass_index=pass_index,
                         wall_time=timestamp(wall), results=plan.decode(np.array(values), shape),
                         unsampled=unsampled, call_index=call_index, output_key=output_key)
    if step is not None:
        summary.step, summary.has_step = step, True
    if place is not None:
        summary.phase = place.phase
        if place.position is not None:
            summary.position, summary.has_position = place.position, True
        summary.request_ids.extend(place.request_ids)
    if rank is not None:
        summary.rank, summary.has_rank = rank, True
    return summary


@settings(max_examples=400, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=len(KINDS), unique=True),
    data=st.data(),
    shape=st.lists(st.integers(0, 3000), min_size=0, max_size=4).map(tuple),
    tap=st.text(max_size=40), layer=st.text(max_size=200),
    point=st.sampled_from([pb.POINT_OUTPUT, pb.POINT_INPUT, pb.POINT_GRAD_OUTPUT, pb.POINT_PARAM_GRAD]),
    output_index=st.integers(0, 2**32 - 1), call_index=st.integers(0, 2**32 - 1), unsampled=st.booleans(),
    pass_index=st.integers(0, 2**64 - 1), step=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    rank=st.one_of(st.none(), st.integers(0, 2**32 - 1)), wall=st.floats(0, 4e9),
    output_key=st.one_of(st.just(""), st.text(max_size=40)), place=PLACE,
)
def test_wire_summary_equals_the_message_built_one(kinds, data, shape, tap, layer, point, output_index, call_index,
                                                   unsampled, pass_index, step, rank, wall, output_key, place) -> None:
    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=k) for k in kinds]))
    assert plan.basic_layout is not None
    # The kernel's basic vector: counts are exact integers with nan + finite <= numel.
    numel = math.prod(shape)
    count = data.draw(st.integers(0, numel))
    nan = data.draw(st.integers(0, numel - count))
    zeros = data.draw(st.integers(0, count))
    basic = [float(zeros), float(nan), float(count), *data.draw(st.lists(SLOT, min_size=BASIC_WIDTH - 3, max_size=BASIC_WIDTH - 3))]
    values = basic  # run()'s output for a basic-only plan: the basic vector itself
    expected = by_messages(plan, values, shape, tap=tap, layer=layer, point=point, output_index=output_index,
                           call_index=call_index, unsampled=unsampled, pass_index=pass_index, step=step, rank=rank,
                           wall=wall, output_key=output_key, place=place)
    ts = timestamp(wall)
    wire = SummaryWire()
    got = pb.Summary.FromString(wire.summary(tap, layer, point, output_index, call_index, unsampled,
                                             SummaryWire.pass_part(pass_index, step, ts.seconds, ts.nanos),
                                             results_bytes(plan.basic_layout, values, shape),
                                             (place.wire() if place is not None else b"") + SummaryWire.rank_part(rank),
                                             output_key))
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    if place is not None:  # and the place's own bytes are protobuf's, zero values left out
        alone = pb.Summary()
        place.stamp(alone)
        assert place.wire() == alone.SerializeToString(deterministic=True)
    assert [x.WhichOneof("value") for x in got.results] == [r.result_field for r, _, _ in plan.basic_layout]


def test_plans_with_other_reducers_keep_the_message_path() -> None:
    assert ReducerPlan(build_reducers([pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS),
                                       pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM)])).basic_layout is None


def test_an_impossible_count_raises_as_the_message_path_does() -> None:
    """3 NaN and 5 finite in a 4-element tensor would make inf_count -4: both paths refuse, neither wraps."""
    import numpy as np
    import pytest

    plan = ReducerPlan(build_reducers([pb.ReducerSpec(kind=pb.REDUCER_KIND_NONFINITE)]))
    assert plan.basic_layout is not None
    with pytest.raises(ValueError):
        plan.decode(np.array([0.0, 3.0, 5.0, 0, 0, 0, 0, 0]), (4,))
    with pytest.raises(ValueError, match="out of range"):
        results_bytes(plan.basic_layout, [0.0, 3.0, 5.0, 0, 0, 0, 0, 0], (4,))
