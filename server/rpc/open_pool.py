"""The open services' threads (Health, no token): a call stalled on its request gives its thread up.

grpc's sync server reads a unary request on the thread that will run the
call, and waits for it without a deadline of its own. A stranger who sends
HEADERS and part of a message prefix holds that thread until the connection
drops: 4 such Health.Checks took the health listener's pool, 8 the main
port's, and real probes timed out behind them (issue 25).

Here every call of an open service is served as a request stream, so its
behaviour runs before the request is read, and the read is watched:

- **under pressure** (a call is waiting for a thread and every thread is
  busy), the call that has waited longest for its request, once it has
  waited :data:`PATIENCE` seconds, is cancelled and its thread goes to the
  waiting call. A probe's request comes in the same packet as its headers, so
  only a stalled (or absurdly slow) sender is ever cancelled;
- **always**, a call still without its request after :data:`READ_TIMEOUT`
  seconds is cancelled, so a stalled call never outlives its purpose;
- the calls admitted at once are bounded (``limit``); past it a call ends
  RESOURCE_EXHAUSTED at once, on a thread of its own, having read nothing.

One watcher thread does the cancelling; it sleeps until the oldest read is
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

__all__ = ["PATIENCE", "READ_TIMEOUT", "OpenPool", "OpenServices", "first_request", "refusal"]

log = logging.getLogger("layertap.server.admission")

#: Seconds a call may wait for its request while another call waits for its thread. A request
#: sent with its headers can still wait this long for grpc's one serving thread to hand it over
#: when a burst of calls arrives on a loaded machine (at 0.1 s, 30 Watches at once on the
#: 2-vCPU VM had a legitimate one cancelled), so the patience is a probe's whole deadline.
PATIENCE = 1.0
#: Seconds a call may wait for its request in any case.
READ_TIMEOUT = 10.0


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
    """

    def __init__(self, workers: int, *, limit: int, name: str = "layertap-open", patience: float = PATIENCE,
                 read_timeout: float = READ_TIMEOUT) -> None:
        self.workers, self.limit, self.name = workers, limit, name
        self.patience, self.read_timeout = patience, read_timeout
        self.executor = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._refusals = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-refuse")
        self._cond = threading.Condition(threading.Lock())
        self._queued = self._running = 0
        #: Calls reading their request: key -> (since, context), oldest first.
        self._reading: dict[object, tuple[float, grpc.ServicerContext]] = {}
        #: Calls refused at the limit, and calls cancelled still waiting for their request.
        self.refused = self.cancelled = 0
        self._closed = False
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-reads", daemon=True)
        self._watcher.start()

    def pool(self) -> tuple[int, int]:
        """``(in flight, refused or cancelled)`` for ``layertap_streams_*``."""
        with self._cond:
            return self._queued + self._running, self.refused + self.cancelled

    def close(self) -> None:
        """Stop the watcher and the threads (after the server stopped)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._refusals.shutdown(wait=False, cancel_futures=True)

    def serve(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` run on this pool, its one request read under watch; or a refusal past the limit."""
        with self._cond:
            if self._queued + self._running >= self.limit:
                self.refused += 1
                busy = self._queued + self._running
            else:
                busy = -1
                self._queued += 1
                if self._pressed():
                    self._cond.notify()
        if busy >= 0:
            log.debug("refused %s: %d calls in the %s pool", method, busy, self.name)
            return refusal(handler, LimitExceeded(
                f"{method}: {busy} calls are in flight, the limit is {self.limit}; retry later",
                metadata={"method": method, "limit": str(self.limit)}), self._refusals)
        inner = behavior_of(handler)
        streaming_in = handler.request_streaming

        def behavior(requests: Any, context: grpc.ServicerContext, *callback: Any) -> Any:
            with self._cond:
                self._queued -= 1
                self._running += 1
            try:
                request = requests if streaming_in else self._read(requests, context)
                return inner(request, context, *callback)
            finally:
                with self._cond:
                    self._running -= 1
        if hasattr(inner, "experimental_non_blocking"):  # Health.Watch answers through a callback
            behavior.experimental_non_blocking = inner.experimental_non_blocking  # type: ignore[attr-defined]
        behavior.experimental_thread_pool = self.executor  # type: ignore[attr-defined]
        return make_handler((True, bool(handler.response_streaming)), behavior, handler.request_deserializer,
                            handler.response_serializer)

    def _pressed(self) -> bool:
        """A call waits for a thread and every thread is busy (under the lock)."""
        return self._queued > 0 and self._running >= self.workers

    def _read(self, requests: Any, context: grpc.ServicerContext) -> Any:
        key = object()
        with self._cond:
            first = not self._reading
            self._reading[key] = (time.monotonic(), context)
            if first or self._pressed():
                self._cond.notify()
        try:
            return first_request(requests, context)
        finally:
            with self._cond:
                self._reading.pop(key, None)

    def _watch(self) -> None:
        """Cancel the oldest read once it is due: after ``patience`` under pressure, ``read_timeout`` always."""
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._reading:
                    self._cond.wait()
                    continue
                key, (since, context) = next(iter(self._reading.items()))
                due = since + (self.patience if self._pressed() else self.read_timeout)
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                del self._reading[key]
                self.cancelled += 1
                pressed = self._pressed()
            log.debug("%s: cancelled a call that sent no request for %.1f s%s", self.name, time.monotonic() - since,
                      " while others waited for a thread" if pressed else "")
            context.cancel()  # wakes its reader (the call ends CANCELLED); outside the lock


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
