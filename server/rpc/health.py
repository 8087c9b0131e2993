"""``grpc.health.v1.Health``: Check, List and a Watch that cannot wedge the server.

grpcio-health-checking's servicer sends Watch responses while holding its
lock, and grpc runs a stream's close callback on the one thread that serves
every call (``_serve``); that callback waits for the same lock. A send waits
for ``_serve`` to complete it, so a handful of cancelled watches deadlocks the
whole server, SIGTERM included (grpc/grpc#43403). Health needs no token, so
anyone could do it.

Here the lock guards dictionaries only and is never held across a send or a
wait. One notifier thread hands each watch its latest status to a sender
pool, with at most one send in flight per watch, so ``set`` and
``enter_graceful_shutdown`` never wait on the network, a client that grants
no flow-control window stalls only its own watch, and a close callback only
takes the lock for a dictionary update. Watches are
bounded in total and per connection (a Watch holds no worker, but each pins a
little memory and a notifier send), and refusals are counted.

``List`` is answered (the library leaves it UNIMPLEMENTED, which grpc logs
with a traceback per call: a log flood for anyone).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("layertap.server.health")

ServingStatus: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

#: google.golang.org/grpc's health server also caps List (RESOURCE_EXHAUSTED past it).
MAX_LISTED = 100
#: Longest service name Check and Watch accept. Health needs no token, and a
#: Watch keeps its name for the whole stream: unbounded, 48 streams of
#: 256 MiB names would pin 12 GiB.
MAX_SERVICE_NAME = 256
#: Watches open at once on one servicer (one listener). A client-side health
#: checker opens one per channel and service; more is a leak or an attack.
MAX_WATCHES = 32
#: Watches open at once from one connection (grpc's peer string: address and port).
MAX_WATCHES_PER_CONNECTION = 8


def _check_name(request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext) -> None:
    if len(request.service) > MAX_SERVICE_NAME:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"service: at most {MAX_SERVICE_NAME} characters, got {len(request.service)}")


class _Watch:
    """One open Watch: where to send, and the last status sent (read and written under the servicer's lock)."""

    __slots__ = ("service", "peer", "send", "sent", "open", "sending", "dirty")

    def __init__(self, service: str, peer: str, send: Callable[[Any], Any]) -> None:
        self.service = service
        self.peer = peer
        self.send = send
        self.sent: ServingStatus | None = None
        self.open = True
        #: A send of this watch is in flight (on a sender thread); ``dirty``: check again after it.
        self.sending = False
        self.dirty = False


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Statuses set by the server, answered by Check, List and Watch.

    Args:
        max_watches: Watches open at once on this servicer.
        max_watches_per_connection: Watches open at once from one connection.
    """

    def __init__(self, *, max_watches: int = MAX_WATCHES,
                 max_watches_per_connection: int = MAX_WATCHES_PER_CONNECTION) -> None:
        self.max_watches = max_watches
        self.max_watches_per_connection = max_watches_per_connection
        self._lock = threading.Lock()
        self._status: dict[str, ServingStatus] = {"": SERVING}
        self._frozen = False
        self._watches: dict[str, set[_Watch]] = {}
        self._per_connection: Counter[str] = Counter()
        self._open = 0
        #: Watches refused so far, by reason (``total`` or ``connection``).
        self.refused: Counter[str] = Counter()
        self._followers: list[HealthServicer] = []
        self._outbox: queue.SimpleQueue[_Watch | None] = queue.SimpleQueue()
        # A send waits until grpc completes it, which a client that grants no
        # flow-control window delays for as long as it likes: each watch has at
        # most one send in flight, on a pool with a thread for every watch, so
        # a stuck one never holds up another's.
        self._senders = futures.ThreadPoolExecutor(max_workers=max_watches, thread_name_prefix="layertap-health-send")
        self._notifier = threading.Thread(target=self._notify, name="layertap-health-notify", daemon=True)
        self._notifier.start()

    @property
    def open_watches(self) -> int:
        with self._lock:
            return self._open

    def pool(self) -> tuple[int, int]:
        """``(open, refused)`` for ``layertap_streams_*``."""
        with self._lock:
            return self._open, sum(self.refused.values())

    def follow(self, other: HealthServicer) -> None:
        """Copy every status (and the shutdown) to ``other``: a listener with its own state and watches."""
        with self._lock:
            statuses = dict(self._status)
            self._followers.append(other)
        for service, status in statuses.items():
            other.set(service, status)

    def set(self, service: str, status: ServingStatus) -> None:
        """Record ``service``'s status and tell its watchers; ignored once shutdown began (as the library)."""
        with self._lock:
            if self._frozen:
                return
            self._status[service] = status
            targets = list(self._watches.get(service, ()))
            followers = list(self._followers)
        for watch in targets:
            self._outbox.put(watch)
        for other in followers:
            other.set(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; later ``set`` calls are ignored."""
        with self._lock:
            if self._frozen:
                return
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._frozen = True
            targets = [w for ws in self._watches.values() for w in ws]
            followers = list(self._followers)
        for watch in targets:
            self._outbox.put(watch)
        for other in followers:
            other.enter_graceful_shutdown()

    def close(self) -> None:
        """Stop the notifier thread and the senders (the server's listeners are stopped first)."""
        self._outbox.put(None)
        self._senders.shutdown(wait=False, cancel_futures=True)

    def Check(self, request: health_pb2.HealthCheckRequest,
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        _check_name(request, context)
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"service {request.service!r} is unknown; List names them")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              send_response_callback: Callable[[Any], Any] | None = None) -> None:
        _check_name(request, context)
        if send_response_callback is None:  # every grpc.server passes one to a non-blocking handler
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch needs grpc's non-blocking handlers")
        assert send_response_callback is not None
        watch = _Watch(request.service, context.peer(), send_response_callback)
        why = self._admit(watch)
        if why:
            log.debug("health: refused a Watch from %s: %s", watch.peer, why)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        if not context.add_callback(lambda: self._closed(watch)):  # already over
            self._closed(watch)
            return
        self._outbox.put(watch)  # the first status, from the notifier like every other

    # Seen by grpc on the bound method: answer through the callback, hold no worker.
    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    Watch.experimental_thread_pool = None  # type: ignore[attr-defined]

    def List(self, request: health_pb2.HealthListRequest,
             context: grpc.ServicerContext) -> health_pb2.HealthListResponse:
        with self._lock:
            snapshot = dict(self._status)
        if len(snapshot) > MAX_LISTED:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than {MAX_LISTED} services")
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in snapshot.items()})

    def _admit(self, watch: _Watch) -> str:
        """Register ``watch``, or say why not."""
        with self._lock:
            if self._open >= self.max_watches:
                self.refused["total"] += 1
                return f"{self._open} health watches are open, the limit is {self.max_watches}"
            if self._per_connection[watch.peer] >= self.max_watches_per_connection:
                self.refused["connection"] += 1
                return (f"this connection has {self._per_connection[watch.peer]} health watches open, "
                        f"the limit is {self.max_watches_per_connection}")
            self._open += 1
            self._per_connection[watch.peer] += 1
            self._watches.setdefault(watch.service, set()).add(watch)
            return ""

    def _closed(self, watch: _Watch) -> None:
        """The stream ended (grpc's close callback, on its serving thread): a dictionary update only."""
        with self._lock:
            if not watch.open:
                return
            watch.open = False
            self._open -= 1
            self._per_connection[watch.peer] -= 1
            if self._per_connection[watch.peer] <= 0:
                del self._per_connection[watch.peer]
            watchers = self._watches.get(watch.service)
            if watchers is not None:
                watchers.discard(watch)
                if not watchers:
                    del self._watches[watch.service]

    def _notify(self) -> None:
        """Hand each queued watch its current status, if it changed, to a sender; never under the lock."""
        while True:
            watch = self._outbox.get()
            if watch is None:
                return
            with self._lock:
                if not watch.open:
                    continue
                if watch.sending:  # the sender looks again when its send is done
                    watch.dirty = True
                    continue
                status = self._status.get(watch.service, SERVICE_UNKNOWN)
                if status == watch.sent:
                    continue
                watch.sent = status
                watch.sending = True
            try:
                self._senders.submit(self._send, watch, status)
            except RuntimeError:  # closed: the server is stopping
                return

    def _send(self, watch: _Watch, status: ServingStatus) -> None:
        try:
            # Waits for grpc to complete the send; returns at once for a cancelled stream.
            watch.send(health_pb2.HealthCheckResponse(status=status))
        except Exception:  # one broken stream must not stop the others' updates
            log.debug("health: a Watch send failed", exc_info=True)
        finally:
            with self._lock:
                watch.sending = False
                again, watch.dirty = watch.dirty, False
            if again:
                self._outbox.put(watch)
