"""Admission by cost (``taps.cost_model``): plans measured per element and per firing, and refused when
even their slowest rate would exceed their principal's share of the overhead budget."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layertap.server.errors import LimitExceeded
from layertap.server.host.model_host import ModelHost
from layertap.server.host.sources import load_model
from layertap.server.reducers.plan import ReducerPlan, build_reducers
from layertap.server.taps.budget import MAX_STRIDE, Governor
from layertap.server.taps.cost_model import LARGE, SMALL, CostModel, _shrunk, admit
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit

MOMENTS = pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS)
WIDE = [MOMENTS, pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM), pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL)]


def plan(specs: list[pb.ReducerSpec]) -> ReducerPlan:
    return ReducerPlan(build_reducers(specs, "reducers"))


@pytest.fixture(scope="module")
def host() -> ModelHost:
    host = ModelHost(load_model("demo"))
    host.warm_up()  # the shape probe: a batch-1 pass
    assert host.layer_shapes
    return host


def test_a_plan_is_measured_once_per_shape_and_grows_with_the_element_count(host: ModelHost) -> None:
    model = CostModel(host)
    cost = model.cost(plan([MOMENTS]), (1, 64, 16, 16))
    assert cost is not None and cost.per_element > 0 and cost.per_firing >= 0
    measured = model.measured
    assert model.cost(plan([MOMENTS]), (4, 64, 16, 16)) is cost  # one batch or four: the same trailing shape
    assert model.measured == measured
    assert cost(4 * 64 * 16 * 16) > cost(64 * 16 * 16)


def test_the_estimate_sums_the_layers_the_probe_saw(host: ModelHost) -> None:
    model = CostModel(host)
    layers = sorted(host.layer_shapes)
    one, every = (model.estimate(plan(WIDE), ls, pb.POINT_OUTPUT) for ls in (layers[:1], layers))
    assert 0 < one < every
    # By hand, from each shape's measured cost: the same sum.
    by_hand = 0.0
    for layer in layers:
        seen = host.layer_shapes[layer]
        for shape in seen.outputs * seen.calls:
            c = model.cost(plan(WIDE), shape)
            by_hand += 0.0 if c is None else c(math.prod(shape))
    assert every == pytest.approx(by_hand)
    assert model.estimate(plan(WIDE), ["no.such.layer"], pb.POINT_OUTPUT) == 0.0


def governor(budget: float, per_pass: float = 4e-3, scale: float = 1.0) -> Governor:
    g = Governor(budget)
    g.per_pass, g.scale = per_pass, scale  # as a window would leave them
    return g


def test_a_plan_over_its_principals_share_at_its_slowest_rate_is_refused_naming_the_budget() -> None:
    share = 0.05 * 4e-3  # one principal: the whole budget of a 4 ms pass
    admit(0.9 * share * MAX_STRIDE, 0.0, governor=governor(0.05), owner="alice", owners=set())
    with pytest.raises(LimitExceeded) as refused:
        admit(1.1 * share * MAX_STRIDE, 0.0, governor=governor(0.05), owner="alice", owners=set(),
              field="stream_taps[0].reducers")
    message = str(refused.value)
    assert message.startswith("stream_taps[0].reducers:") and "--tap-budget 0.05" in message
    assert refused.value.field == "stream_taps[0].reducers" and refused.value.metadata["budget"] == "0.05"
    # Three principals share the budget: a third of it each.
    with pytest.raises(LimitExceeded, match="each of 3 principal"):
        admit(0.5 * share * MAX_STRIDE, 0.0, governor=governor(0.05), owner="alice", owners={"bob", "carol"})
    # Its always-on part counts too, and the measured scale multiplies the estimate.
    with pytest.raises(LimitExceeded):
        admit(0.5 * share * MAX_STRIDE, 0.6 * share * MAX_STRIDE, governor=governor(0.05), owner="a", owners=set())
    with pytest.raises(LimitExceeded):
        admit(0.5 * share * MAX_STRIDE, 0.0, governor=governor(0.05, scale=3.0), owner="a", owners=set())


def test_no_budget_or_no_pass_measured_yet_admits_anything() -> None:
    admit(1e9, 1e9, governor=governor(0.0), owner="a", owners=set())
    admit(1e9, 1e9, governor=governor(0.05, per_pass=0.0), owner="a", owners=set())


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=5), st.sampled_from([SMALL, LARGE]))
def test_calibration_tensors_keep_the_rank_and_stay_within_their_size(dims: list[int], limit: int) -> None:
    """A layer of any size is timed on a tensor of at most ``limit`` elements (a (32, 2048, 2048) attention
    map too), so a client's tap never makes the model thread allocate a layer-sized tensor to estimate it."""
    shape = (1, *dims) if len(dims) > 1 else (limit,)
    cut = _shrunk(tuple(shape), limit)
    assert len(cut) == len(shape) and all(d >= 1 for d in cut)
    assert math.prod(cut) <= limit
    assert all(c <= max(s, 1) or i == 0 for i, (c, s) in enumerate(zip(cut, shape)))


def test_a_plan_that_cannot_run_on_a_shape_is_kept_as_such_and_never_timed_again(host: ModelHost) -> None:
    model = CostModel(host)
    channel_4 = plan([pb.ReducerSpec(kind=pb.REDUCER_KIND_PER_CHANNEL, per_channel=pb.PerChannelParams(dim=4))])
    assert model.cost(channel_4, (1, 64, 16)) is None  # a 3-d tensor has no dim 4
    measured = model.measured
    assert model.cost(channel_4, (1, 64, 16)) is None and model.measured == measured



def test_a_basic_plan_that_fires_as_one_op_call_is_timed_as_one(host: ModelHost) -> None:
    """A basic tap's firing is one ``layertap::tap_stats`` call (taps.firing): that call is what is timed,
    not the eager plan, which costs many times more on CPU and made admission refuse cheap taps."""
    model = CostModel(host)
    basic = plan([MOMENTS])
    op = model.cost(basic, (1, 64, 16, 16), op=True)
    assert op is not None and op.per_element > 0 and model.measured == 1
    assert model.cost(plan([MOMENTS, pb.ReducerSpec(kind=pb.REDUCER_KIND_MINMAX)]), (1, 64, 16, 16), op=True) is op
    assert model.cost(basic, (1, 64, 16, 16)) is not op and model.measured == 2  # the plan path: its own timing
