"""``layertap.v1.TelemetryService``: layers, captures, taps, streams and drift."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from layertap.server.taps.capture import (
    CaptureSession,
    CaptureTooLarge,
    check_all_ran,
    describe,
    encode_pass,
    parse_options,
)
from layertap.server.errors import InvalidSpec, NotFound, Unavailable, grpc_errors
from layertap.server.drift.monitor import baseline_tap_id
from layertap.server.rpc.auth import principal_of, require
from layertap.server.rpc.inference import decode_inputs
from layertap.server.rpc.state import ServerState, StateBacked
from layertap.v1 import tensor_pb2
from layertap.v1 import telemetry_pb2 as pb
from layertap.v1 import telemetry_pb2_grpc

log = logging.getLogger("layertap.server")

#: How often a waiting stream re-checks that its client is still there.
POLL_SECONDS = 0.1
#: Largest per-subscriber queue a client may ask for.
MAX_QUEUE = 65536


class TapMethods:
    """CreateTap/DeleteTap/ListTaps/Subscribe, mixed into TelemetryService."""

    state: ServerState

    @grpc_errors
    def CreateTap(self, request: pb.CreateTapRequest, context: grpc.ServicerContext) -> pb.CreateTapResponse:
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else None
        tap = self.state.taps.create(request.spec, kind=pb.TAP_KIND_DURABLE, ttl=ttl, forever=request.forever,
                                     owner=principal_of(context).id)
        return pb.CreateTapResponse(tap=tap.info())

    @grpc_errors
    def DeleteTap(self, request: pb.DeleteTapRequest, context: grpc.ServicerContext) -> pb.DeleteTapResponse:
        tap = self.state.taps.get(request.id)
        if not tap.durable:
            raise InvalidSpec("id", f"{request.id!r} is a stream tap; it ends with its Subscribe stream")
        if tap.owner != principal_of(context).id:
            require(context, "admin", f"deleting tap {request.id!r} of {tap.owner or 'the server'!r}")
        self.state.taps.delete(request.id)
        return pb.DeleteTapResponse()

    @grpc_errors
    def ListTaps(self, request: pb.ListTapsRequest, context: grpc.ServicerContext) -> pb.ListTapsResponse:
        return pb.ListTapsResponse(taps=[t.info() for t in self.state.taps.all_taps()])

    @grpc_errors
    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[pb.SubscribeResponse]:
        state = self.state
        engine, broker = state.taps, state.broker
        if request.queue_size > MAX_QUEUE:
            raise InvalidSpec("queue_size", f"at most {MAX_QUEUE}, got {request.queue_size}")
        for i, tap_id in enumerate(request.tap_ids):
            try:
                engine.get(tap_id)
            except NotFound as exc:
                raise NotFound(f"tap_ids[{i}]: {exc}", field=f"tap_ids[{i}]") from None
        if request.stream_taps:
            require(context, "tap", "Subscribe with stream_taps")
        owner = principal_of(context).id
        stream_taps = []
        try:
            for i, spec in enumerate(request.stream_taps):
                stream_taps.append(engine.create(spec, kind=pb.TAP_KIND_STREAM, field_prefix=f"stream_taps[{i}]",
                                                 owner=owner))
            ids = [*request.tap_ids, *(t.id for t in stream_taps)]
            sub = broker.subscribe(ids or None, request.queue_size)
        except Exception:
            for t in stream_taps:
                engine.delete(t.id, reason="ended")
            raise
        done = threading.Event()

        def cleanup() -> None:
            if done.is_set():
                return
            done.set()
            broker.unsubscribe(sub)
            for t in stream_taps:
                try:
                    engine.delete(t.id, reason="ended")
                except Exception:  # noqa: BLE001 - already gone
                    pass

        # Stream taps and the queue go when the client does, even on SIGKILL.
        context.add_callback(cleanup)
        try:
            yield pb.SubscribeResponse(stream_tap_ids=[t.id for t in stream_taps])
            while context.is_active():
                batch = sub.get(timeout=POLL_SECONDS)
                if batch is None:
                    if sub.closed:
                        if broker.shutting_down:
                            raise Unavailable("the server is shutting down; reconnect to another replica or retry")
                        return
                    continue
                yield pb.SubscribeResponse(summaries=batch.summaries, events=batch.events, dropped=sub.dropped)
        finally:
            cleanup()



class TelemetryService(StateBacked, TapMethods, telemetry_pb2_grpc.TelemetryServiceServicer):
    """Looks inside the hosted model."""

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
    def SetBaseline(self, request: pb.SetBaselineRequest, context: grpc.ServicerContext) -> pb.SetBaselineResponse:
        me = principal_of(context).id
        current = {t.id: t.owner for t in self.state.taps.all_taps()}.get(baseline_tap_id(request))
        if current is not None and current != me:
            require(context, "admin", f"replacing baseline {baseline_tap_id(request)!r} of {current or 'the server'!r}")
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
    def GetServerStats(self, request: pb.GetServerStatsRequest, context: grpc.ServicerContext) -> pb.GetServerStatsResponse:
        return self.state.stats()

    @grpc_errors
    def Capture(self, request: pb.CaptureRequest, context: grpc.ServicerContext) -> Iterator[pb.CaptureResponse]:
        state = self.state
        try:
            opts = parse_options(request, state.host, state.capture_limits)
            inputs = decode_inputs(list(request.inputs), state) if request.inputs else None
            state.captures.acquire()
        except Exception as exc:
            state.count_capture(_code_of(exc), 0)
            raise
        session = CaptureSession(state.host, opts, max_bytes=state.capture_limits.max_bytes, active=inputs is not None)
        outcome: dict[str, Any] = {"code": "CANCELLED", "sent": 0}
        finished = threading.Event()

        def finish() -> None:
            # Runs once: on normal end, on error, or from gRPC's callback when
            # the client vanishes (a cancelled generator is never resumed).
            if finished.is_set():
                return
            finished.set()
            session.close()
            state.captures.release()
            state.count_capture(outcome["code"], outcome["sent"])
            log.info("capture end: code=%s bytes=%d", outcome["code"], outcome["sent"])

        log.info("capture start: %s active=%s", describe(opts), inputs is not None)
        context.add_callback(finish)
        try:
            session.open()
            if inputs is not None:
                state.host.run(inputs, active_owner=session)
            ids = itertools.count()
            for _ in range(opts.passes):
                rec = None
                while rec is None:
                    if not context.is_active():
                        return
                    rec = session.next_pass(POLL_SECONDS)
                if rec.too_large:
                    raise CaptureTooLarge(rec.too_large,
                                          metadata={"max_bytes": str(state.capture_limits.max_bytes)})
                check_all_ran(rec, opts)
                if rec.ordinal == opts.passes - 1:
                    session.close()  # the last pass is in hand: free the hooks now
                for msg in encode_pass(rec, opts, ids):
                    outcome["sent"] += len(msg.chunk.data)
                    yield msg
            outcome["code"] = "OK"
        except Exception as exc:
            outcome["code"] = _code_of(exc)
            raise
        finally:
            finish()


def _code_of(exc: BaseException) -> str:
    from layertap.server.errors import status_for

    return status_for(exc)[0].name


