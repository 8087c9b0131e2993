"""The ``/metrics`` HTTP endpoint, serving the fast writers of :mod:`.exposition` for an injected registry.

A WSGI app of our own (not ``prometheus_client.start_http_server``) so the
fast writers are what gets served and scrape requests stay out of the log.
The format follows the ``Accept`` header as prometheus-client negotiates it
(Prometheus asks for OpenMetrics first), and the body is gzipped when the
scraper accepts it, as Prometheus always does.
"""

from __future__ import annotations

import gzip
import logging
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from layertap.server.export.connections import ConnectionLimits
from layertap.server.export.exposition import negotiate
from layertap.server.host.priority import telemetry_thread

log = logging.getLogger("layertap.server")

__all__ = ["GZIP_LEVEL", "accepts_gzip", "make_metrics_app", "start_metrics_server", "stop_metrics_server"]


#: Checks a scrape's ``Authorization`` header; returns why it is refused, or None.
Authorize = Callable[[str | None], str | None]

#: Level 1: a 1.1 MB scrape compresses 8x in ~3 ms; level 9 (prometheus-client's) takes ~19 ms for 15% less.
GZIP_LEVEL = 1


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an ``Accept-Encoding`` header allows gzip (``gzip;q=0`` refuses it)."""
    for part in (accept_encoding or "").split(","):
        coding, _, params = part.partition(";")
        if coding.strip().lower() == "gzip":
            for param in params.split(";"):
                key, _, value = param.partition("=")
                if key.strip().lower() == "q":
                    try:
                        return float(value) > 0
                    except ValueError:
                        return False
            return True
    return False


def _plain(start_response: Callable[..., Any], status: str, text: str,
           extra: list[tuple[str, str]] | None = None) -> list[bytes]:
    body = f"{status}: {text}\n".encode()
    start_response(status, [*(extra or []), ("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(body)))])
    return [body]


def make_metrics_app(registry: Collector, authorize: Authorize | None = None) -> Callable[..., list[bytes]]:
    """A WSGI app serving ``registry`` on any GET path, in the format the ``Accept`` header asks for.

    With ``authorize``, a scrape without an accepted bearer token gets 401.
    An ``Accept`` header prometheus-client cannot read (an OpenMetrics
    ``version`` that is not a number) gets 400 naming it.
    """

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if authorize is not None and (why := authorize(environ.get("HTTP_AUTHORIZATION"))) is not None:
            return _plain(start_response, "401 Unauthorized", why, [("WWW-Authenticate", 'Bearer realm="layertap"')])
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("404 Not Found", [])
            return [b""]
        accept = environ.get("HTTP_ACCEPT")
        try:
            encoder, content_type = negotiate(accept)
        except (TypeError, ValueError):  # prometheus-client's parse of e.g. "version=abc"
            return _plain(start_response, "400 Bad Request", f"Accept header {accept!r}: unreadable format version")
        body = encoder(registry)
        headers = [("Content-Type", content_type), ("Vary", "Accept, Accept-Encoding")]
        if accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING")):
            body = gzip.compress(body, compresslevel=GZIP_LEVEL)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", [*headers, ("Content-Length", str(len(body)))])
        return [body]

    return app


#: Seconds a connection may live, from accept to close: TLS handshake, request and response together.
REQUEST_TIMEOUT_SECONDS = 10.0
#: Connections served at once; more are closed at accept (logged at most once a minute).
MAX_CONNECTIONS = 64
#: Of those, from one client address: one host flooding the port leaves room for the scraper.
MAX_CONNECTIONS_PER_ADDRESS = 8


class _LogWriter:
    """wsgiref's handler prints a traceback to its stderr when a write fails (a client gone or
    too slow): that goes to the log at DEBUG instead, so a stranger cannot fill stderr."""

    def write(self, text: str) -> None:
        if text.strip():
            log.debug("/metrics: %s", text.rstrip())

    def flush(self) -> None:
        pass


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Scrapes every few seconds would flood the log."""

    def get_stderr(self) -> Any:
        return _LogWriter()


def start_metrics_server(registry: Collector, host: str = "127.0.0.1", port: int = 9466, *,
                         ssl_context: ssl.SSLContext | None = None,
                         authorize: Authorize | None = None,
                         request_timeout: float = REQUEST_TIMEOUT_SECONDS,
                         max_connections: int = MAX_CONNECTIONS,
                         max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS) -> tuple[Any, int]:
    """Serve ``/metrics`` for ``registry`` on a daemon thread.

    Each connection gets a thread, so both its life and their number are
    bounded (:mod:`.connections`): a connection is ended ``request_timeout``
    after it was accepted, whatever it does meanwhile (idle, dripping bytes,
    a TLS handshake never finished), and past ``max_connections`` at once, or
    ``max_per_address`` from one address, new ones are closed at accept.
    Otherwise sockets opened without a token would each hold a thread for as
    long as they stayed open.

    Args:
        registry: The injected registry.
        host: Bind address (the gRPC host); IPv6 literals work.
        port: TCP port; 0 picks a free one.
        ssl_context: Serve HTTPS with it (the handshake runs on the request's
            thread, so a slow client never stalls accepting).
        authorize: See :func:`make_metrics_app`.
        request_timeout: Seconds a connection may live.
        max_connections: Connections served at once.
        max_per_address: Of those, from one client address.

    Returns:
        ``(server, bound_port)``; stop with :func:`stop_metrics_server`.
    """
    limits = ConnectionLimits(max_connections, max_per_address, request_timeout)

    class _Handler(_QuietHandler):
        # A backstop only, should the reaper die: the deadline above ends the connection first.
        # Equal to the deadline, the two raced and a timed-out read went uncounted as expired.
        timeout = 2 * request_timeout

    class _Server(ThreadingWSGIServer):
        """A subclass, so setting address_family stays local."""

        connection_limits = limits

        def process_request(self, request: Any, client_address: Any) -> None:
            if not limits.admit(request, client_address[0]):
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                limits.release(request)  # no thread started
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                limits.release(request)

        def handle_error(self, request: Any, client_address: Any) -> None:
            exc = sys.exc_info()[1]
            if isinstance(exc, (ssl.SSLError, ConnectionError, TimeoutError)):  # a failed handshake, an idle client
                log.info("/metrics: connection from %s failed: %s", client_address[0], exc)
                return
            super().handle_error(request, client_address)

    _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = make_server(host, port, make_metrics_app(registry, authorize), _Server, handler_class=_Handler)
    if ssl_context is not None:
        server.socket = ssl_context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    # A scrape's rendering yields the CPU to the model; request threads inherit the value.
    thread = telemetry_thread(server.serve_forever, "layertap-metrics")
    thread.start()
    return server, int(server.server_address[1])


def stop_metrics_server(server: Any) -> None:
    """Stop serving and close the socket."""
    server.shutdown()
    limits = getattr(server, "connection_limits", None)
    if limits is not None:
        limits.close()
    server.server_close()
