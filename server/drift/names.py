"""The names of SetBaseline's taps: its default ids (a derived one suffixed by its derive), and the prefix no other tap may take."""

from __future__ import annotations

import hashlib

from layertap.server.errors import InvalidField
from layertap.server.reducers.derive import DERIVE_NAMES, derivation
from layertap.server.reducers.spec import SpecError
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["BASELINE_PREFIX", "baseline_tap_id", "check_derive", "check_not_baseline_name"]

#: SetBaseline's default tap ids start so; other taps may not take such a name,
#: or a principal could take the id another's SetBaseline will use.
BASELINE_PREFIX = "baseline-"


def baseline_tap_id(req: pb.SetBaselineRequest) -> str:
    """The id of the durable tap a SetBaseline creates (or replaces)."""
    point = req.point or pb.POINT_OUTPUT
    if req.name:
        return req.name
    plain = BASELINE_PREFIX + hashlib.sha1(f"{req.selector}|{point}".encode()).hexdigest()[:8]
    # A derived baseline is another tap than the plain one on the same layers: both may run.
    return f"{plain}-{DERIVE_NAMES[req.derive]}" if req.derive in DERIVE_NAMES else plain


def check_derive(value: int) -> None:
    """InvalidField naming ``derive`` for a ``Derive`` value this server does not know."""
    try:
        derivation(value, "derive")
    except SpecError as exc:
        raise InvalidField(exc.field, exc.message) from None


def check_not_baseline_name(name: str, field: str) -> None:
    """InvalidField naming ``field`` when a tap other than a baseline asks for a baseline's name."""
    if name.startswith(BASELINE_PREFIX):
        raise InvalidField(field, f"names starting {BASELINE_PREFIX!r} are SetBaseline's own; pick another")
