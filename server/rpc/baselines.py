"""ExportBaseline and InstallBaseline: fleet-wide baselines, one reference for every replica.

Mixed into ``TelemetryService``. Both need the ``tap`` scope, as SetBaseline
does, and both act on a baseline tap of the caller's own unless the caller
also has ``admin``: installing over another principal's would replace it, and
exporting it would hand out its builders' reservoirs (samples of the layer's
values, the model's inputs for an ``input`` baseline).
"""

from __future__ import annotations

import grpc

from layertap.server.drift.exchange import frozen_to_bytes
from layertap.server.errors import grpc_errors
from layertap.server.limits import check_name
from layertap.server.rpc.auth import principal_of, require
from layertap.server.rpc.state import ServerState
from layertap.v1 import telemetry_pb2 as pb


class BaselineMethods:
    """The fleet-wide baseline RPCs, mixed into TelemetryService."""

    state: ServerState

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

    def _own(self, tap: str, context: grpc.ServicerContext, doing: str) -> None:
        """PermissionDenied unless ``tap`` is the caller's, or the caller has ``admin`` (or no such tap)."""
        owner = {t.id: t.owner for t in self.state.taps.all_taps()}.get(tap)
        if owner is not None and owner != principal_of(context).id:
            require(context, "admin", f"{doing} baseline {tap!r} of {owner or 'the server'!r}")
