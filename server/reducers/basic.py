"""The basic reducers: slices of the shared basic-statistics vector, decoded on the host.

Their device work is all in :func:`~layertap.server.reducers.kernels.fused_basic_stats`,
computed once per tensor for every reducer of a plan; each reducer only names
the statistics it needs and the slots it reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from layertap.server.reducers.base import Reducer, shape_numel
from layertap.server.reducers.kernels import COUNT, MAX, MIN, NAN, SHIFT, ZEROS, StatNeeds
from layertap.server.reducers.workspace import Workspace
from layertap.v1 import telemetry_pb2 as pb

__all__ = [
    "BASIC_REDUCERS",
    "AbsMaxReducer",
    "BasicReducer",
    "MinMaxReducer",
    "MomentsReducer",
    "NonfiniteReducer",
    "NormReducer",
    "ZeroFractionReducer",
]


class BasicReducer(Reducer):
    """A reducer whose slots are a slice of the basic-statistics vector."""

    slots: ClassVar[tuple[int, int]]

    def width(self, shape: Sequence[int]) -> int:
        return self.slots[1] - self.slots[0]

    def compute(self, ws: Workspace) -> torch.Tensor:
        assert ws.basic is not None
        return ws.basic[self.slots[0] : self.slots[1]]


def _finite_or_nan(lo: float, hi: float) -> tuple[float, float]:
    # The fill values make lo > hi exactly when no element was finite.
    return (math.nan, math.nan) if lo > hi else (lo, hi)


class MomentsReducer(BasicReducer):
    """Count, mean and population std of the finite elements."""

    kind = pb.REDUCER_KIND_MOMENTS
    needs = StatNeeds(count=True, sums=True, shifted=True)
    slots = (COUNT, SHIFT + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        count, s1, s2, shift = values.tolist()
        n = int(count)
        if n == 0:
            return pb.ReducerResult(moments=pb.Moments(count=0, mean=math.nan, std=math.nan))
        d = s1 / count
        if math.isinf(s2):  # float64 data beyond ~1e154: the square overflowed
            return pb.ReducerResult(moments=pb.Moments(count=n, mean=shift + d, std=math.inf))
        var = s2 / count - d * d
        std = math.sqrt(var) if var > 0 else 0.0  # also maps a NaN var to 0, never NaN
        return pb.ReducerResult(moments=pb.Moments(count=n, mean=shift + d, std=std))


class MinMaxReducer(BasicReducer):
    """Min and max of the finite elements."""

    kind = pb.REDUCER_KIND_MINMAX
    needs = StatNeeds(minmax=True)
    slots = (MIN, MAX + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        lo, hi = _finite_or_nan(float(values[0]), float(values[1]))
        return pb.ReducerResult(minmax=pb.MinMax(min=lo, max=hi))


class AbsMaxReducer(BasicReducer):
    """Largest magnitude among the finite elements (derived from min and max)."""

    kind = pb.REDUCER_KIND_ABS_MAX
    needs = StatNeeds(minmax=True)
    slots = (MIN, MAX + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        lo, hi = _finite_or_nan(float(values[0]), float(values[1]))
        value = math.nan if math.isnan(lo) else max(abs(lo), abs(hi))
        return pb.ReducerResult(abs_max=pb.AbsMax(value=value))


class ZeroFractionReducer(BasicReducer):
    """Fraction of exact zeros among all elements."""

    kind = pb.REDUCER_KIND_ZERO_FRACTION
    needs = StatNeeds(zeros=True)
    slots = (ZEROS, ZEROS + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        n = shape_numel(shape)
        fraction = float(values[0]) / n if n else math.nan
        return pb.ReducerResult(zero_fraction=pb.ZeroFraction(fraction=fraction, count=n))


class NonfiniteReducer(BasicReducer):
    """NaN and +-Inf counts; Inf is derived as ``numel - finite - nan``."""

    kind = pb.REDUCER_KIND_NONFINITE
    needs = StatNeeds(nan=True, count=True)
    slots = (NAN, COUNT + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        nan, finite = int(values[0]), int(values[1])
        inf = shape_numel(shape) - finite - nan
        return pb.ReducerResult(nonfinite=pb.Nonfinite(nan_count=nan, inf_count=inf))


class NormReducer(BasicReducer):
    """L2 norm of the finite elements, from the (possibly shifted) sums."""

    kind = pb.REDUCER_KIND_NORM
    needs = StatNeeds(count=True, sums=True)
    slots = (COUNT, SHIFT + 1)

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        count, s1, s2, shift = values.tolist()
        # sum(x**2) = sum((x-K)**2) + 2K sum(x-K) + n K**2; K is 0 unless the
        # plan also computes moments.
        sumsq = s2 + 2.0 * shift * s1 + count * shift * shift
        if math.isinf(s2) or math.isinf(sumsq):
            return pb.ReducerResult(norm=pb.Norm(l2=math.inf))  # overflow: inf, as numpy says
        return pb.ReducerResult(norm=pb.Norm(l2=math.sqrt(sumsq) if sumsq > 0 else 0.0))


#: Every basic reducer, by ``ReducerKind``: they take no parameters.
BASIC_REDUCERS: dict[int, type[BasicReducer]] = {
    cls.kind: cls
    for cls in (MomentsReducer, MinMaxReducer, AbsMaxReducer, ZeroFractionReducer, NonfiniteReducer, NormReducer)
}
