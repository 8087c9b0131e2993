"""ListIncidents, GetIncident and DeleteIncident: the flight recorder's ring over gRPC.

Mixed into ``TelemetryService``. All three need the ``capture`` scope: an
incident holds a request's input and the activations it produced.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from layertap.server.errors import Unsupported, grpc_errors
from layertap.server.record.recorder import Recorder
from layertap.server.record.store import check_id
from layertap.server.rpc.state import ServerState
from layertap.v1 import telemetry_pb2 as pb

#: Tensor bytes per GetIncident chunk, as in Capture.
CHUNK_BYTES = 1 << 20


class IncidentMethods:
    """The incident RPCs, mixed into TelemetryService."""

    state: ServerState

    def _recorder(self) -> Recorder:
        recorder = self.state.recorder
        if recorder is None:
            raise Unsupported("the flight recorder is off: start the server with --incident-dir", reason="RECORDER_OFF")
        return recorder

    @grpc_errors
    def ListIncidents(self, request: pb.ListIncidentsRequest, context: grpc.ServicerContext) -> pb.ListIncidentsResponse:
        store = self._recorder().store
        return pb.ListIncidentsResponse(incidents=store.entries(request.tap), skipped_files=store.skipped_files)

    @grpc_errors
    def GetIncident(self, request: pb.GetIncidentRequest, context: grpc.ServicerContext) -> Iterator[pb.GetIncidentResponse]:
        check_id(request.id)
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
        self._recorder().store.delete(request.id)
        return pb.DeleteIncidentResponse()
