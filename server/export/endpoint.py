"""The ``/metrics`` HTTP endpoint, serving :func:`render_latest` for an injected registry.

A WSGI app of our own (not ``prometheus_client.start_http_server``) so the
fast writer is what gets served and scrape requests stay out of the log.
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer
from prometheus_client.registry import Collector

from layertap.server.export.exposition import render_latest

log = logging.getLogger("layertap.server")

__all__ = ["make_metrics_app", "start_metrics_server", "stop_metrics_server"]


#: Checks a scrape's ``Authorization`` header; returns why it is refused, or None.
Authorize = Callable[[str | None], str | None]


def make_metrics_app(registry: Collector, authorize: Authorize | None = None) -> Callable[..., list[bytes]]:
    """A WSGI app serving :func:`render_latest` (text format 0.0.4) on any GET path.

    With ``authorize``, a scrape without an accepted bearer token gets 401.
    """

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if authorize is not None and (why := authorize(environ.get("HTTP_AUTHORIZATION"))) is not None:
            body = f"401 Unauthorized: {why}\n".encode()
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Bearer realm="layertap"'),
                                                ("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("404 Not Found", [])
            return [b""]
        body = render_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Scrapes every few seconds would flood the log."""


def start_metrics_server(registry: Collector, host: str = "127.0.0.1", port: int = 9466, *,
                         ssl_context: ssl.SSLContext | None = None,
                         authorize: Authorize | None = None) -> tuple[Any, int]:
    """Serve ``/metrics`` for ``registry`` on a daemon thread.

    Args:
        registry: The injected registry.
        host: Bind address (the gRPC host); IPv6 literals work.
        port: TCP port; 0 picks a free one.
        ssl_context: Serve HTTPS with it (the handshake runs on the request's
            thread, so a slow client never stalls accepting).
        authorize: See :func:`make_metrics_app`.

    Returns:
        ``(server, bound_port)``; stop with :func:`stop_metrics_server`.
    """

    class _Server(ThreadingWSGIServer):
        """A subclass, so setting address_family stays local."""

        def handle_error(self, request: Any, client_address: Any) -> None:
            exc = sys.exc_info()[1]
            if isinstance(exc, (ssl.SSLError, ConnectionError)):  # a failed handshake: no traceback
                log.info("/metrics: connection from %s failed: %s", client_address[0], exc)
                return
            super().handle_error(request, client_address)

    _Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = make_server(host, port, make_metrics_app(registry, authorize), _Server, handler_class=_QuietHandler)
    if ssl_context is not None:
        server.socket = ssl_context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=server.serve_forever, name="layertap-metrics", daemon=True)
    thread.start()
    return server, int(server.server_address[1])


def stop_metrics_server(server: Any) -> None:
    """Stop serving and close the socket."""
    server.shutdown()
    server.server_close()
