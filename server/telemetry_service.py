"""``layertap.v1.TelemetryService``: layers, captures, taps, streams and drift."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import grpc

from layertap.server.capture import CaptureSession, CaptureTooLarge, describe, encode_pass, parse_options
from layertap.server.errors import grpc_errors
from layertap.server.inference_service import decode_inputs
from layertap.server.state import ServerState, StateCell
from layertap.v1 import tensor_pb2
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

log = logging.getLogger("layertap.server")

#: How often a waiting stream re-checks that its client is still there.
POLL_SECONDS = 0.1


class TelemetryService(telemetry_pb2_grpc.TelemetryServiceServicer):
    """Looks inside the hosted model."""

    def __init__(self, cell: StateCell) -> None:
        self._cell = cell

    @property
    def state(self) -> ServerState:
        return self._cell.get()

    @grpc_errors
    def ListLayers(self, request: pb.ListLayersRequest, context: grpc.ServicerContext) -> pb.ListLayersResponse:
        host = self.state.host
        host.arm_shape_probe()
        layers = []
        for name in host.layer_names:
            module = host.modules[name]
            shapes = host.layer_shapes.get(name)
            layers.append(pb.LayerInfo(
                name=name,
                type=type(module).__name__,
                parameter_count=sum(p.numel() for p in module.parameters()),
                input_shapes=[tensor_pb2.Shape(dims=list(s)) for s in (shapes.inputs if shapes else [])],
                output_shapes=[tensor_pb2.Shape(dims=list(s)) for s in (shapes.outputs if shapes else [])],
            ))
        return pb.ListLayersResponse(layers=layers, active_hooks=host.hooks.active)

    @grpc_errors
    def GetServerStats(self, request: pb.GetServerStatsRequest, context: grpc.ServicerContext) -> pb.GetServerStatsResponse:
        return self.state.stats()

    @grpc_errors
    def Capture(self, request: pb.CaptureRequest, context: grpc.ServicerContext) -> Iterator[pb.CaptureResponse]:
        state = self.state
        code = "OK"
        try:
            opts = parse_options(request, state.host, state.capture_limits)
            inputs = decode_inputs(list(request.inputs), state) if request.inputs else None
            state.captures.acquire()
        except Exception as exc:
            code = _code_of(exc)
            state.count_capture(code, 0)
            raise
        sent = 0
        session = CaptureSession(state.host, opts, max_bytes=state.capture_limits.max_bytes, active=inputs is not None)
        log.info("capture start: %s active=%s", describe(opts), inputs is not None)
        # Hooks must go even when the client vanishes mid-stream.
        context.add_callback(session.close)
        try:
            session.open()
            if inputs is not None:
                state.host.run(inputs, active_owner=session)
            ids = itertools.count()
            for _ in range(opts.passes):
                rec = None
                while rec is None:
                    if not context.is_active():
                        code = "CANCELLED"
                        return
                    rec = session.next_pass(POLL_SECONDS)
                if rec.too_large:
                    raise CaptureTooLarge(rec.too_large)
                if rec.ordinal == opts.passes - 1:
                    session.close()  # the last pass is in hand: free the hooks now
                for msg in encode_pass(rec, opts, ids):
                    sent += len(msg.chunk.data)
                    yield msg
        except Exception as exc:
            code = _code_of(exc)
            raise
        finally:
            session.close()
            state.captures.release()
            state.count_capture(code, sent)
            log.info("capture end: code=%s bytes=%d", code, sent)


def _code_of(exc: BaseException) -> str:
    from layertap.server.errors import status_for

    return status_for(exc)[0].name
