"""The names of SetBaseline's taps: its default ids, and the prefix no other tap may take."""

from __future__ import annotations

import hashlib

from layertap.server.errors import InvalidField
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["BASELINE_PREFIX", "baseline_tap_id", "check_not_baseline_name"]

#: SetBaseline's default tap ids start so; other taps may not take such a name,
#: or a principal could take the id another's SetBaseline will use.
BASELINE_PREFIX = "baseline-"


def baseline_tap_id(req: pb.SetBaselineRequest) -> str:
    """The id of the durable tap a SetBaseline creates (or replaces)."""
    point = req.point or pb.POINT_OUTPUT
    return req.name or BASELINE_PREFIX + hashlib.sha1(f"{req.selector}|{point}".encode()).hexdigest()[:8]


def check_not_baseline_name(name: str, field: str) -> None:
    """InvalidField naming ``field`` when a tap other than a baseline asks for a baseline's name."""
    if name.startswith(BASELINE_PREFIX):
        raise InvalidField(field, f"names starting {BASELINE_PREFIX!r} are SetBaseline's own; pick another")
