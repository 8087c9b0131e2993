"""Drift baselines: one server's (``client.baselines``), and one for a whole fleet.

:class:`Baselines` is the sub-client behind ``client.baselines``
(``Client.set_baseline`` and ``Client.drift`` are its older spellings); its
calls go through the client's transport.

Fleet-wide baselines collect on every member, merge once and install one
reference everywhere. Per-member baselines freeze their histogram edges at
their own quantiles, so two ranks fed different data get different edges and
their drift scores are not comparable. :func:`set_fleet_baseline` drives
instead, through each member's ``baselines``:

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

A member that joined later (a replica added by scaling up) lacks that
reference. :func:`spread_fleet_baseline` copies it there unchanged: the frozen
documents of a member that holds it (``ExportBaseline``), installed with
``InstallBaseline(frozen=...)`` on each member without it, once a held
``SetBaseline`` of the same request has made the tap there.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from . import _convert
from ._convert_base import derive_name
from ._errors import DeadlineExceeded, InvalidArgument, LayertapError, NotFound
from ._transport import Transport, Unary
from ._types import BaselineInfo, DriftThresholds, LayerDrift
from .v1 import telemetry_pb2

SET_BASELINE = Unary.of("TelemetryService", "SetBaseline", telemetry_pb2.SetBaselineRequest, telemetry_pb2.SetBaselineResponse)
GET_DRIFT = Unary.of("TelemetryService", "GetDrift", telemetry_pb2.GetDriftRequest, telemetry_pb2.GetDriftResponse)
EXPORT_BASELINE = Unary.of("TelemetryService", "ExportBaseline", telemetry_pb2.ExportBaselineRequest, telemetry_pb2.ExportBaselineResponse)
SET_RATE = Unary.of("TelemetryService", "SetDriftFalseAlarmRate", telemetry_pb2.SetDriftFalseAlarmRateRequest,
                    telemetry_pb2.SetDriftFalseAlarmRateResponse)
INSTALL_BASELINE = Unary.of("TelemetryService", "InstallBaseline", telemetry_pb2.InstallBaselineRequest, telemetry_pb2.InstallBaselineResponse)

#: Seconds between GetDrift polls while the members collect.
POLL_SECONDS = 0.2


class Baselines:
    """Drift baselines and drift scores of the server a :class:`~layertap.Client` talks to.

    Reached as ``client.baselines``.

    Example:
        >>> client.baselines.set("layer*", passes=100)  # freeze a reference from live passes
        >>> for d in client.baselines.drift():
        ...     print(d.layer, d.psi)
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def set(
        self,
        selector: str,
        *,
        passes: int = 500,
        window: int = 50,
        point: str = "output",
        thresholds: DriftThresholds | Mapping[str, float] | None = None,
        name: str = "",
        derive: str = "",
        timeout: float | None = None,
    ) -> BaselineInfo:
        """Freezes a drift baseline from the next ``passes`` live passes.

        Args:
            selector: Layers to baseline (tap selector syntax).
            passes: Live passes that make up the baseline.
            window: Sliding window of current passes compared with it.
            point: Where to read the tensor.
            thresholds: Drift thresholds, as a :class:`DriftThresholds` or a
                mapping with keys psi, js, wasserstein, mean_shift (missing keys
                take the server defaults 0.2, 0.1, 0.1, 1.0).
            name: The baseline tap's id (default: ``baseline-<hash>`` of the
                selector and point, suffixed ``-<derive>`` for a derived one).
                Calling again with the same name resets it.
            derive: Baseline a quantity derived from the tensor: ``"entropy"``
                or ``"top1_prob"`` of the softmax over its last axis, per token
                (a ``(batch, tokens, vocab)`` head gives one value per token),
                so drift scores the model's confidence. ``""``: the tensor.
                Its file in ``--baseline-dir`` names the derive (baseline
                schema v4), so a restart reloads it as it was.
            timeout: Deadline override in seconds.

        Returns:
            The durable tap collecting the baseline and the layers it covers.
        """
        req = _convert.set_baseline_request(
            selector, passes=passes, window=window, point=point, thresholds=thresholds, name=name, derive=derive
        )
        return _convert.baseline_from_proto(self._transport.unary(SET_BASELINE, req, timeout=timeout, layer_hint=True))

    def drift(self, selector: str = "", *, timeout: float | None = None) -> list[LayerDrift]:
        """Returns the current drift scores, optionally filtered by a layer selector."""
        req = telemetry_pb2.GetDriftRequest(selector=selector)
        return _convert.drift_from_proto(self._transport.unary(GET_DRIFT, req, timeout=timeout, layer_hint=True))

    def set_false_alarm_rate(self, rate: float, *, timeout: float | None = None) -> int:
        """Sets the server-wide false-alarm rate per window of the calibrated drift alarms (needs ``admin``).

        The rate is split evenly across the calibrated layers; their thresholds
        are recomputed from each baseline's saved null statistics, without new
        passes. Returns the number of calibrated layers it is split across.
        """
        req = telemetry_pb2.SetDriftFalseAlarmRateRequest(rate=rate)
        return int(self._transport.unary(SET_RATE, req, timeout=timeout).calibrated_layers)

    # The steps of Fleet.set_baseline (below): protobuf in and out, for this module only.

    def hold(self, req: telemetry_pb2.SetBaselineRequest, *, timeout: float | None) -> str:
        """SetBaseline with ``hold`` set: collects and holds its builders; returns the tap."""
        return self._transport.unary(SET_BASELINE, req, timeout=timeout, layer_hint=True).tap

    def export(self, req: telemetry_pb2.ExportBaselineRequest, *,
               timeout: float | None) -> telemetry_pb2.ExportBaselineResponse:
        """ExportBaseline: each layer's builder state (or frozen reference)."""
        return self._transport.unary(EXPORT_BASELINE, req, timeout=timeout, layer_hint=True)

    def install(self, req: telemetry_pb2.InstallBaselineRequest, *,
                timeout: float | None) -> telemetry_pb2.InstallBaselineResponse:
        """InstallBaseline: merges builders and freezes, or installs frozen references."""
        return self._transport.unary(INSTALL_BASELINE, req, timeout=timeout, layer_hint=True)


class Member(Protocol):
    """What a fleet baseline needs of each :class:`~layertap.Client`."""

    @property
    def target(self) -> str: ...

    @property
    def baselines(self) -> Baselines: ...


M = TypeVar("M", bound=Member)

#: Runs a call on each member concurrently; keeps the answers, records the failures.
Each = Callable[[Sequence[M], Callable[[M], Any]], list[tuple[M, Any]]]


def set_fleet_baseline(
    clients: Sequence[M],
    each: Each[M],
    fail: Callable[[M, LayertapError], None],
    selector: str,
    *,
    passes: int,
    window: int,
    point: str,
    thresholds: DriftThresholds | Mapping[str, float] | None,
    name: str | None,
    derive: str = "",
    wait: float,
    timeout: float | None,
) -> list[tuple[M, BaselineInfo]]:
    """See :meth:`Fleet.set_baseline`; returns the members that installed the reference."""
    if not wait > 0:
        raise InvalidArgument(f"wait must be > 0 seconds, got {wait}")
    req = _convert.set_baseline_request(selector, passes=passes, window=window, point=point, thresholds=thresholds,
                                        derive=derive)
    req.hold = True
    if name:
        req.name = name
    started: list[tuple[M, str]] = each(clients, lambda c: c.baselines.hold(req, timeout=timeout))
    if not started:
        return []
    taps = {started_tap for _, started_tap in started}
    if len(taps) > 1:  # the same request everywhere: a member answering otherwise is broken
        raise InvalidArgument(f"members named the baseline tap differently: {sorted(taps)}")
    tap = taps.pop()
    members = [c for c, _ in started]

    deadline = time.monotonic() + wait
    while True:
        polled = each(members, lambda c: [d for d in c.baselines.drift(timeout=timeout) if d.tap == tap])
        members = [c for c, _ in polled]
        waiting = [c.target for c, layers in polled if not layers or any(d.baseline_passes < passes for d in layers)]
        if not waiting:
            break
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"baseline {tap!r}: {', '.join(waiting)} still collecting after {wait:g} s; "
                                   "they hold their passes: feed them traffic, or call set_baseline again")
        time.sleep(POLL_SECONDS)

    export = telemetry_pb2.ExportBaselineRequest(tap=tap)
    exported: list[tuple[M, telemetry_pb2.ExportBaselineResponse]] = each(
        members, lambda c: c.baselines.export(export, timeout=timeout))
    builders = [layer.builder for _, resp in exported for layer in resp.layers
                if layer.WhichOneof("value") == "builder"]
    members = [c for c, _ in exported]
    merge = telemetry_pb2.InstallBaselineRequest(tap=tap, builders=builders)
    while members:  # the first member that answers freezes the reference for all
        first = members.pop(0)
        try:
            resp = first.baselines.install(merge, timeout=timeout)
        except LayertapError as exc:
            fail(first, exc)
            continue
        installed = [(first, BaselineInfo(tap=tap, layers=list(resp.layers)))]
        same = telemetry_pb2.InstallBaselineRequest(tap=tap, frozen=resp.frozen)
        rest: list[tuple[M, telemetry_pb2.InstallBaselineResponse]] = each(
            members, lambda c: c.baselines.install(same, timeout=timeout))
        return installed + [(c, BaselineInfo(tap=tap, layers=list(r.layers))) for c, r in rest]
    return []


def baseline_tap_id(req: telemetry_pb2.SetBaselineRequest) -> str:
    """The tap a SetBaseline request creates, as the server names it: its ``name``, else
    ``baseline-`` and a hash of selector and point, suffixed ``-<derive>`` for a derived one
    (``layertap.server.drift.names``; tests/e2e/test_fleet_spread.py checks that the two agree)."""
    if req.name:
        return req.name
    point = req.point or telemetry_pb2.POINT_OUTPUT
    plain = "baseline-" + hashlib.sha1(f"{req.selector}|{point}".encode()).hexdigest()[:8]
    derive = derive_name(req.derive)
    return f"{plain}-{derive}" if derive else plain


def spread_fleet_baseline(
    clients: Sequence[M],
    each: Each[M],
    fail: Callable[[M, LayertapError], None],
    selector: str,
    *,
    window: int,
    point: str,
    thresholds: DriftThresholds | Mapping[str, float] | None,
    name: str | None,
    derive: str = "",
    timeout: float | None,
) -> list[tuple[M, BaselineInfo]]:
    """See :meth:`Fleet.spread_baseline`; returns the members that installed the copy.

    Raises:
        NotFound: No member holds the baseline frozen.
    """
    req = _convert.set_baseline_request(selector, passes=1, window=window, point=point, thresholds=thresholds,
                                        derive=derive)
    req.hold = True  # the tap only: its reference is installed, never collected
    if name:
        req.name = name
    tap = baseline_tap_id(req)
    states: list[tuple[M, list[str]]] = each(
        clients, lambda c: [d.state for d in c.baselines.drift(timeout=timeout) if d.tap == tap])
    frozen = [c for c, held in states if held and all(s in ("ready", "unsaved") for s in held)]
    missing = [c for c, held in states if c not in frozen]
    for source in frozen:  # the first that exports it gives the reference
        try:
            exported = source.baselines.export(telemetry_pb2.ExportBaselineRequest(tap=tap), timeout=timeout)
        except LayertapError as exc:
            fail(source, exc)
            continue
        docs = [layer.frozen for layer in exported.layers if layer.WhichOneof("value") == "frozen"]
        if docs:
            break
    else:
        raise NotFound(f"baseline {tap!r}: no member holds it frozen; install it with set_baseline first")
    install = telemetry_pb2.InstallBaselineRequest(tap=tap, frozen=docs)

    def copy(c: M) -> BaselineInfo:
        made = c.baselines.hold(req, timeout=timeout)
        if made != tap:  # the same request everywhere: a member answering otherwise is broken
            raise InvalidArgument(f"{c.target} named the baseline tap {made!r}, not {tap!r}")
        return BaselineInfo(tap=tap, layers=list(c.baselines.install(install, timeout=timeout).layers))

    copied: list[tuple[M, BaselineInfo]] = each(missing, copy)
    return copied
