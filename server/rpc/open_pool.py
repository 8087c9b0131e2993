"""The open services' threads (Health, no token): a call stalled on its request gives its thread up.

grpc's sync server reads a unary request on the thread that will run the
call, and waits for it without a deadline of its own. A stranger who sends
HEADERS and part of a message prefix holds that thread until the connection
drops: 4 such Health.Checks took the health listener's pool, 8 the main
port's, and real probes timed out behind them (issue 25).

Here every call of an open service is served as a request stream, so its
behaviour runs before the request is read, and the read is watched by a
:class:`~layertap.server.rpc.read_watch.ReadWatch`, every time measured from
when the call *arrived*, not from when a thread picked it up (a probe queued
behind a backlog of stalled calls would otherwise wait for them to be cleared
``workers`` at a time):

- **under pressure** (a call is waiting for a thread and every thread is
  busy), a call still without its request :data:`PATIENCE` seconds after it
  arrived is cancelled, and its thread goes to a waiting call; every such
  call at once, whichever thread holds it. A call queued longer than that
  still gets :data:`GRACE` on its thread: a probe's request comes in the same
  packet as its headers, so it is read at once, and only a stalled (or
  absurdly slow) sender is ever cancelled;
- **always**, a call still without its request :data:`READ_TIMEOUT` seconds
  after it arrived is cancelled, so a stalled call never outlives its purpose;
- the calls admitted at once are bounded (``limit``); past it a call ends
  RESOURCE_EXHAUSTED at once, on a thread of its own, having read nothing.

One watcher thread does the cancelling; it sleeps until the earliest read is
due. This keeps the sync design (docs/design.md) for Health on both
listeners: an asyncio listener would hold no thread at all, but it would
need a second Health servicer in asyncio and would still leave Health on the
main port, which cannot be asyncio without every servicer, to this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent import futures
from typing import Any

import grpc
from grpc_status import rpc_status

from layertap.server.errors import InvalidField, LimitExceeded, rich_status
from layertap.server.rpc.method_handlers import behavior_of, make_handler
from layertap.server.rpc.read_watch import ReadWatch

__all__ = ["GRACE", "PATIENCE", "READ_TIMEOUT", "OpenPool", "OpenServices", "first_request", "refusal"]

log = logging.getLogger("layertap.server.admission")

#: Seconds a call may wait for its request while another call waits for its thread. A request
#: sent with its headers can still wait this long for grpc's one serving thread to hand it over
#: when a burst of calls arrives on a loaded machine (at 0.1 s, 30 Watches at once on the
#: 2-vCPU VM had a legitimate one cancelled), so the patience is a probe's whole deadline.
PATIENCE = 1.0
#: Seconds a call may wait for its request in any case.
READ_TIMEOUT = 10.0
#: Seconds a call that got its thread past one of the above still has to read its request (already there,
#: for a probe: read in well under a millisecond).
GRACE = 0.05


def first_request(requests: Iterable[Any], context: grpc.ServicerContext) -> Any:
    """The one request of a unary-request method served as a request stream.

    A call that ends without its message gets INVALID_ARGUMENT naming
    ``request``. grpc's own reader answers it UNIMPLEMENTED with the method
    name formatted from bytes (``"b''" requires exactly one request
    message.``), the empty name of a registered method.
    """
    for request in requests:
        return request
    context.abort_with_status(rpc_status.to_status(rich_status(InvalidField(
        "request", "the call ended before its message arrived (a unary method reads exactly one)"))))


def refusal(handler: grpc.RpcMethodHandler, exc: Exception, pool: futures.ThreadPoolExecutor) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s response kind that ends the call with ``exc``'s status on ``pool``,
    reading nothing (served as a request stream, its behaviour runs before any read)."""
    status = rpc_status.to_status(rich_status(exc))

    def refuse(_requests: Any, context: grpc.ServicerContext, *_callback: Any) -> None:
        context.abort_with_status(status)

    refuse.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return make_handler((True, bool(handler.response_streaming)), refuse, handler.request_deserializer,
                        handler.response_serializer)


class OpenPool:
    """Threads for the open services, where a call stalled on its request never keeps a thread from another.

    Args:
        workers: Threads of the pool.
        limit: Calls admitted at once (running or waiting for a thread).
        name: Thread name prefix; also names the pool in refusals.
        patience: :data:`PATIENCE`.
        read_timeout: :data:`READ_TIMEOUT`.
        grace: :data:`GRACE`.
    """

    def __init__(self, workers: int, *, limit: int, name: str = "layertap-open", patience: float = PATIENCE,
                 read_timeout: float = READ_TIMEOUT, grace: float = GRACE) -> None:
        self.workers, self.limit, self.name = workers, limit, name
        self.patience, self.read_timeout = patience, read_timeout
        self.executor = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._refusals = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-refuse")
        self._cond = threading.Condition(threading.Lock())
        self._queued = self._running = 0
        #: Calls refused at the limit.
        self.refused = 0
        self.reads = ReadWatch(name, pressed=self.pressed, patience=patience, read_timeout=read_timeout, grace=grace)

    @property
    def cancelled(self) -> int:
        """Calls cancelled still waiting for their request."""
        return self.reads.cancelled

    def pool(self) -> tuple[int, int]:
        """``(in flight, refused or cancelled)`` for ``layertap_streams_*``."""
        with self._cond:
            return self._queued + self._running, self.refused + self.reads.cancelled

    def close(self) -> None:
        """Stop the watcher and the threads (after the server stopped)."""
        self.reads.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._refusals.shutdown(wait=False, cancel_futures=True)

    def serve(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` run on this pool, its one request read under watch; or a refusal past the limit."""
        arrived = time.monotonic()
        with self._cond:
            if self._queued + self._running >= self.limit:
                self.refused += 1
                busy = self._queued + self._running
            else:
                busy = -1
                self._queued += 1
                pressed = self._pressed()
        if busy >= 0:
            log.debug("refused %s: %d calls in the %s pool", method, busy, self.name)
            return refusal(handler, LimitExceeded(
                f"{method}: {busy} calls are in flight, the limit is {self.limit}; retry later",
                metadata={"method": method, "limit": str(self.limit)}), self._refusals)
        if pressed:
            self.reads.poke()
        inner = behavior_of(handler)
        streaming_in = handler.request_streaming

        def behavior(requests: Any, context: grpc.ServicerContext, *callback: Any) -> Any:
            with self._cond:
                self._queued -= 1
                self._running += 1
                pressed = self._pressed()
            if pressed:  # this thread was the last free one
                self.reads.poke()
            try:
                request = requests if streaming_in else self.reads.read(
                    lambda: first_request(requests, context), context, arrived)
                return inner(request, context, *callback)
            finally:
                with self._cond:
                    self._running -= 1
        if hasattr(inner, "experimental_non_blocking"):  # Health.Watch answers through a callback
            behavior.experimental_non_blocking = inner.experimental_non_blocking  # type: ignore[attr-defined]
        behavior.experimental_thread_pool = self.executor  # type: ignore[attr-defined]
        return make_handler((True, bool(handler.response_streaming)), behavior, handler.request_deserializer,
                            handler.response_serializer)

    def pressed(self) -> bool:
        """A call waits for a thread and every thread is busy."""
        with self._cond:
            return self._pressed()

    def _pressed(self) -> bool:
        """:meth:`pressed` under the lock."""
        return self._queued > 0 and self._running >= self.workers


class OpenServices(grpc.ServerInterceptor):
    """Serves the methods of ``services`` on ``pool`` (see :class:`OpenPool`); other methods pass through."""

    def __init__(self, pool: OpenPool, services: frozenset[str]) -> None:
        self.pool, self.services = pool, services

    def covers(self, method: str) -> bool:
        return method.lstrip("/").split("/", 1)[0] in self.services

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or not self.covers(handler_call_details.method):
            return handler
        return self.pool.serve(handler, handler_call_details.method)
