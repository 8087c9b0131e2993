"""What a fleet call gives back: each value tagged with its member, and the members that failed.

Apart from :mod:`layertap._fleet` so that both the fan-out there and the
merged stream (:mod:`layertap._fleet_stream`) build them without importing
each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ._errors import LayertapError

__all__ = ["FleetError", "FleetItem", "FleetResult"]

T = TypeVar("T")


@dataclass(frozen=True)
class FleetItem(Generic[T]):
    """One result of a fleet call, with where it came from.

    Attributes:
        target: The ``host:port`` that answered.
        rank: That agent's ``torch.distributed`` rank; None for a serving replica.
        value: The result itself (a :class:`LayerInfo`, a :class:`Summary`...).
    """

    target: str
    rank: int | None
    value: T


@dataclass(frozen=True)
class FleetError:
    """A target whose call failed; the others' results stand.

    Attributes:
        target: The ``host:port`` that failed, or a ``dns:`` target that resolves to no member.
        rank: Its rank when it was known from an earlier answer, else None.
        error: The client's typed error (``ServerUnavailable`` for a target that is down).
    """

    target: str
    rank: int | None
    error: LayertapError


@dataclass(frozen=True)
class FleetResult(Generic[T]):
    """The merged answer of every target: iterate it for :class:`FleetItem` objects.

    Items come in target order (the order given to :class:`Fleet`), each
    target's items in its own order.
    """

    items: list[FleetItem[T]] = field(default_factory=list)
    errors: list[FleetError] = field(default_factory=list)

    def __iter__(self) -> Iterator[FleetItem[T]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def ok(self) -> bool:
        """True when every target answered."""
        return not self.errors

    def by_target(self) -> dict[str, list[T]]:
        """Target -> its values (targets that failed are absent)."""
        out: dict[str, list[T]] = {}
        for item in self.items:
            out.setdefault(item.target, []).append(item.value)
        return out
