"""What every converter shares: the proto enums by name, and the field-by-field copy into dataclasses.

Enum names (points, phases, derives, and the per-resource ones in the
``_convert_*`` modules) are derived from the proto enums, not kept by hand.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from ._errors import InvalidArgument
from .v1 import telemetry_pb2

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Point: TypeAlias = "telemetry_pb2.Point.ValueType"
_Phase: TypeAlias = "telemetry_pb2.Phase.ValueType"
_V = TypeVar("_V", bound=int, covariant=True)
_D = TypeVar("_D", bound="DataclassInstance")


class ProtoEnum(Protocol[_V]):
    """A generated proto enum, as far as :func:`enum_names` reads it."""

    def items(self) -> Iterable[tuple[str, _V]]: ...


def enum_names(enum: ProtoEnum[_V], prefix: str) -> dict[str, _V]:
    """``{"grad_output": POINT_GRAD_OUTPUT, ...}``: lower-case names without the
    enum's prefix, in proto order, UNSPECIFIED (0) left out."""
    return {name.removeprefix(prefix).lower(): code for name, code in enum.items() if code}


_POINTS = enum_names(telemetry_pb2.Point, "POINT_")
_POINT_NAMES = {code: name for name, code in _POINTS.items()}
#: The generation phases; a plain forward's PHASE_UNSPECIFIED is "".
_PHASES = {"": telemetry_pb2.PHASE_UNSPECIFIED, **enum_names(telemetry_pb2.Phase, "PHASE_")}
_PHASE_NAMES = {code: name for name, code in _PHASES.items()}
_DERIVES = {"": telemetry_pb2.DERIVE_UNSPECIFIED, **enum_names(telemetry_pb2.Derive, "DERIVE_")}  # "": the tensor
_DERIVE_NAMES = {code: name for name, code in _DERIVES.items()}
#: Every point name, in proto order.
POINT_NAMES: tuple[str, ...] = tuple(_POINTS)


def point_code(point: str) -> _Point:
    """Returns the wire Point for ``"output"``, ``"input"``, ...

    Raises:
        InvalidArgument: Unknown point name.
    """
    try:
        return _POINTS[point.strip().lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown point {point!r}; expected one of: {', '.join(_POINTS)}"
        ) from None


def point_name(code: _Point) -> str:
    """Returns the name of a wire Point (``"output"`` when unspecified)."""
    return _POINT_NAMES.get(code, "output")


def phase_code(phase: str) -> _Phase:
    """Returns the wire Phase for ``"prefill"``, ``"decode"`` or ``""`` (a plain forward).

    Raises:
        InvalidArgument: Unknown phase name.
    """
    try:
        return _PHASES[phase.strip().lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown phase {phase!r}; expected one of: {', '.join(repr(p) for p in _PHASES)}"
        ) from None


def phase_name(code: _Phase) -> str:
    """Returns the name of a wire Phase: ``""`` for a plain forward (and a phase newer than this client)."""
    return _PHASE_NAMES.get(code, "")


def derive_code(derive: str) -> telemetry_pb2.Derive.ValueType:
    """The wire Derive of ``"entropy"``, ``"top1_prob"`` or ``""`` (the tensor); InvalidArgument for another name."""
    if (code := _DERIVES.get(derive.strip().lower())) is None:
        raise InvalidArgument(f"unknown derive {derive!r}; expected one of: {', '.join(map(repr, _DERIVES))}")
    return code


def derive_name(code: telemetry_pb2.Derive.ValueType) -> str:
    """The name of a wire Derive: ``""`` for the tensor itself (and for a value newer than this client)."""
    return _DERIVE_NAMES.get(code, "")


@functools.cache
def field_plan(cls: Any, descriptor: Any) -> tuple[tuple[str, bool], ...]:
    """``cls``'s field names, each with whether the message's field is repeated; once per type.

    Why: looking the fields up per message cost ~3 us a message, and a stream
    converts five messages per summary, for every pass the server runs.
    """
    repeated = {fd.name for fd in descriptor.fields if fd.is_repeated}
    return tuple((f.name, f.name in repeated) for f in dataclasses.fields(cls))


def from_fields(cls: type[_D], msg: Any, **overrides: Any) -> _D:
    """Builds the dataclass ``cls`` from the same-named fields of ``msg``.

    Repeated fields become lists; ``overrides`` supply the fields that need a
    conversion (enums, nested messages, timestamps).
    """
    for name, repeated in field_plan(cls, msg.DESCRIPTOR):
        if name not in overrides:
            overrides[name] = list(getattr(msg, name)) if repeated else getattr(msg, name)
    return cls(**overrides)


def utc(msg: Any, name: str) -> _dt.datetime | None:
    """The Timestamp field ``name`` of ``msg`` as an aware UTC datetime; None when unset."""
    if not msg.HasField(name):
        return None
    stamp: Any = getattr(msg, name)
    when: _dt.datetime = stamp.ToDatetime(tzinfo=_dt.timezone.utc)
    return when
