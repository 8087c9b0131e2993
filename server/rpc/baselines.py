"""SetBaseline, GetDrift, ExportBaseline, InstallBaseline and SetDriftFalseAlarmRate: baselines and drift against them.

SetBaseline builds a baseline on a tap of its own; GetDrift scores the live
summaries against it. ExportBaseline and InstallBaseline carry a fleet-wide
baseline, one reference for every replica. All but GetDrift need the ``tap``
scope and act on a baseline tap of the caller's own unless the caller also
has ``admin``: installing over another principal's would replace it, and
exporting it would hand out its builders' reservoirs (samples of the layer's
values, the model's inputs for an ``input`` baseline).
"""

from __future__ import annotations

import grpc

from layertap.server.drift.exchange import frozen_to_bytes
from layertap.server.drift.names import baseline_tap_id, check_not_baseline_name
from layertap.server.errors import NotFound, grpc_errors
from layertap.server.limits import check_name
from layertap.server.rpc.auth import principal_of
from layertap.server.rpc.ownership import require_owner
from layertap.server.rpc.state import StateBacked
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["BaselinesServicer"]


class BaselinesServicer(StateBacked):
    """Baselines (set, export, install) and the drift scored against them."""

    @grpc_errors
    def SetBaseline(self, request: pb.SetBaselineRequest, context: grpc.ServicerContext) -> pb.SetBaselineResponse:
        me = principal_of(context).id
        check_not_baseline_name(request.name, "name")  # the derived ids' namespace: no one names into it
        self._own(baseline_tap_id(request), context, "replacing")
        tap, layers = self.state.drift.set_baseline(request)
        try:
            self.state.taps.get(tap).owner = me
        except NotFound:  # deleted meanwhile
            pass
        return pb.SetBaselineResponse(tap=tap, layers=layers)

    @grpc_errors
    def GetDrift(self, request: pb.GetDriftRequest, context: grpc.ServicerContext) -> pb.GetDriftResponse:
        return pb.GetDriftResponse(layers=self.state.drift.drift(request.selector))

    @grpc_errors
    def ExportBaseline(self, request: pb.ExportBaselineRequest, context: grpc.ServicerContext) -> pb.ExportBaselineResponse:
        check_name(request.tap, "tap")
        self._own(request.tap, context, "exporting")
        return pb.ExportBaselineResponse(layers=self.state.drift.export(request.tap))

    @grpc_errors
    def InstallBaseline(self, request: pb.InstallBaselineRequest, context: grpc.ServicerContext) -> pb.InstallBaselineResponse:
        check_name(request.tap, "tap")
        self._own(request.tap, context, "installing on")
        installed = self.state.drift.install(request)
        return pb.InstallBaselineResponse(layers=[b.layer for b in installed],
                                          frozen=[frozen_to_bytes(b) for b in installed])

    @grpc_errors
    def SetDriftFalseAlarmRate(self, request: pb.SetDriftFalseAlarmRateRequest,
                               context: grpc.ServicerContext) -> pb.SetDriftFalseAlarmRateResponse:
        layers = self.state.drift.set_false_alarm_rate(request.rate)
        return pb.SetDriftFalseAlarmRateResponse(rate=self.state.drift.false_alarm_rate, calibrated_layers=layers)

    def _own(self, tap: str, context: grpc.ServicerContext, doing: str) -> None:
        """PermissionDenied unless ``tap`` is the caller's, or the caller has ``admin`` (or no such tap)."""
        owner = {t.id: t.owner for t in self.state.taps.all_taps()}.get(tap)
        if owner is not None:
            require_owner(context, owner, f"{doing} baseline {tap!r}")
