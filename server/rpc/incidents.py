"""ListIncidents, GetIncident and DeleteIncident: the flight recorder's ring over gRPC.

All three need the ``capture`` scope: an incident holds a request's input
and the activations it produced.

An incident belongs to the owner of the tap whose trigger recorded it, as the
tap does (``""``, the server's, for ``--taps`` and for files written before
incidents had owners). ListIncidents shows a principal its own; reading or
deleting another's needs ``admin``, the rule DeleteTap and the baseline RPCs
apply to other principals' taps and baselines.

Another's incident is PERMISSION_DENIED, not NOT_FOUND: its id is no secret
from the caller. The recorder announces every id to the tap's subscribers
(a ``TapEvent`` of kind ``incident``), and ``read`` may subscribe to any tap,
so hiding that the id exists would protect nothing and would only make a
missing ``admin`` scope look like a typo, where taps and baselines say which
scope is missing.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from layertap.server.errors import Unsupported, grpc_errors
from layertap.server.record.recorder import Recorder
from layertap.server.record.store import check_id
from layertap.server.rpc.auth import principal_of
from layertap.server.rpc.ownership import require_owner
from layertap.server.rpc.state import StateBacked
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["IncidentsServicer"]

#: Tensor bytes per GetIncident chunk, as in Capture.
CHUNK_BYTES = 1 << 20


class IncidentsServicer(StateBacked):
    """The flight recorder's incidents: list, read and delete them."""

    def _recorder(self) -> Recorder:
        recorder = self.state.recorder
        if recorder is None:
            raise Unsupported("the flight recorder is off: start the server with --incident-dir", reason="RECORDER_OFF")
        return recorder

    def _own_incident(self, incident_id: str, context: grpc.ServicerContext, doing: str) -> None:
        """PermissionDenied unless the incident is the caller's, or the caller has ``admin``.

        Raises:
            InvalidField: Not an incident id.
            NotFound: No such incident.
            PermissionDenied: Another's, without ``admin``.
        """
        check_id(incident_id)
        owner = self._recorder().store.owner_of(incident_id)
        require_owner(context, owner, f"{doing} incident {incident_id}")

    @grpc_errors
    def ListIncidents(self, request: pb.ListIncidentsRequest, context: grpc.ServicerContext) -> pb.ListIncidentsResponse:
        store = self._recorder().store
        caller = principal_of(context)
        owner = None if caller.has("admin") else caller.id
        return pb.ListIncidentsResponse(incidents=store.entries(request.tap, owner), skipped_files=store.skipped_files)

    @grpc_errors
    def GetIncident(self, request: pb.GetIncidentRequest, context: grpc.ServicerContext) -> Iterator[pb.GetIncidentResponse]:
        self._own_incident(request.id, context, "reading")
        record, tensors = self._recorder().store.read(request.id)
        yield pb.GetIncidentResponse(incident=record)
        for tensor_id, t in enumerate(tensors):
            header = pb.CaptureHeader()
            header.CopyFrom(t.header)
            header.tensor_id = tensor_id
            header.num_chunks = -(-len(t.data) // CHUNK_BYTES)
            yield pb.GetIncidentResponse(header=header)
            for i, start in enumerate(range(0, len(t.data), CHUNK_BYTES)):
                yield pb.GetIncidentResponse(chunk=pb.CaptureChunk(
                    tensor_id=tensor_id, chunk_index=i, offset=start, data=t.data[start:start + CHUNK_BYTES]))

    @grpc_errors
    def DeleteIncident(self, request: pb.DeleteIncidentRequest, context: grpc.ServicerContext) -> pb.DeleteIncidentResponse:
        self._own_incident(request.id, context, "deleting")
        self._recorder().store.delete(request.id)
        return pb.DeleteIncidentResponse()
