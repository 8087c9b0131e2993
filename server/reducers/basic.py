"""The basic reducers: slices of the shared basic-statistics vector, decoded on the host.

Their device work is all in :func:`~layertap.server.reducers.kernels.fused_basic_stats`,
computed once per tensor for every reducer of a plan; each reducer only names
the statistics it needs and the slots it reads.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from google.protobuf import message_factory
from google.protobuf.message import Message

from layertap.server.reducers.base import Reducer, shape_numel
from layertap.server.reducers.kernels import COUNT, MAX, MIN, NAN, SHIFT, ZEROS, StatNeeds
from layertap.server.reducers.spec import KIND_NAMES
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


#: Every basic reducer, by ``ReducerKind``: they take no parameters. Each
#: subclass of :class:`BasicReducer` adds itself.
BASIC_REDUCERS: dict[int, type[BasicReducer]] = {}


class BasicReducer(Reducer):
    """A reducer whose slots are a slice of the basic-statistics vector.

    Its result is one flat message of numbers: :meth:`numbers` computes them
    from the slots, in the order of the message's fields, and both
    :meth:`decode` and the publisher's wire encoder
    (:mod:`~layertap.server.stream.summary_wire`) build on it.
    """

    slots: ClassVar[tuple[int, int]]
    #: The ``ReducerResult`` oneof field this reducer fills: its kind's name
    #: (``REDUCER_KIND_ABS_MAX`` fills ``abs_max``).
    result_field: ClassVar[str]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.result_field = KIND_NAMES[cls.kind]  # a KeyError at import: a kind the proto lacks
        BASIC_REDUCERS[cls.kind] = cls

    def width(self, shape: Sequence[int]) -> int:
        return self.slots[1] - self.slots[0]

    def compute(self, ws: Workspace) -> torch.Tensor:
        assert ws.basic is not None
        return ws.basic[self.slots[0] : self.slots[1]]

    @abc.abstractmethod
    def numbers(self, values: Sequence[float], shape: Sequence[int]) -> tuple[float, ...]:
        """The result message's field values, in field order, from this reducer's slots."""

    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        message, names = _result_message(self.result_field)
        fields = dict(zip(names, self.numbers(values.tolist(), shape)))
        # One oneof field, named at run time: no static type can say which.
        return pb.ReducerResult(**{self.result_field: message(**fields)})  # type: ignore[arg-type]


@functools.cache
def _result_message(field: str) -> tuple[type[Message], tuple[str, ...]]:
    """The message class of a ``ReducerResult`` oneof field, and its field names in order."""
    descriptor = pb.ReducerResult.DESCRIPTOR.fields_by_name[field].message_type
    assert descriptor is not None, f"ReducerResult.{field} is not a message field"
    return message_factory.GetMessageClass(descriptor), tuple(f.name for f in descriptor.fields)


def _finite_or_nan(lo: float, hi: float) -> tuple[float, float]:
    # The fill values make lo > hi exactly when no element was finite.
    return (math.nan, math.nan) if lo > hi else (lo, hi)


class MomentsReducer(BasicReducer):
    """Count, mean and population std of the finite elements."""

    kind = pb.REDUCER_KIND_MOMENTS
    needs = StatNeeds(count=True, sums=True, shifted=True)
    slots = (COUNT, SHIFT + 1)

    def numbers(self, values: Sequence[float], shape: Sequence[int]) -> tuple[float, ...]:
        count, s1, s2, shift = values
        n = int(count)
        if n == 0:
            return 0, math.nan, math.nan
        d = s1 / count
        if math.isinf(s2):  # float64 data beyond ~1e154: the square overflowed
            return n, shift + d, math.inf
        var = s2 / count - d * d
        return n, shift + d, math.sqrt(var) if var > 0 else 0.0  # also maps a NaN var to 0, never NaN


class MinMaxReducer(BasicReducer):
    """Min and max of the finite elements."""

    kind = pb.REDUCER_KIND_MINMAX
    needs = StatNeeds(minmax=True)
    slots = (MIN, MAX + 1)

    def numbers(self, values: Sequence[float], shape: Sequence[int]) -> tuple[float, ...]:
        return _finite_or_nan(values[0], values[1])


class AbsMaxReducer(BasicReducer):
    """Largest magnitude among the finite elements (derived from min and max)."""

    kind = pb.REDUCER_KIND_ABS_MAX
    needs = StatNeeds(minmax=True)
    slots = (MIN, MAX + 1)

    def numbers(self, values: Sequence[float], shape: Sequence[int]) -> tuple[float, ...]:
        lo, hi = _finite_or_nan(values[0], values[1])
        return (math.nan if math.isnan(lo) else max(abs(lo), abs(hi)),)


class ZeroFractionReducer(BasicReducer):
    """Fraction of exact zeros among all elements."""

    kind = pb.REDUCER_KIND_ZERO_FRACTION
    needs = StatNeeds(zeros=True)
    slots = (ZEROS, ZEROS + 1)

    def numbers(self, values: Sequence[float], shape: Sequence[int]) -> tuple[float, ...]:
        n = shape_numel(shape)
        return (values[0] / n if n else math.nan), n


class NonfiniteReducer(BasicReducer):
    """NaN and +-Inf counts; Inf is derived as ``numel - finite - nan``."""

    kind = pb.REDUCER_KIND_NONFINITE
    needs = StatNeeds(nan=True, count=True)
    slots = (NAN, COUNT + 1)

    def numbers(self, values: Sequence[float], shape: Sequence[int]) -> tuple[float, ...]:
        nan, finite = int(values[0]), int(values[1])
        return nan, shape_numel(shape) - finite - nan


class NormReducer(BasicReducer):
    """L2 norm of the finite elements, from the (possibly shifted) sums."""

    kind = pb.REDUCER_KIND_NORM
    needs = StatNeeds(count=True, sums=True)
    slots = (COUNT, SHIFT + 1)

    def numbers(self, values: Sequence[float], shape: Sequence[int]) -> tuple[float, ...]:
        count, s1, s2, shift = values
        # sum(x**2) = sum((x-K)**2) + 2K sum(x-K) + n K**2; K is 0 unless the
        # plan also computes moments.
        sumsq = s2 + 2.0 * shift * s1 + count * shift * shift
        if math.isinf(s2) or math.isinf(sumsq):
            return (math.inf,)  # overflow: inf, as numpy says
        return (math.sqrt(sumsq) if sumsq > 0 else 0.0,)


