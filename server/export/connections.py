"""Admission and a whole-life deadline for the connections of a thread-per-connection HTTP server.

Why: ``/metrics`` serves each connection on its own thread, and anyone who
can reach the port can open one without a token. A socket timeout bounds
each read, not the connection: a client that drips a byte every few seconds
kept its thread forever. Here every admitted connection has a deadline from
the moment it is accepted (TLS handshake, request and response together), and
one reaper thread shuts down the socket of any connection past it, which
ends that handler's blocking read or write. Admission caps the connections
served at once, in all and per client address, so one host flooding the port
leaves room for the scraper on another.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from layertap.server.host.priority import telemetry_thread

__all__ = ["ConnectionLimits"]

log = logging.getLogger("layertap.server")

#: Seconds between two warnings about refused connections (a flood must not flood the log).
_WARN_EVERY = 60.0


class ConnectionLimits:
    """Which connections may be served, and the reaper that ends those past their deadline.

    Args:
        max_total: Connections served at once.
        max_per_address: Of those, from one client address.
        lifetime: Seconds a connection may live, from accept to close.
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(self, max_total: int, max_per_address: int, lifetime: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_total, self.max_per_address, self.lifetime = max_total, max_per_address, lifetime
        self._clock = clock
        self._cond = threading.Condition()
        self._open: dict[int, tuple[socket.socket, str, float]] = {}
        self._per_address: Counter[str] = Counter()
        self._closed = False
        self._unreported = 0  # refusals since the last warning
        self._warned = -_WARN_EVERY
        #: Connections ended by the deadline, and refused at admission (for tests and logs).
        self.expired = 0
        self.refused = 0
        self._thread = telemetry_thread(self._reap, "layertap-http-reaper")
        self._thread.start()

    def admit(self, conn: socket.socket, address: str) -> bool:
        """Registers ``conn`` with its deadline; False (the caller closes it) when over a limit."""
        with self._cond:
            full = len(self._open) >= self.max_total or self._per_address[address] >= self.max_per_address
            if full or self._closed:
                self.refused += 1
                self._unreported += 1
                now = self._clock()
                if now - self._warned >= _WARN_EVERY:
                    log.warning("/metrics: refused %d connection(s) (at most %d open, %d per address), the "
                                "latest from %s", self._unreported, self.max_total, self.max_per_address, address)
                    self._warned, self._unreported = now, 0
                return False
            self._open[id(conn)] = (conn, address, self._clock() + self.lifetime)
            self._per_address[address] += 1
            self._cond.notify()
            return True

    def release(self, conn: socket.socket) -> None:
        """The connection's handler is done (idempotent)."""
        with self._cond:
            entry = self._open.pop(id(conn), None)
            if entry is not None:
                self._per_address[entry[1]] -= 1
                if not self._per_address[entry[1]]:
                    del self._per_address[entry[1]]

    def count(self) -> int:
        """Connections admitted and not yet released."""
        with self._cond:
            return len(self._open)

    def close(self) -> None:
        """Stops the reaper and hangs up every connection still open (their deadline goes with it)."""
        with self._cond:
            self._closed = True
            still = [conn for conn, _a, _d in self._open.values()]
            self._cond.notify()
        for conn in still:
            _hang_up(conn)
        self._thread.join(5)

    def _reap(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = self._clock()
                due = [key for key, (_c, _a, deadline) in self._open.items() if deadline <= now]
                for key in due:  # hung up below; release() still does the bookkeeping when its handler ends
                    conn, address, _ = self._open[key]
                    self._open[key] = (conn, address, math.inf)
                self.expired += len(due)
                hang_up = [self._open[key][0] for key in due]
                if not due:
                    nearest = min((d for _c, _a, d in self._open.values()), default=math.inf)
                    self._cond.wait(None if nearest == math.inf else nearest - now)
                    continue
            for conn in hang_up:
                _hang_up(conn)


def _hang_up(conn: socket.socket) -> None:
    """Ends a connection under its handler's feet: its blocked read or write returns or raises.

    The plain socket's ``shutdown`` (not ``SSLSocket.shutdown``, which drops
    its TLS state while the handler thread may be inside it).
    """
    try:
        socket.socket.shutdown(conn, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its handler
