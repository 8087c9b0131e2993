"""ExportBaseline and InstallBaseline: fleet-wide baselines, one reference for every replica.

Mixed into ``TelemetryService``. Both need the ``tap`` scope, as SetBaseline
does; installing over a baseline tap another principal owns also needs
``admin``, as replacing it would.
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
        return pb.ExportBaselineResponse(layers=self.state.drift.export(request.tap))

    @grpc_errors
    def InstallBaseline(self, request: pb.InstallBaselineRequest, context: grpc.ServicerContext) -> pb.InstallBaselineResponse:
        check_name(request.tap, "tap")
        owner = {t.id: t.owner for t in self.state.taps.all_taps()}.get(request.tap)
        if owner is not None and owner != principal_of(context).id:
            require(context, "admin", f"installing on baseline {request.tap!r} of {owner or 'the server'!r}")
        installed = self.state.drift.install(request)
        return pb.InstallBaselineResponse(layers=[b.layer for b in installed],
                                          frozen=[frozen_to_bytes(b) for b in installed])
