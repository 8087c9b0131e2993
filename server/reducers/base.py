"""The abstract reducer: what a plan needs from each reducer it runs.

A reducer is validated once (host-side), then reports how many float64 slots
it writes for a shape, computes them on the tensor's device without a host
sync, and decodes its host slots into a ``ReducerResult`` off the model thread.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from layertap.server.reducers.kernels import StatNeeds
from layertap.server.reducers.spec import reducer_name
from layertap.server.reducers.workspace import Workspace
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["Reducer", "shape_numel"]


def shape_numel(shape: Sequence[int]) -> int:
    """Element count of a shape: host metadata that costs no device slot."""
    return int(math.prod(shape))  # int(): numpy dims multiply to a numpy int


class Reducer(abc.ABC):
    """One validated reducer: knows its slot count, device work and decoding.

    Attributes:
        kind: The ``ReducerKind`` value.
        field: Field path of the spec it came from, for error messages.
    """

    kind: ClassVar[int]
    needs: ClassVar[StatNeeds] = StatNeeds()
    #: Reads the workspace's shared float64 upcast ``ws.xd``.
    reads_upcast: ClassVar[bool] = False

    def __init__(self, field: str) -> None:
        self.field = field

    @property
    def name(self) -> str:
        """Short name, e.g. ``"moments"``."""
        return reducer_name(self.kind)

    def spec(self) -> pb.ReducerSpec:
        """The spec with every server default filled in."""
        return pb.ReducerSpec(kind=self.kind)  # type: ignore[arg-type]

    def key(self) -> tuple[object, ...]:
        """Identity used to reject duplicate reducers."""
        return (self.kind,)

    @abc.abstractmethod
    def width(self, shape: Sequence[int]) -> int:
        """Number of float64 slots this reducer writes for a tensor of ``shape``."""

    def check(self, shape: Sequence[int]) -> None:
        """Raises SpecError when the reducer cannot apply to ``shape``."""

    @abc.abstractmethod
    def compute(self, ws: Workspace) -> torch.Tensor:
        """Returns this reducer's ``width`` slots as a 1-D float64 device tensor."""

    @abc.abstractmethod
    def decode(self, values: np.ndarray, shape: Sequence[int]) -> pb.ReducerResult:
        """Builds the result message from this reducer's host slots.

        Args:
            values: Exactly ``width(shape)`` float64 values.
            shape: Shape of the reduced tensor; host metadata such as the
                element count is taken from it instead of costing device slots.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.field})"
