"""CreateTap, DeleteTap, ListTaps, Subscribe and Capture: the taps, their streams and captures."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from layertap.server.errors import InvalidField, NotFound, Unavailable, grpc_errors, status_for
from layertap.server.host.inputs import ModelInputs
from layertap.server.rpc.auth import principal_of, require
from layertap.server.rpc.inference import decode_inputs
from layertap.server.rpc.method_handlers import sends_wire_bytes
from layertap.server.rpc.ownership import create_owned, require_owner
from layertap.server.rpc.state import ServerState, StateBacked
from layertap.server.taps.capture import CapturedPass, CaptureSession, check_all_ran
from layertap.server.taps.capture_limits import CaptureSlot
from layertap.server.taps.capture_options import describe, parse_options
from layertap.server.taps.capture_wire import encode_pass
from layertap.server.taps.engine import TapEngine
from layertap.server.taps.tap import Tap
from layertap.v1 import telemetry_pb2 as pb

__all__ = ["CaptureCall", "TapsServicer", "create_owned"]

log = logging.getLogger("layertap.server")

#: How often a waiting stream re-checks that its client is still there.
POLL_SECONDS = 0.1
#: Largest per-subscriber queue a client may ask for.
MAX_QUEUE = 65536


def deliver(engine: TapEngine, summaries: Sequence[pb.Summary], seconds: float, owner: str) -> None:
    """Charges a stream's CPU time building and serializing a batch to the batch's taps, by their summaries
    (sampled and unsampled apart): with thirty subscribers it is thirty times one's, off both the model
    thread and the host-transfer thread, but on the same GIL.

    Only to the subscriber's own governed taps (``owner``): a reader following every durable tap must not
    get another principal's taps thinned, nor the server's own (never thinned) shrink everyone's room.
    """
    if not summaries or not engine.governor.on:
        return
    counts: dict[tuple[str, bool], int] = {}
    for s in summaries:
        key = (s.tap, s.unsampled)
        counts[key] = counts.get(key, 0) + 1
    each = seconds / len(summaries)
    for (tap_id, unsampled), n in counts.items():
        tap = engine.find(tap_id)
        if tap is not None and tap.governed and tap.owner == owner:
            tap.deliver(each * n, always=unsampled)


def _stream_tap(engine: TapEngine, spec: pb.TapSpec, context: grpc.ServicerContext, owner: str, field: str,
                taken: Sequence[Tap]) -> Tap:
    """The subscriber's stream tap for ``spec``: a live one it shares with the principal's other subscribers
    of the same spec (``taps.shared_streams``), else a new one. A spec listed twice in one request (``taken``)
    gets a second tap, as it always did."""
    while (tap_id := engine.streams.join(spec, owner)) is not None:
        tap = engine.find(tap_id)
        if tap is not None and tap in taken:
            engine.streams.leave(tap_id)  # this join undone: the request holds the tap already, never its last
            break
        if tap is not None and not tap.disabled:
            return tap
        # Gone or failed: no one joins it again, and those who follow it keep their places.
        engine.streams.unshare(tap_id)
        if engine.streams.leave(tap_id) and tap is not None:
            try:
                engine.delete(tap_id, reason="ended")  # a failed tap no one follows any more
            except NotFound:
                pass
    tap = create_owned(engine, spec, context, kind=pb.TAP_KIND_STREAM, field_prefix=field)
    engine.streams.add(tap.id, spec, owner)
    return tap


class TapsServicer(StateBacked):
    """The taps: create, delete and list them, stream their summaries, capture a pass's tensors."""

    @grpc_errors
    def CreateTap(self, request: pb.CreateTapRequest, context: grpc.ServicerContext) -> pb.CreateTapResponse:
        # Not ToTimedelta(): seconds beyond timedelta's range raise OverflowError;
        # check_ttl refuses what is out of range, naming the field.
        ttl = request.ttl.seconds + request.ttl.nanos / 1e9 if request.HasField("ttl") else None
        tap = create_owned(self.state.taps, request.spec, context, kind=pb.TAP_KIND_DURABLE, ttl=ttl,
                           forever=request.forever)
        return pb.CreateTapResponse(tap=tap.info())

    @grpc_errors
    def DeleteTap(self, request: pb.DeleteTapRequest, context: grpc.ServicerContext) -> pb.DeleteTapResponse:
        tap = self.state.taps.get(request.id)
        if not tap.durable:
            raise InvalidField("id", f"{request.id!r} is a stream tap; it ends with its Subscribe stream")
        require_owner(context, tap.owner, f"deleting tap {request.id!r}")
        self.state.taps.delete(request.id)
        return pb.DeleteTapResponse()

    @grpc_errors
    def ListTaps(self, request: pb.ListTapsRequest, context: grpc.ServicerContext) -> pb.ListTapsResponse:
        return pb.ListTapsResponse(taps=[t.info() for t in self.state.taps.all_taps()])

    @sends_wire_bytes
    @grpc_errors
    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialized SubscribeResponse messages: serialized here, so that the time a stream's thread spends
        on each batch is measured and charged to its taps for the overhead budget (``Tap.deliver``)."""
        state = self.state
        engine, broker = state.taps, state.broker
        if request.queue_size > MAX_QUEUE:
            raise InvalidField("queue_size", f"at most {MAX_QUEUE}, got {request.queue_size}")
        for i, tap_id in enumerate(request.tap_ids):
            try:
                engine.get(tap_id)
            except NotFound as exc:
                raise NotFound(f"tap_ids[{i}]: {exc}", field=f"tap_ids[{i}]") from None
        if request.stream_taps:
            require(context, "tap", "Subscribe with stream_taps")
        me = principal_of(context).id
        stream_taps: list[Tap] = []

        def leave() -> None:
            for t in stream_taps:
                if engine.streams.leave(t.id):  # its last subscriber: the tap ends
                    try:
                        engine.delete(t.id, reason="ended")
                    except Exception:  # noqa: BLE001 - already gone
                        pass

        try:
            for i, spec in enumerate(request.stream_taps):
                stream_taps.append(_stream_tap(engine, spec, context, me, f"stream_taps[{i}]", stream_taps))
            ids = [*request.tap_ids, *(t.id for t in stream_taps)]
            sub = broker.subscribe(ids or None, request.queue_size)
        except Exception:
            leave()
            raise
        once = threading.Lock()

        def cleanup() -> None:
            # Once, atomically: gRPC's callback and the generator's end may both come here, and a second
            # leave() would take another subscriber's place in a shared tap (and end its stream with it).
            if not once.acquire(blocking=False):
                return
            broker.unsubscribe(sub)
            leave()

        # Stream taps and the queue go when the client does, even on SIGKILL.
        context.add_callback(cleanup)
        try:
            yield pb.SubscribeResponse(stream_tap_ids=[t.id for t in stream_taps]).SerializeToString()
            while context.is_active():
                batch = sub.get(timeout=POLL_SECONDS)
                if batch is None:
                    if sub.closed:
                        if broker.shutting_down:
                            raise Unavailable("the server is shutting down; reconnect to another replica or retry")
                        return
                    continue
                start = time.thread_time()  # this thread's CPU: a wait for the GIL is someone else's time
                wire = batch.response(sub.dropped)
                deliver(engine, batch.summaries, time.thread_time() - start, me)
                yield wire
        finally:
            cleanup()

    @sends_wire_bytes
    @grpc_errors
    def Capture(self, request: pb.CaptureRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialized CaptureResponse messages, framed by ``capture_wire``; its handler has no serializer."""
        state = self.state
        try:
            opts = parse_options(request, state.host, state.capture_limits)
            inputs = decode_inputs(list(request.inputs), state) if request.inputs else None
            slot = state.captures.acquire()
        except Exception as exc:
            state.count_capture(_code_of(exc), 0)
            raise
        session = CaptureSession(state.host, opts, max_bytes=state.capture_limits.max_bytes,
                                 active=inputs is not None, budget=state.capture_budget)
        call = CaptureCall(state, session, slot)
        log.info("capture start: %s active=%s", describe(opts), inputs is not None)
        # A cancelled streaming generator is never resumed, so `finally` alone
        # would leak the hooks, the slot and the budget when the client vanishes.
        if not context.add_callback(call.finish):
            call.finish()  # the client left before the callback could be registered: run nothing
            return
        try:
            yield from call.stream(context, inputs)
        except Exception as exc:
            call.code = _code_of(exc)
            raise
        finally:
            call.finish()


class CaptureCall:
    """One Capture call's resources: its session (hooks, clones, budget) and its slot.

    :meth:`finish` runs from whichever comes first, the generator's
    ``finally`` or gRPC's callback thread when the client vanishes, and does
    its work exactly once.
    """

    def __init__(self, state: ServerState, session: CaptureSession, slot: CaptureSlot) -> None:
        self.state = state
        self.session = session
        self.slot = slot
        #: The final status code name, for the log and the metrics.
        self.code = "CANCELLED"
        self.sent = 0
        # Acquired without blocking and never released: an atomic test-and-set.
        self._once = threading.Lock()

    def finish(self) -> None:
        """End the call: close the session, free the slot, count it; later calls do nothing."""
        if not self._once.acquire(blocking=False):
            return
        try:
            self.session.close()
        finally:
            self.slot.release()
            self.state.count_capture(self.code, self.sent)
            log.info("capture end: code=%s bytes=%d", self.code, self.sent)

    def stream(self, context: grpc.ServicerContext, inputs: ModelInputs | None) -> Iterator[bytes]:
        """Run the capture and yield its serialized messages; sets ``code`` to OK when every pass was sent."""
        session, opts = self.session, self.session.opts
        if not session.open():
            return  # ended (the client left) before it began
        if inputs is not None:
            self.state.host.run(inputs, active_owner=session)
        ids = itertools.count()
        for _ in range(opts.passes):
            rec = self._wait_for_pass(context)
            if rec is None:
                return  # the client is gone
            try:
                if rec.error is not None:
                    raise rec.error
                check_all_ran(rec, opts)
                if rec.ordinal == opts.passes - 1:
                    session.remove_hooks()  # the last pass is in hand: free the hooks now
                for wire, payload in encode_pass(rec, opts, ids):
                    self.sent += payload
                    yield wire
            finally:
                session.release(rec)  # sent, failed or abandoned: its clones and budget go now
        self.code = "OK"

    def _wait_for_pass(self, context: grpc.ServicerContext) -> CapturedPass | None:
        """The next captured pass; None if the client left. A passive capture
        gives up after ``--max-capture-wait`` seconds without one."""
        session = self.session
        max_wait = self.state.capture_limits.max_wait
        start, skipped = time.monotonic(), session.skipped
        while context.is_active():
            rec = session.next_pass(max(0.0, min(POLL_SECONDS, max_wait)))
            if rec is not None:
                return rec
            waited = time.monotonic() - start
            if not session.active and waited >= max_wait:
                raise session.wait_exceeded(waited, max_wait, session.skipped - skipped)
            if self.state.broker.shutting_down:
                # Like Subscribe: end now rather than hold the drain for its whole grace period.
                raise Unavailable("the server is shutting down; retry the capture on another replica")
        return None


def _code_of(exc: BaseException) -> str:
    return status_for(exc)[0].name
