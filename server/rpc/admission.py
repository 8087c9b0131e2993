"""Stream admission: at most ``--max-streams`` long streams at once.

The server is synchronous, so a blocking stream (Subscribe, Capture,
reflection) holds a worker thread until it ends. Without a cap, ``--workers``
open streams leave no thread for Infer or a probe's ``Health.Check``, and
every call gets RESOURCE_EXHAUSTED. :class:`StreamAdmission` admits at most
``limit`` streams and refuses the rest with RESOURCE_EXHAUSTED naming the
flag, so ``workers - limit`` threads always stay free for unary calls.

A long stream is any method whose handler streams requests or responses: the
same fact the service descriptors state (``server_streaming``/
``client_streaming``), read from the handler so that every registered
service is covered (Health.Watch and reflection included) and a streaming RPC
added later is counted without editing a list.

A slot is taken when the stream's behaviour starts on its worker, not in
``intercept_service``: that runs before grpc's own ``maximum_concurrent_rpcs``
check, and a call grpc then refuses would never give its slot back. The slot
is given back exactly once, by whichever comes first: the stream's iterator
ends (or is closed), or grpc reports the RPC over (``add_callback``; a
cancelled generator is never resumed, so ``finally`` alone would leak it).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_status import rpc_status

from layertap.server.errors import LimitExceeded, rich_status
from layertap.server.rpc.method_handlers import behavior_of, make_handler, rebuild
from layertap.server.rpc.open_pool import READ_TIMEOUT, OpenPool, OpenServices, first_request, refusal
from layertap.server.rpc.read_watch import ReadWatch

log = logging.getLogger("layertap.server.admission")

__all__ = ["UPLOAD_TIMEOUT", "PrincipalAdmission", "StreamAdmission", "is_long_stream", "rpc_limit", "streaming_methods"]


#: Seconds from arrival a call outside the open services may take to send its (unary) request when the
#: server-wide places are not all taken: 256 MiB (--max-request-bytes) at 4.5 MB/s. When they are all
#: taken, :data:`~layertap.server.rpc.open_pool.READ_TIMEOUT` (10 s) from arrival, as for Health.
UPLOAD_TIMEOUT = 60.0


def is_long_stream(handler: grpc.RpcMethodHandler) -> bool:
    """Whether a call of this method may hold its worker for as long as the client likes."""
    return bool(handler.request_streaming or handler.response_streaming)


def streaming_methods(services: Iterable[ServiceDescriptor]) -> frozenset[str]:
    """``/pkg.Service/Method`` of every streaming method, from the descriptors."""
    return frozenset(f"/{s.full_name}/{m.name}" for s in services for m in s.methods
                     if m.server_streaming or m.client_streaming)


class _Slot:
    """One admitted call's place; :meth:`release` gives it back once, from any thread.

    Both ``finally`` and grpc's end-of-call callback release it: a cancelled
    generator is never resumed, so either alone could leak or double-count.
    """

    __slots__ = ("_give_back", "_done", "_lock")

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._done = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._give_back()


class StreamAdmission(grpc.ServerInterceptor):
    """Admits at most ``limit`` long streams at once; refuses the rest.

    Args:
        limit: Streams open at once (``--max-streams``).
        flag: The setting named in the refusal, so an operator knows what to raise.
    """

    def __init__(self, limit: int, flag: str = "--max-streams", *, callback_limit: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"{flag} {limit}: must be at least 1")
        self.limit = limit
        self.flag = flag
        self._lock = threading.Lock()
        self._open = 0
        #: Streams refused so far.
        self.refused = 0
        #: Callback streams (Health.Watch) hold no worker, and Health needs no
        #: token: counted against the worker cap, strangers could lock
        #: authorised Subscribe and Capture out. They get a cap of their own.
        self.callbacks: StreamAdmission | None = None
        if callback_limit is not None:
            self.callbacks = StreamAdmission(callback_limit, f"{flag} (callback streams)")

    @property
    def open_streams(self) -> int:
        """Streams admitted and not yet ended."""
        with self._lock:
            return self._open

    def acquire(self, method: str) -> _Slot:
        """Take a slot for a stream of ``method``; raises LimitExceeded when none is free."""
        with self._lock:
            if self._open >= self.limit:
                self.refused += 1
                raise LimitExceeded(
                    f"{method}: {self._open} streams are open, the server limit is {self.flag}={self.limit}; "
                    "close a stream or retry later",
                    metadata={"method": method, "max_streams": str(self.limit)})
            self._open += 1
        return _Slot(self._release)

    def _release(self) -> None:
        with self._lock:
            self._open -= 1

    def _admit(self, method: str, context: grpc.ServicerContext) -> _Slot:
        try:
            slot = self.acquire(method)
        except LimitExceeded as exc:
            log.debug("refused %s: %d streams open (%s)", method, self.limit, self.flag)
            context.abort_with_status(rpc_status.to_status(rich_status(exc)))
            raise  # abort_with_status raises; this line only satisfies type checkers
        if not context.add_callback(slot.release):  # the RPC is already over
            slot.release()
        return slot

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None or not is_long_stream(handler):
            return handler
        return self._guarded(handler, handler_call_details.method)

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        inner = behavior_of(handler)
        behavior: Callable[..., Any]
        if not handler.response_streaming:
            def unary_reply(request: Any, context: grpc.ServicerContext) -> Any:
                slot = self._admit(method, context)
                try:
                    return inner(request, context)
                finally:
                    slot.release()
            behavior = unary_reply
        elif getattr(inner, "experimental_non_blocking", False):
            # Health.Watch answers through a callback and holds no worker;
            # keep it that way (the slot goes back with the RPC's callback).
            pool = self.callbacks or self

            def callback_stream(request: Any, context: grpc.ServicerContext,
                                send_response_callback: Any = None) -> Any:
                slot = pool._admit(method, context)
                try:
                    return inner(request, context, send_response_callback=send_response_callback)
                except BaseException:
                    # Refused by the servicer (its own Watch limits): the slot goes back now,
                    # not when grpc gets round to the call's end callback, which under load
                    # came after the next Watch was counted.
                    slot.release()
                    raise
            callback_stream.experimental_non_blocking = True  # type: ignore[attr-defined]
            callback_stream.experimental_thread_pool = getattr(inner, "experimental_thread_pool", None)  # type: ignore[attr-defined]
            behavior = callback_stream
        else:
            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                slot = self._admit(method, context)
                try:
                    yield from inner(request, context)
                finally:
                    slot.release()
            behavior = stream
        return rebuild(handler, behavior)



def rpc_limit(workers: int) -> int:
    """Calls outside the open services in flight at once: every worker may have one call waiting.

    Bounded, so a flood gets RESOURCE_EXHAUSTED instead of a queue without
    end. Streams count too, but never hold more than ``--max-streams`` workers.
    Calls that never finish sending their request hold a worker each, up to a
    principal's share (:class:`PrincipalAdmission`); this counts them all
    (docs/security.md, "Not protected against"). Health is not counted here:
    its calls have a pool and a bound of their own (:mod:`.open_pool`), so no
    burst of other calls can make a probe fail.
    """
    return 2 * workers


class _Budget:
    """Calls in flight per key, at most ``limit`` each; counts what it refuses."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self.refused = 0

    def pool(self) -> tuple[int, int]:
        """``(in flight, refused)`` for ``layertap_streams_*``."""
        with self._lock:
            return sum(self._held.values()), self.refused

    def full(self) -> bool:
        """Every place is held."""
        with self._lock:
            return sum(self._held.values()) >= self.limit

    def take(self, key: str) -> int:
        """0 when taken, else how many ``key`` already holds."""
        with self._lock:
            n = self._held.get(key, 0)
            if n >= self.limit:
                self.refused += 1
                return n
            self._held[key] = n + 1
            return 0

    def give(self, key: str) -> None:
        with self._lock:
            n = self._held.get(key, 0) - 1
            if n > 0:
                self._held[key] = n
            else:
                self._held.pop(key, None)


class PrincipalAdmission(grpc.ServerInterceptor):
    """No one caller can take the workers: a share per principal, a pool of their own for open services.

    The sync server reads a unary request on a worker before any behaviour
    runs, so a client that sends headers and then drips its body holds that
    worker for as long as it likes: 64 such calls from one ``read`` token
    took every worker, Health's included. So every call is served as a
    request stream: its behaviour runs before the request is read.

    - An authenticated principal (any scope, admin included) holds at most
      ``principal_limit`` calls in flight, checked when the call *arrives*
      (in ``intercept_service``, the principal named by the Authenticator
      from the call's metadata): past it the call ends RESOURCE_EXHAUSTED
      on a thread of its own, having read nothing and holding no
      server-wide place, so one principal's burst never takes the places
      of others. Without auth every caller is one principal and this budget
      is off.
    - Calls outside the open services are at most ``call_limit`` in flight
      (grpc's ``maximum_concurrent_rpcs``, which the server leaves unset: it
      counts Health's calls too, and a burst of anything made probes fail).
      The place is taken when the call arrives, only once its principal's
      share granted it, and given back when its behaviour ends, which it
      always reaches (a request stream's behaviour runs even for a call
      cancelled while queued); past the limit the call ends
      RESOURCE_EXHAUSTED on a thread of its own, having read nothing.
    - A unary call's request is read under a
      :class:`~layertap.server.rpc.read_watch.ReadWatch`, measured from
      arrival: a call still without its request ``patience``
      (:data:`~layertap.server.rpc.open_pool.READ_TIMEOUT`, 10 s) after it
      arrived is cancelled while every server-wide place is taken, and
      after ``read_timeout`` (:data:`UPLOAD_TIMEOUT`, 60 s) in any case;
      cancelled reads are counted with the refusals (:meth:`calls_pool`).
      Stalled calls thus hold places for a bounded time, tokens or not.
    - The open services (Health, no token needed) run on a pool of their own
      (:class:`~layertap.server.rpc.open_pool.OpenPool`): strangers' calls
      can fill only that pool, never token holders' workers, and a call
      stalled on its request gives its thread up to a probe.
    - A unary call that ends without its request gets INVALID_ARGUMENT
      (field ``request``), not grpc's garbled UNIMPLEMENTED.

    Runs after :class:`~layertap.server.rpc.auth.Authenticator`, which names
    the principal before the interceptors after it run
    (``principal_at_arrival``: None for a call it refuses, which takes no
    place here).

    Args:
        principal_limit: Calls in flight per principal; None: no per-principal budget (auth off).
        open_services: Service names callable without a token.
        open_workers: Threads of the open services' pool.
        principal_at_arrival: The arriving call's principal id, or None when the Authenticator refuses it.
        flag: The setting named in refusals.
        call_limit: Calls outside the open services in flight at once (None: unbounded).
        open_limit: Calls of the open services in flight at once.
        patience: Seconds from arrival a request may take while every server-wide place is taken.
        read_timeout: Seconds from arrival a request may take in any case.
        grace: Seconds a call that gets its worker past either still has to read its request.
    """

    def __init__(self, *, principal_limit: int | None, open_services: frozenset[str], open_workers: int,
                 principal_at_arrival: Callable[[], str | None], flag: str = "--principal-share",
                 call_limit: int | None = None, workers: int | None = None, open_limit: int = 256,
                 patience: float = READ_TIMEOUT,
                 read_timeout: float = UPLOAD_TIMEOUT, grace: float = 1.0) -> None:
        self.principals = _Budget(principal_limit) if principal_limit is not None else None
        self.calls = _Budget(call_limit) if call_limit is not None else None
        self.open = OpenServices(OpenPool(open_workers, limit=open_limit), open_services)
        self.open_pool = self.open.pool.executor
        self._refusals = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="layertap-refuse")
        self.flag = flag
        self._principal_at_arrival = principal_at_arrival
        self.workers = workers
        self._lock = threading.Lock()
        self._queued = self._running = 0  # calls admitted: waiting for a worker, on one
        self.reads = ReadWatch("layertap-calls", pressed=self._pressed, patience=patience,
                               read_timeout=read_timeout, grace=grace)

    def calls_pool(self) -> tuple[int, int]:
        """``(in flight, refused or cancelled unread)`` of the calls outside the open services."""
        held, refused = self.calls.pool() if self.calls is not None else (0, 0)
        return held, refused + self.reads.cancelled

    def _pressed(self) -> bool:
        """Every server-wide place is taken (a call arriving now is refused), or an admitted call waits for a
        worker while every worker runs one."""
        if self.calls is not None and self.calls.full():
            return True
        with self._lock:
            return self.workers is not None and self._queued > 0 and self._running >= self.workers

    def _started(self) -> None:
        """An admitted call got its worker."""
        with self._lock:
            self._queued -= 1
            self._running += 1
        if self._pressed():
            self.reads.poke()

    def _ended(self) -> None:
        with self._lock:
            self._running -= 1

    def close(self) -> None:
        """Stop the open services' pool, the read watch and the refusals' thread (after the server stopped)."""
        self.open.pool.close()
        self.reads.close()
        self._refusals.shutdown(wait=False, cancel_futures=True)

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        if self.open.covers(method):
            return self.open.pool.serve(handler, method)
        arrived = time.monotonic()
        who = self._principal_at_arrival()
        if who is None:  # the Authenticator refuses this call and replaces its handler: no place for it
            return handler
        held: list[_Slot] = []
        if self.principals is not None:  # the share first: a burst over it never holds a server-wide place
            if n := self.principals.take(who):
                log.debug("refused %s for %s: %d calls in flight", method, who, n)
                return refusal(handler, LimitExceeded(
                    f"{method}: principal {who!r} has {n} calls in flight, the limit is {self.principals.limit} "
                    f"({self.flag} of --workers); retry later",
                    metadata={"method": method, "principal": who, "principal_limit": str(self.principals.limit)}),
                    self._refusals)
            held.append(_Slot(functools.partial(self.principals.give, who)))
        if self.calls is not None:
            if n := self.calls.take(""):
                for slot in held:
                    slot.release()
                self.reads.poke()
                log.debug("refused %s: %d calls in flight", method, n)
                return refusal(handler, LimitExceeded(
                    f"{method}: {n} calls are in flight, the server limit is {self.calls.limit} "
                    "(2 x --workers); retry later",
                    metadata={"method": method, "call_limit": str(self.calls.limit)}), self._refusals)
            held.append(_Slot(functools.partial(self.calls.give, "")))
        with self._lock:
            self._queued += 1
        if self._pressed():
            self.reads.poke()
        return self._budgeted(handler, method, held, arrived)

    def _held(self, places: list[_Slot], context: grpc.ServicerContext) -> list[_Slot]:
        """The call's places and its worker's count, each given back by the RPC's end at the latest."""
        self._started()
        held = [*places, _Slot(self._ended)]
        for slot in held:
            if not context.add_callback(slot.release):  # already over; a cancelled generator is never resumed
                slot.release()
        return held

    def _budgeted(self, handler: grpc.RpcMethodHandler, method: str, places: list[_Slot],
                  arrived: float) -> grpc.RpcMethodHandler:
        inner = behavior_of(handler)
        streaming_in = handler.request_streaming

        def request(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            if streaming_in:
                return requests
            return self.reads.read(lambda: first_request(requests, context), context, arrived)

        behavior: Callable[..., Any]
        if not handler.response_streaming:
            def unary_reply(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                held = self._held(places, context)
                try:
                    return inner(request(requests, context), context)
                finally:
                    for slot in held:
                        slot.release()
            behavior = unary_reply
        else:
            def stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                held = self._held(places, context)  # here, not in the generator: it may never run

                def responses() -> Iterator[Any]:
                    try:
                        yield from inner(request(requests, context), context)
                    finally:
                        for slot in held:
                            slot.release()
                return responses()
            behavior = stream
        # Served as a request stream whatever the method's shape: see the class docstring.
        return make_handler((True, handler.response_streaming), behavior, handler.request_deserializer,
                            handler.response_serializer)
