"""Fleet-wide baselines: collect on every member, merge once, install one reference everywhere.

Per-member baselines freeze their histogram edges at their own quantiles, so
two ranks fed different data get different edges and their drift scores are
not comparable. :func:`set_fleet_baseline` drives instead:

1. ``SetBaseline(hold=True)`` on every member: each collects ``passes`` live
   passes and holds its builder instead of freezing it;
2. ``GetDrift`` until every member's layers hold ``passes`` passes;
3. ``ExportBaseline`` from every member: the builders' exact states;
4. ``InstallBaseline(builders=all states)`` on one member, which merges them
   (as if one builder had seen every pass) and freezes once;
5. ``InstallBaseline(frozen=those documents)`` on the others,

so every member scores drift against the same edges and the same counts. A
member that fails on the way becomes a :class:`FleetError` and the reference
is built from the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from . import _convert
from ._client import Client
from ._errors import DeadlineExceeded, InvalidArgument, LayertapError
from ._types import BaselineInfo, DriftThresholds
from .v1 import telemetry_pb2

T = TypeVar("T")

#: Seconds between GetDrift polls while the members collect.
POLL_SECONDS = 0.2

#: Runs a call on each client concurrently; keeps the answers, records the failures.
Each = Callable[[Sequence[Client], Callable[[Client], Any]], list[tuple[Client, Any]]]


def _call(c: Client, timeout: float | None, fn: Callable[[Any, float | None], T]) -> T:
    """One TelemetryService call on ``c``, its errors translated as the client's own."""
    with c._translating(layer_hint=True):
        return fn(c._telemetry, c._deadline(timeout))


def set_fleet_baseline(
    clients: Sequence[Client],
    each: Each,
    fail: Callable[[Client, LayertapError], None],
    selector: str,
    *,
    passes: int,
    window: int,
    point: str,
    thresholds: DriftThresholds | Mapping[str, float] | None,
    name: str | None,
    wait: float,
    timeout: float | None,
) -> list[tuple[Client, BaselineInfo]]:
    """See :meth:`Fleet.set_baseline`; returns the members that installed the reference."""
    if not wait > 0:
        raise InvalidArgument(f"wait must be > 0 seconds, got {wait}")
    req = _convert.set_baseline_request(selector, passes=passes, window=window, point=point, thresholds=thresholds)
    req.hold = True
    if name:
        req.name = name
    started: list[tuple[Client, telemetry_pb2.SetBaselineResponse]] = each(
        clients, lambda c: _call(c, timeout, lambda stub, t: stub.SetBaseline(req, timeout=t)))
    if not started:
        return []
    taps = {resp.tap for _, resp in started}
    if len(taps) > 1:  # the same request everywhere: a member answering otherwise is broken
        raise InvalidArgument(f"members named the baseline tap differently: {sorted(taps)}")
    tap = taps.pop()
    members = [c for c, _ in started]

    deadline = time.monotonic() + wait
    while True:
        polled = each(members, lambda c: [d for d in c.drift(timeout=timeout) if d.tap == tap])
        members = [c for c, _ in polled]
        waiting = [c.target for c, layers in polled if not layers or any(d.baseline_passes < passes for d in layers)]
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"baseline {tap!r}: {', '.join(waiting)} still collecting after {wait:g} s; "
                                   "they hold their passes: feed them traffic, or call set_baseline again")
        time.sleep(POLL_SECONDS)

    export = telemetry_pb2.ExportBaselineRequest(tap=tap)
    exported: list[tuple[Client, telemetry_pb2.ExportBaselineResponse]] = each(
        members, lambda c: _call(c, timeout, lambda stub, t: stub.ExportBaseline(export, timeout=t)))
    builders = [layer.builder for _, resp in exported for layer in resp.layers
                if layer.WhichOneof("value") == "builder"]
    members = [c for c, _ in exported]
    merge = telemetry_pb2.InstallBaselineRequest(tap=tap, builders=builders)
    while members:  # the first member that answers freezes the reference for all
        first = members.pop(0)
        try:
            resp = _call(first, timeout, lambda stub, t: stub.InstallBaseline(merge, timeout=t))
        except LayertapError as exc:
            fail(first, exc)
            continue
        installed = [(first, BaselineInfo(tap=tap, layers=list(resp.layers)))]
        same = telemetry_pb2.InstallBaselineRequest(tap=tap, frozen=resp.frozen)
        rest: list[tuple[Client, telemetry_pb2.InstallBaselineResponse]] = each(
            members, lambda c: _call(c, timeout, lambda stub, t: stub.InstallBaseline(same, timeout=t)))
        return installed + [(c, BaselineInfo(tap=tap, layers=list(r.layers))) for c, r in rest]
    return []
