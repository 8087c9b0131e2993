"""Plans' reuse keys are interned: equal plans hold one key object, so sharing looks up by identity."""

from __future__ import annotations

import gc

import pytest

from layertap.server.reducers.plan import ReducerPlan, ReuseKey, build_reducers
from layertap.v1 import telemetry_pb2 as pb

pytestmark = pytest.mark.unit


def _plan(bins: int) -> ReducerPlan:
    return ReducerPlan(build_reducers([pb.ReducerSpec(kind=pb.REDUCER_KIND_MOMENTS),
                                       pb.ReducerSpec(kind=pb.REDUCER_KIND_HISTOGRAM,
                                                      histogram=pb.HistogramParams(bins=bins, min=-1.0, max=1.0))]))


def test_equal_plans_share_one_key_and_different_plans_do_not() -> None:
    a, b, c = _plan(16), _plan(16), _plan(32)
    assert a.reuse_key is b.reuse_key and a.reuse_key is not None
    assert a.reuse_key != c.reuse_key
    assert len({a.reuse_key, b.reuse_key, c.reuse_key}) == 2
    assert isinstance(a.reuse_key, ReuseKey) and a.reuse_key.parts == b.reuse_key.parts  # type: ignore[union-attr]


def test_a_key_goes_when_its_plans_do() -> None:
    parts = _plan(48).reuse_key.parts  # type: ignore[union-attr]
    gc.collect()
    fresh = _plan(48).reuse_key
    assert fresh is not None and fresh.parts == parts
    held = ReuseKey.of(parts)
    assert held is fresh  # while a plan holds it, the table hands out that one
