"""``--health-address``: a plaintext listener serving only ``grpc.health.v1.Health``."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2_grpc

from layertap.server.rpc.admission import StreamAdmission
from layertap.server.rpc.health import HealthServicer
from layertap.server.rpc.malformed import MalformedRequests
from layertap.server.rpc.open_pool import OpenPool, OpenServices
from layertap.server.rpc.transport import HEALTH_LISTENER_OPTIONS

__all__ = ["HEALTH_MAX_CALLS", "HEALTH_MAX_MESSAGE_BYTES", "HEALTH_MAX_STREAMS", "HEALTH_MAX_WATCHES",
           "HEALTH_WORKERS", "start_health_listener"]

log = logging.getLogger("layertap.server")

#: The health listener's pool: Check is quick and Watch holds no worker.
HEALTH_WORKERS = 4
#: Health calls in flight at once (running or waiting for a thread); past it RESOURCE_EXHAUSTED.
HEALTH_MAX_CALLS = 64
#: Health.Watch streams open at once on the health listener.
HEALTH_MAX_STREAMS = 16
#: Watches its servicer admits (in total, per connection).
HEALTH_MAX_WATCHES = (4, 2)
#: Receive limit of the health listener: a HealthCheckRequest is one short name.
HEALTH_MAX_MESSAGE_BYTES = 4096


def start_health_listener(address: str, servicer: HealthServicer
                          ) -> tuple[grpc.Server, int, HealthServicer, OpenPool]:
    """``--health-address``: a plaintext listener serving only ``grpc.health.v1.Health``.

    Docker HEALTHCHECK and kubelet gRPC probes cannot speak TLS. This server
    has a servicer of its own that follows the main one (``servicer``), so it
    reports the same status and goes NOT_SERVING with it, while its watches,
    lock and limits are its own: nothing sent here can hold up the main
    port. It serves nothing else (any other method is
    UNIMPLEMENTED) and needs no token, like Health on the main port; its
    calls run on ``OpenPool`` (returned, for the caller to close). Any
    address is accepted: kubelet probes dial the pod IP, and the listener
    reveals only what the open Health service does (see docs/security.md).
    """
    # Health runs on an OpenPool (a call stalled on its request gives its
    # thread up to a probe); grpc's own pool only ever sees "Method not found".
    pool = OpenPool(HEALTH_WORKERS, limit=HEALTH_MAX_CALLS, name="layertap-health")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="layertap-health-grpc"),
        # A health request is a service name: a few KiB is plenty, and a
        # stranger cannot make the probe port buffer megabytes.
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", HEALTH_MAX_MESSAGE_BYTES),
                 *HEALTH_LISTENER_OPTIONS],
        maximum_concurrent_rpcs=None,  # the pool's limit: grpc's would count Watches and stalled calls alike
        interceptors=[OpenServices(pool, frozenset({"grpc.health.v1.Health"})),
                      StreamAdmission(HEALTH_MAX_STREAMS, flag="the health listener's stream limit"),
                      MalformedRequests()],
    )
    own = HealthServicer(max_watches=HEALTH_MAX_WATCHES[0], max_watches_per_connection=HEALTH_MAX_WATCHES[1])
    health_pb2_grpc.add_HealthServicer_to_server(own, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises instead of returning 0
        port = 0
    if port == 0:
        own.close()
        pool.close()
        raise OSError(f"--health-address {address}: cannot bind (in use, or not HOST:PORT?)")
    server.start()
    servicer.follow(own)
    host = address.rsplit(":", 1)[0]
    log.info("health listener (plaintext, grpc.health.v1.Health only) on %s:%d", host, port)  # port 0: the one chosen
    return server, port, own, pool
