"""HTTP/2 limits of the gRPC listeners: what one connection may make the server do.

grpc's core enforces these below Python, before a call costs the server a
Python object, a GIL hand-over or a log line; the names are grpc-core channel
arguments (``src/core/ext/transport/chttp2/transport``). Measured against
HTTP/2 rapid reset in docs/benchmarks.md ("session 9: HTTP/2 abuse").
"""

from __future__ import annotations

from typing import Final

__all__ = ["HEALTH_LISTENER_OPTIONS", "SERVER_OPTIONS"]

#: SETTINGS_MAX_CONCURRENT_STREAMS the server announces on each connection.
#: With grpc's overload protection (on by default) a connection that has more
#: streams than this still allocated is refused new ones with REFUSED_STREAM
#: in the transport. A stream a client resets stays allocated until Python has
#: taken its call off the queue, so this caps how far one rapid-reset
#: connection can run ahead of the server: the flood is refused in C instead
#: of queueing thousands of dead calls in front of everyone's. 100 is the
#: floor RFC 9113 recommends announcing; a legitimate client needs a few.
MAX_STREAMS_PER_CONNECTION = 100
#: The same for the plaintext health listener: a probe holds one stream at a
#: time and a watcher at most a few (the servicer allows 4 Watches per connection).
HEALTH_MAX_STREAMS_PER_CONNECTION = 8
#: Ping a connection that has been silent this long, and drop it when no
#: acknowledgement comes within KEEPALIVE_TIMEOUT_MS. A client whose host
#: vanished (no FIN, no RST: a pulled cable, a killed VM) otherwise keeps its
#: streams, their admission slots and worker threads for grpc's default of
#: two hours before the server notices.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000

SERVER_OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
HEALTH_LISTENER_OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    ("grpc.max_concurrent_streams", HEALTH_MAX_STREAMS_PER_CONNECTION),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
)
